"""A run resumed in the middle of an epoch: what its callbacks see and what its history records."""

import json
import os
import subprocess
import sys

import numpy as np
from helpers import N_TRAIN, SIGNAL_AT, cli_env, environment, run_meshfit


class Batches:
    """`steps_per_epoch` batches of 16 rows per epoch; iterate(epoch, step) yields from step
    `step` of epoch `epoch` on, as the run's batches do."""

    steps_per_epoch = 4

    def iterate(self, epoch, step=0):
        rng = np.random.default_rng(epoch)
        for _ in range((10 - epoch) * self.steps_per_epoch - step):
            yield rng.normal(size=(16, 3)).astype("float32"), rng.integers(0, 2, 16)


class NoCheckpoints:
    """What fit_and_score.fit's stop_on_signals needs of a checkpointer, saving nothing."""

    stop_signal, saving, interrupted = None, False, False

    def request_stop(self, signum):
        self.stop_signal = signum

    def wait(self):
        return None


def test_a_cut_epochs_callbacks_see_the_runs_epochs(strategy):
    """Resumed at step 2 of epoch 1 of 3, the bar and the epoch line say 1/3 (they said 1/1:
    the cut epoch is a fit of its own, of one epoch)."""
    import keras

    from meshfit.run.keras_side import fit_and_score

    seen = []

    class Seen(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append((epoch + 1, self.params["epochs"]))

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    fit_and_score.fit(strategy, model, Batches(), [Seen()], NoCheckpoints(), (0, 2), 3)
    assert seen == [(1, 3), (2, 3), (3, 3)]


def test_a_cut_epochs_record_counts_every_sessions_steps(data_dir, tmp_path):
    """Stopped by SIGINT after step 6 of 8 and resumed: epoch 1's record counts all 8 steps
    (samples, train_seconds) and `meshfit runs` its samples/s; it counted the last 2 only."""
    run = str(tmp_path / "run")
    stop = subprocess.run([sys.executable, "-c", SIGNAL_AT, data_dir, run, "0", "5", "SIGINT"],
                          capture_output=True, text=True, timeout=300, env=environment(cli_env(tmp_path)))
    assert "stopped by SIGINT after step 6" in stop.stderr, stop.stderr
    state = json.load(open(os.path.join(run, "checkpoints", "ckpt-00000006", "state.json")))
    assert state["epoch_so_far"]["steps"] == 6 and state["epoch_so_far"]["train_seconds"] > 0
    out = run_meshfit("train", "--resume", run, env=cli_env(tmp_path))
    assert out.returncode == 0, out.stderr
    history = json.load(open(os.path.join(run, "history.json")))
    assert [r["samples"] for r in history] == [N_TRAIN, N_TRAIN]
    assert history[0]["train_seconds"] > state["epoch_so_far"]["train_seconds"]
