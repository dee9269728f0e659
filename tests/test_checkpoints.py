"""Checkpoints and exact resume: killed, interrupted and resumed runs on small generated data."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import N_TRAIN, SIGNAL_AT, cli_env, connect_eight_devices, environment, run_meshfit

from meshfit.errors import MeshfitError

# conftest's data_dir: N_TRAIN images in fashion-mnist/ and mnist/
BATCH = 16  # 8 steps per epoch
STEPS = N_TRAIN // BATCH


def newest_state(run):
    from meshfit.run import checkpoint_format

    return checkpoint_format.read_state(checkpoint_format.latest(os.path.join(run, "checkpoints")))


def final_arrays(run):
    """The arrays of a finished run's last checkpoint (model, optimizer and metrics variables)."""
    from meshfit.run import checkpoint_format

    return checkpoint_format.read_arrays(os.path.join(run, "checkpoints", f"ckpt-{2 * STEPS:08d}"))


def assert_identical(run_a, run_b):
    a, b = final_arrays(run_a), final_arrays(run_b)
    assert sorted(a) == sorted(b)
    different = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not different, f"arrays differ: {different}"
    history_a = json.loads(open(os.path.join(run_a, "history.json")).read())
    history_b = json.loads(open(os.path.join(run_b, "history.json")).read())
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):  # the interrupted epoch's too
        assert [r[key] for r in history_a] == [r[key] for r in history_b], key


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_ends_with_identical_weights(data_dir, tmp_path):
    """On TensorFlow, with each batch's gradient summed over 2 micro-batches (kept on resume)."""
    tf_env = cli_env(tmp_path, "tensorflow")
    env = environment({**tf_env, "KERAS_BACKEND": "tensorflow"})  # the snippet imports keras itself
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    out = run_meshfit("train", "--data-dir", data_dir, "--out", whole, "--epochs", "2",
                      "--global-batch", str(BATCH), "--checkpoint-every", "3", "--micro-batches", "2",
                      env=tf_env)
    assert out.returncode == 0, out.stderr
    run = subprocess.run([sys.executable, "-c", SIGNAL_AT, data_dir, killed, "1", "4", "SIGKILL", "2"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == -signal.SIGKILL, run.stderr
    state = newest_state(killed)
    assert (state["epoch"], state["step"]) == (1, 4)  # newer than the start of epoch 2
    assert not os.path.exists(os.path.join(killed, "model.keras"))
    out = run_meshfit("train", "--resume", killed, env=tf_env)
    assert out.returncode == 0, out.stderr
    assert "resuming" in out.stdout and "epoch 2 step 4" in out.stdout
    assert "2 cache-sized micro-batches" in out.stdout
    assert_identical(whole, killed)
    config = json.loads(open(os.path.join(killed, "config.json")).read())
    assert config["resumed"][0]["checkpoint"] == "ckpt-00000012" and config["micro_batches"] == 2


@pytest.fixture(scope="module")
def finished_run(data_dir, tmp_path_factory):
    """A 2-epoch mnist-mlp-bf16 run on 8 replicas, checkpointed at each epoch end.

    Its Dropout makes exact resume depend on the checkpointed SeedGenerator state.
    """
    from meshfit.run.train import train

    run = str(tmp_path_factory.mktemp("runs") / "run")
    train("mnist-mlp-bf16", out=run, **jax_settings(data_dir))
    return run


@pytest.fixture(scope="module")
def finished_fsdp_run(data_dir, tmp_path_factory):
    """finished_run with sharding fsdp: its kernels of 10 KB and more (both, 1.6 MB and 20 KB)
    sharded over the 8 devices, in its checkpoints as the shards each device held; a resumed run
    keeps the threshold (with the default 1 MiB the 20 KB kernel would be replicated: another
    program, which for other models rounds differently)."""
    from meshfit.run.train import train

    run = str(tmp_path_factory.mktemp("runs") / "fsdp")
    train("mnist-mlp-bf16", out=run, **jax_settings(data_dir, "fsdp"))
    return run


def jax_settings(data_dir, sharding="data"):
    return dict(data_dir=data_dir, epochs=2, global_batch=BATCH, engine="jax", simulate_devices=8,
                checkpoint_every="epoch", verbose=False, sharding=sharding,
                fsdp_min_bytes="10KB")


@pytest.mark.slow  # with finished_run
@pytest.mark.parametrize("sharding", ["data", "fsdp"])
def test_sigterm_saves_stops_and_resumes_exactly_on_jax_with_dropout(sharding, data_dir, tmp_path,
                                                                     request):
    import keras

    from meshfit import TrainingInterrupted
    from meshfit.run.train import train

    class SigtermAt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if (self.epoch, batch) == (1, 2):
                os.kill(os.getpid(), signal.SIGTERM)

    stopped = str(tmp_path / "stopped")
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingInterrupted, match=f"meshfit train --resume {stopped}") as info:
        train("mnist-mlp-bf16", out=stopped, callbacks=[SigtermAt()], **jax_settings(data_dir, sharding))
    assert info.value.exit_code == 143
    state = newest_state(stopped)
    assert (state["epoch"], state["step"]) == (1, 3)  # the step in flight finished, then it stopped
    assert len(state["history"]) == 1  # the first epoch's record
    assert any("seed_generator" in name for name, _, _ in state["variables"]["model"])
    assert signal.getsignal(signal.SIGTERM) is handler  # put back
    metrics = train(resume=stopped, verbose=False)
    assert metrics["resumed"] and metrics["epochs"] == 2 and metrics["sharding"] == sharding
    assert metrics["fsdp_min_bytes"] == 10_000  # kept: the same variables sharded, the same program
    assert_identical(request.getfixturevalue("finished_fsdp_run" if sharding == "fsdp" else
                                             "finished_run"), stopped)


@pytest.mark.slow  # with finished_run
def test_a_run_lost_after_a_local_copy_resumes_from_it_to_identical_weights(data_dir, tmp_path,
                                                                            finished_run, monkeypatch):
    """A run that dies in epoch 2 (an error: nothing saved at the end) after local copies newer
    than its epoch-1 checkpoint resumes from the newest and ends as if never stopped."""
    import keras

    from meshfit import env
    from meshfit.run import local_copies
    from meshfit.run.train import train

    class Lost(Exception):
        pass

    class LostAt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if (self.epoch, batch) == (1, 5):
                raise Lost

    monkeypatch.setenv(env.LOCAL_COPIES, str(tmp_path / "local"))
    lost = str(tmp_path / "lost")
    with pytest.raises(Lost):
        train("mnist-mlp-bf16", out=lost, callbacks=[LostAt()], local_copy_every=2,
              **jax_settings(data_dir))
    assert newest_state(lost)["global_step"] == STEPS  # the epoch-1 checkpoint
    metrics = train(resume=lost, verbose=False)
    resumed = json.loads(open(os.path.join(lost, "config.json")).read())["resumed"][0]["checkpoint"]
    assert resumed in (f"local:ckpt-{STEPS + 4:08d}", f"local:ckpt-{STEPS + 2:08d}"), resumed
    assert metrics["epochs"] == 2
    assert_identical(finished_run, lost)
    assert not os.path.exists(local_copies.folder_of(lost))  # removed once the run finished


@pytest.mark.slow
def test_cli_sigterm_exits_143_with_a_resume_hint_then_resume_finishes(data_dir, tmp_path):
    tf_env = cli_env(tmp_path, "tensorflow")
    run = str(tmp_path / "run")
    process = subprocess.Popen(
        [sys.executable, "-m", "meshfit", "train", "--data-dir", data_dir, "--out", run,
         "--epochs", "1000", "--global-batch", str(BATCH), "--checkpoint-every", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(tf_env))
    try:
        for line in process.stdout:
            if line.startswith("epoch 1/1000"):
                break
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 143, stderr
    messages = [l for l in stderr.splitlines() if l.startswith("meshfit")]
    assert len(messages) == 1 and "Traceback" not in stderr
    assert "FAILED_PRECONDITION" not in stderr, stderr  # TensorFlow's dataset, freed at exit
    assert "stopped by SIGTERM" in messages[0] and f"meshfit train --resume {run}" in messages[0]
    state = newest_state(run)  # "off" writes no checkpoint but the one taken on the signal
    assert state["epoch"] * STEPS + state["step"] >= STEPS
    out = run_meshfit("train", "--resume", run, "--epochs", str(state["epoch"] + 1), env=tf_env)
    assert out.returncode == 0, out.stderr
    history = json.loads(open(os.path.join(run, "history.json")).read())
    assert [r["epoch"] for r in history] == list(range(1, state["epoch"] + 2))


def small_model(strategy, recipe="fashion-mnist-cnn"):
    import keras

    from meshfit import recipes

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = recipes.get(recipe).build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.optimizer.build(model.trainable_variables)
    return model


def test_interrupted_write_leaves_the_previous_checkpoint(strategy, tmp_path, monkeypatch):
    import keras

    from meshfit.run import checkpoint_format
    from meshfit.run.keras_side import checkpoint_restore, checkpoint_save

    model = small_model(strategy)
    directory = tmp_path / "checkpoints"
    first = checkpoint_save.save(directory, model, epoch=0, step=1, steps_per_epoch=10)
    saved_kernel = keras.ops.convert_to_numpy(model.trainable_variables[0])
    model.trainable_variables[0].assign(np.zeros(model.trainable_variables[0].shape))

    def crash(file, **arrays):  # half a file, then the process "dies"
        file.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_save.np, "savez", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_save.save(directory, model, epoch=0, step=2, steps_per_epoch=10)
    monkeypatch.undo()
    # A crash that left debris behind: a temporary folder and a folder without a manifest.
    (directory / ".tmp-leftover").mkdir()
    (directory / "ckpt-00000003").mkdir()
    assert checkpoint_format.latest(directory) == first
    assert sorted(os.listdir(directory)) == [".tmp-leftover", "ckpt-00000001", "ckpt-00000003"]
    state = checkpoint_restore.restore(model, first)
    assert (state["epoch"], state["step"]) == (0, 1)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.trainable_variables[0]), saved_kernel)
    checkpoint_save.save(directory, model, epoch=0, step=4, steps_per_epoch=10)  # clears the debris
    assert sorted(os.listdir(directory)) == ["ckpt-00000001", "ckpt-00000004"]


def test_keeps_the_newest_checkpoints(strategy, tmp_path):
    from meshfit.run import rundir
    from meshfit.run.keras_side import checkpoint_save

    model = small_model(strategy)
    for step in range(1, 6):
        checkpoint_save.save(tmp_path, model, epoch=0, step=step, steps_per_epoch=10, keep=2)
    assert [os.path.basename(p) for p in rundir.list_checkpoints(tmp_path)] == \
        ["ckpt-00000004", "ckpt-00000005"]


def test_checkpoint_of_another_model_is_a_clear_error(strategy, tmp_path):
    from meshfit.run.keras_side import checkpoint_restore, checkpoint_save

    path = checkpoint_save.save(tmp_path, small_model(strategy, "mnist-mlp-bf16"), epoch=0, step=1,
                                steps_per_epoch=10)
    with pytest.raises(MeshfitError, match="does not fit this model") as info:
        checkpoint_restore.restore(small_model(strategy), path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("change, message", [
    ({"recipe": "cifar10-cnn"}, "trained with recipe mnist-mlp-bf16, not cifar10-cnn"),
    ({"global_batch": 32}, "trained with global batch 16, not 32"),
    ({"seed": 7}, "trained with seed 0, not 7"),
    ({"precision": "float32"}, "trained in bfloat16, not float32"),
])
def test_resume_with_other_settings_is_a_clear_error(finished_run, change, message):
    from meshfit.run.train import train

    with pytest.raises(MeshfitError, match=message) as info:
        train(resume=finished_run, **change)
    assert "\n" not in str(info.value)


def test_resume_of_a_folder_without_a_run_is_a_clear_error(tmp_path):
    from meshfit.run.train import train

    with pytest.raises(MeshfitError, match="has no config.json"):
        train(resume=str(tmp_path))


@pytest.mark.slow  # with finished_run
def test_a_damaged_newest_checkpoint_resumes_from_the_previous_to_identical_weights(finished_run,
                                                                                  tmp_path):
    import shutil

    from meshfit.run.train import train

    copy = str(tmp_path / "copy")
    shutil.copytree(finished_run, copy)
    newest = os.path.join(copy, "checkpoints", f"ckpt-{2 * STEPS:08d}")
    shards = [os.path.join(root, name) for root, _, names in os.walk(os.path.join(newest, "arrays"))
              for name in names]  # JAX: the model's and optimizer's arrays, written by orbax
    largest = max(shards, key=os.path.getsize)
    os.truncate(largest, os.path.getsize(largest) // 2)  # a kill mid-copy, a bad disk
    with pytest.warns(UserWarning, match=f"ckpt-{2 * STEPS:08d} is damaged.*resuming from "
                                         f"ckpt-{STEPS:08d}"):
        train(resume=copy, verbose=False)
    assert_identical(finished_run, copy)  # epoch 2 trained again, its checkpoint written again
    config = json.loads(open(os.path.join(copy, "config.json")).read())
    assert config["resumed"][-1]["checkpoint"] == f"ckpt-{STEPS:08d}"


@pytest.mark.slow  # with finished_run
# (onto one device: test_a_sharded_checkpoint_restores_onto_other_device_counts)
@pytest.mark.parametrize("sharding, devices", [("data", 4), ("fsdp", 4)])
def test_resume_on_fewer_replicas_continues_the_same_run(sharding, devices, tmp_path, request):
    """Epoch 2 of an 8-replica run redone on 4: same batches, so nearly the same weights;
    an fsdp run's arrays are read laid out for the devices there are now."""
    import shutil

    finished = request.getfixturevalue("finished_fsdp_run" if sharding == "fsdp" else "finished_run")
    copy = str(tmp_path / "copy")
    shutil.copytree(finished, copy)
    shutil.rmtree(os.path.join(copy, "checkpoints", f"ckpt-{2 * STEPS:08d}"))  # back to epoch 1's end
    out = run_meshfit("train", "--resume", copy, "--simulate-devices", str(devices),
                      env={"MESHFIT_OFFLINE": "1", "XLA_FLAGS": ""})
    assert out.returncode == 0, out.stderr
    assert "epoch 2 step 0" in out.stdout and "began on 8 replica(s)" in out.stdout
    assert json.loads(open(os.path.join(copy, "metrics.json")).read())["replicas"] == devices
    original, resumed = final_arrays(finished), final_arrays(copy)
    for key in original:
        if key.startswith("model/"):
            np.testing.assert_allclose(resumed[key], original[key], rtol=1e-3, atol=1e-4, err_msg=key)


@pytest.mark.slow  # with finished_run
def test_steps_per_dispatch_train_the_same_run_and_resume_mid_dispatch(finished_run, data_dir,
                                                                       tmp_path):
    """4 steps per dispatch: the same weights as 1, checkpoints at dispatch boundaries; resumed
    with 8 per dispatch, the rest of the cut epoch (4 steps) runs as one dispatch of 4."""
    import shutil

    from meshfit.run.train import train

    run = str(tmp_path / "k4")
    settings = {**jax_settings(data_dir), "checkpoint_every": "3"}
    metrics = train("mnist-mlp-bf16", out=run, steps_per_dispatch=4, **settings)
    assert metrics["steps_per_dispatch"] == 4
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == [
        "ckpt-00000008", "ckpt-00000012", "ckpt-00000016"]  # step 12 is the first past 9
    history = json.loads(open(os.path.join(run, "history.json")).read())
    assert [r["samples"] for r in history] == [N_TRAIN, N_TRAIN]

    def assert_close(run_b):
        a, b = final_arrays(finished_run), final_arrays(run_b)
        for key in a:
            if key.startswith("model/"):
                np.testing.assert_allclose(b[key], a[key], rtol=1e-3, atol=1e-4, err_msg=key)

    assert_close(run)
    shutil.rmtree(os.path.join(run, "checkpoints", "ckpt-00000016"))  # back to epoch 2, step 4
    metrics = train(resume=run, steps_per_dispatch=8, verbose=False)
    assert metrics["resumed"] and metrics["steps_per_dispatch"] == 8
    assert_close(run)
    assert train(resume=run, epochs=3, steps_per_dispatch=3, verbose=False)["steps_per_dispatch"] == 2


def mlp_under(devices, mode, seed=0):
    """A compiled 32-64-10 MLP with Adam built under `mode` over `devices` (None: no
    distribution, one device), its optimizer built."""
    import keras

    from meshfit.fit import strategy

    keras.distribution.set_distribution(strategy.keras_distribution(devices, mode, 1) if devices else None)
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)
    return model


def test_a_sharded_checkpoint_restores_onto_other_device_counts(strategy, tmp_path):
    """Written with fsdp by 8 devices (each array as its shards, by orbax), by 4, and by one; read
    onto each of the others: the same values, each laid out for the devices it is read onto."""
    import jax
    import keras

    from meshfit.run import checkpoint_format
    from meshfit.run.keras_side import checkpoint_restore, checkpoint_save

    devices = jax.devices()
    try:
        for source, targets in ((devices, (devices[:4], None)), (devices[:4], (devices,)),
                                (None, (devices,))):
            model = mlp_under(source, "fsdp")
            if source:
                assert "batch" in model.trainable_variables[0].value.sharding.spec  # really sharded
            path = checkpoint_save.save(tmp_path / str(len(source or [0])), model, epoch=0, step=1,
                                        steps_per_epoch=10)
            assert checkpoint_format.read_state(path)["format"] == 3
            assert os.path.isdir(os.path.join(path, "arrays", "ocdbt.process_0"))
            saved = [keras.ops.convert_to_numpy(v.value) for v in model.variables + model.optimizer.variables]
            for target in targets:
                other = mlp_under(target, "fsdp", seed=1)
                checkpoint_restore.restore(other, path)
                for v, want in zip(other.variables + other.optimizer.variables, saved, strict=True):
                    np.testing.assert_array_equal(keras.ops.convert_to_numpy(v.value), want, err_msg=v.path)
                layout = other.trainable_variables[0].value.sharding
                assert len(layout.device_set) == (len(target) if target else 1)
                if target:
                    assert "batch" in layout.spec
    finally:
        connect_eight_devices()


def test_npz_checkpoints_still_resume_on_jax(strategy, tmp_path):
    """Format 2 (every array in arrays.npz, as before orbax; still what TensorFlow writes)."""
    import keras

    from meshfit.run import checkpoint_format
    from meshfit.run.keras_side import checkpoint_restore, checkpoint_save

    model = small_model(strategy, "mnist-mlp-bf16")
    path = checkpoint_save.save(tmp_path, model, epoch=0, step=1, steps_per_epoch=10, sharded=False)
    assert checkpoint_format.read_state(path)["format"] == 2 and not os.path.exists(os.path.join(path, "arrays"))
    want = keras.ops.convert_to_numpy(model.trainable_variables[0])
    model.trainable_variables[0].assign(np.zeros(model.trainable_variables[0].shape))
    checkpoint_restore.restore(model, path)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.trainable_variables[0]), want)


def test_a_background_save_counts_only_once_committed(strategy, tmp_path, monkeypatch):
    """begin_save returns while the files are written; until the manifest is, the folder is not
    a checkpoint (latest() is the previous one), and a kill there leaves it to be cleared."""
    import threading

    from meshfit.run import checkpoint_format
    from meshfit.run.keras_side import checkpoint_save

    model = small_model(strategy, "mnist-mlp-bf16")
    first = checkpoint_save.save(tmp_path, model, epoch=0, step=1, steps_per_epoch=10)
    release, commit = threading.Event(), checkpoint_save._commit
    monkeypatch.setattr(checkpoint_save, "_commit", lambda *a: (release.wait(60), commit(*a)))
    pending = checkpoint_save.begin_save(tmp_path, model, epoch=0, step=2, steps_per_epoch=10)
    assert not pending.done() and checkpoint_format.latest(tmp_path) == first
    model.trainable_variables[0].assign(np.zeros(model.trainable_variables[0].shape))  # training goes on
    release.set()
    assert pending.result() == checkpoint_format.latest(tmp_path) != first
    saved = checkpoint_format.read_arrays(pending.result())["model/00000"]
    assert np.abs(saved).sum() > 0  # the state at begin_save, not the zeros written after it


def test_processes_save_by_time_at_the_same_step_whatever_their_clocks(tmp_path):
    """--checkpoint-every 20s in a job of 2 processes: a save is a collective, so the processes
    agree (with the stop vote, one dispatch later) on when 20 s have passed; each deciding by its
    own clock hung the job when the clocks crossed 20 s at different steps (elastic drill)."""
    from meshfit.run.keras_side.checkpoints import Checkpointer

    casts: list[list[int]] = [[], []]

    class Vote:  # hosts.Vote of 2 processes, called in turn at each point: the max one call later
        def __init__(self, index):
            self.index = index

        def cast(self, value):
            casts[self.index].append(value)
            k = len(casts[self.index]) - 1
            return max(c[k - 1] for c in casts) if k else 0

    processes = [Checkpointer(str(tmp_path), 10, every_seconds=20) for _ in range(2)]
    for index, checkpointer in enumerate(processes):
        checkpointer._vote = Vote(index)
    due_from = [2, 3]  # the call at which each process's own clock passes 20 s
    saved: list[list[int]] = [[], []]
    for call in range(8):
        for index, checkpointer in enumerate(processes):
            checkpointer.agreed_stop(due=call >= due_from[index] and not saved[index])
            if checkpointer._due:
                checkpointer._saves += 1  # what save() counts
                saved[index].append(call)
    assert saved == [[3], [3]]  # together, once: the casts before the save are not a second one
