"""Checkpoints and resume from plain Python: Keras' own `keras.callbacks.BackupAndRestore` under
`meshfit.connect()` on 8 simulated devices, as docs/guides/checkpoints.md tells a `model.fit`
user. A fit stopped after epoch 1 and run again resumes at epoch 2 (from the weights and
optimizer state saved then) and ends with the weights of a fit that was never stopped. And
Keras' saving from a job of 2 processes under fsdp (meshfit.fit.saving)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest


def samples():
    """128 rows of 6 features and 3 classes: 4 steps of 32, 4 rows per device on 8 (the job's
    program below draws the same)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 6)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0)


def fit(strategy, x, y, epochs, callbacks=()):
    """A small model fitted from seed 0 with plain model.fit; its weights and History."""
    import keras

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return [np.asarray(w) for w in model.get_weights()], history


class StopAt:
    """A Keras callback that fails at the start of epoch `epoch` (0-based), as a crash would."""

    def __new__(cls, epoch):
        import keras

        class Stop(keras.callbacks.Callback):
            def on_epoch_begin(self, index, logs=None):
                if index == epoch:
                    raise RuntimeError(f"stopped at epoch {index}")

        return Stop()


def test_backup_and_restore_resumes_at_the_epoch_and_ends_as_an_unstopped_fit(strategy, tmp_path):
    import keras

    assert strategy.replicas == 8
    x, y = samples()
    expected, _ = fit(strategy, x, y, epochs=3)

    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="stopped at epoch 2"):
        fit(strategy, x, y, epochs=3,
            callbacks=[keras.callbacks.BackupAndRestore(backup), StopAt(2)])
    resumed, history = fit(strategy, x, y, epochs=3,
                           callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert history.epoch == [2]  # only the epoch that was not done
    for got, want in zip(resumed, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_reading_a_variable_takes_numpys_copy_without_a_warning(strategy):
    """numpy 2 asks __array__ for `copy`; Keras' Variable.__array__ lacks it, so every
    np.array(variable) (Keras' own saving and get_weights make many) warned a DeprecationWarning.
    meshfit's wrapper of it takes `copy`, and copy=True gives an array of its own."""
    import warnings

    import keras

    with strategy.scope():
        variable = keras.Variable(np.arange(8.0, dtype="float32"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copied = np.array(variable, copy=True)
        shared = np.asarray(variable, dtype="float64")
    copied[0] = 5.0
    assert float(np.asarray(variable)[0]) == 0.0 and shared.dtype == np.float64


USER_PROGRAM = textwrap.dedent("""
    import sys
    import time

    import numpy as np

    import meshfit

    strategy = meshfit.connect(sharding="fsdp", fsdp_min_bytes=1, verbose=False)
    import jax
    import keras

    folder = sys.argv[1]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    assert not model.layers[0].kernel.value.is_fully_addressable  # split across the processes
    if jax.process_index() == 0:  # a slow last write (a busy disk): the other process's removal
        from keras.src.saving import saving_lib  # of the backup folder must wait for it

        close = saving_lib.H5IOStore.close

        def slow_close(self, *args, **kwargs):
            time.sleep(2)
            return close(self, *args, **kwargs)

        slow_close.renames = True  # still meshfit's renaming close
        saving_lib.H5IOStore.close = slow_close
    model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(folder + "/backup"),
                         keras.callbacks.ModelCheckpoint(folder + "/last.keras"),
                         keras.callbacks.CSVLogger(folder + "/log.csv", append=True)])
    model.save(folder + "/model.keras")
    model.save_weights(folder + "/model.weights.h5")
    model.export(folder + "/saved_model", verbose=False)
    np.savez(f"{folder}/got-{jax.process_index()}.npz", *model.get_weights())
""")


def _launched(tmp_path, text: str, devices: int):
    """The folder `text`, a user program, wrote into when run by 2 processes of `devices` devices
    each under meshfit launch (which must succeed)."""
    program = tmp_path / "user_program.py"
    program.write_text(text)
    folder = tmp_path / "shared"
    folder.mkdir()
    done = subprocess.run([sys.executable, "-m", "meshfit", "launch", "--processes", "2",
                           "--devices-per-process", str(devices), "--", sys.executable, str(program),
                           str(folder)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return folder


def test_a_job_of_two_processes_saves_an_fsdp_model_with_keras_own_calls(strategy, tmp_path):
    """Every process runs the same program: BackupAndRestore and ModelCheckpoint each epoch, then
    model.save, save_weights and get_weights, on variables split across the 2 processes' 4
    devices, into one folder they share (and model.export). It failed at the first save (JAX: "Fetching value for
    `jax.Array` that spans non-addressable ... devices"); with the variables replicated, the two
    writers of one .weights.h5 failed in h5py ("name already exists") and BackupAndRestore's
    removal of its folder raced (FileNotFoundError), also when process 1 removed the folder while
    process 0 still wrote its last backup (its close slowed by 2 s here). Now each file is whole
    (the trained weights of the same fit on this process's 8 devices), and nothing else is left
    in the folder."""
    import keras

    folder = _launched(tmp_path, USER_PROGRAM, devices=2)
    assert sorted(os.listdir(folder)) == ["got-0.npz", "got-1.npz", "last.keras", "log.csv",
                                          "model.keras", "model.weights.h5", "saved_model"]
    # CSVLogger(append=True): each epoch's line once (every process wrote each)
    assert [line.split(",")[0] for line in (folder / "log.csv").read_text().splitlines()] == ["epoch", "0", "1", "2"]
    expected, _ = fit(strategy, *samples(), epochs=3)
    saved = keras.saving.load_model(folder / "model.keras")
    weights_only = keras.models.clone_model(saved)  # the architecture, its own weights
    weights_only.load_weights(folder / "model.weights.h5")
    for got in (saved.get_weights(), keras.saving.load_model(folder / "last.keras").get_weights(),
                weights_only.get_weights(), *(list(np.load(folder / f"got-{i}.npz").values())
                                              for i in (0, 1))):
        for value, want in zip(got, expected, strict=True):
            np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6)
    # model.export (a SavedModel, written by process 0) answers as the trained model
    import tensorflow as tf

    x, reloaded = samples()[0][:5], tf.saved_model.load(str(folder / "saved_model"))
    np.testing.assert_allclose(reloaded.serve(x).numpy(), saved.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_a_slow_last_backup_is_not_removed_under_it(tmp_path):
    """BackupAndRestore on 2 processes, variables replicated: process 0's last backup closes 2 s
    late (a busy disk), and process 1, done first, removed the backup folder meanwhile, so process
    0's rename failed (FileNotFoundError) after training had finished. Each now meets the other
    before the removal."""
    folder = _launched(tmp_path, USER_PROGRAM.replace('sharding="fsdp", fsdp_min_bytes=1', 'sharding="data"')
                       .replace("    assert not model.layers[0].kernel.value.is_fully_addressable", ""),
                       devices=1)
    assert "backup" not in os.listdir(folder)


ALONE_PROGRAM = textwrap.dedent("""
    import os
    import sys
    import time

    import numpy as np

    import meshfit

    folder, when = sys.argv[1], sys.argv[2]
    strategy = meshfit.connect(sharding="data" if when == "replicated" else "fsdp",
                               fsdp_min_bytes=1, verbose=False)
    import jax
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16)])
        model.compile(optimizer="adam", loss="mse")
    kernel = model.layers[0].kernel.value
    assert not kernel.is_fully_addressable and kernel.is_fully_replicated == (when == "replicated")
    marker = folder + ".process-0-saves"  # beside the folder: it holds only what the save writes
    if when == "late" and jax.process_index() == 0:
        open(marker, "w").close()
    if when == "late" and jax.process_index() == 1:  # work of its own before the save every
        while not os.path.exists(marker):  # process makes: 11 s from process 0's arrival,
            time.sleep(0.05)  # however late either started on a loaded machine
        time.sleep(11)
    if when == "predict" and jax.process_index() == 0:
        model.predict(np.ones((4, 6), "float32"), verbose=0)
    if when == "computed" and jax.process_index() == 0:  # as keras-hub's generate: a program of
        # every process's devices, its result whole on each, read on process 0 alone
        whole = jax.sharding.NamedSharding(kernel.sharding.mesh, jax.sharding.PartitionSpec())
        keras.ops.convert_to_numpy(jax.jit(lambda k: k.sum(axis=0), out_shardings=whole)(kernel))
    if when == "late" or (when in ("alone", "replicated") and jax.process_index() == 0):
        model.save(folder + "/model.keras")
""")


@pytest.mark.parametrize("when", ["alone", "late", "predict", "computed", "replicated"])
def test_a_save_or_predict_on_process_zero_alone_is_one_line_naming_the_fix(tmp_path, when):
    """The common `if jax.process_index() == 0: model.save(...)` on variables split across the
    processes cannot gather them (the others never read them), nor can predict, or a program of
    every process's devices (keras-hub's generate), run on process 0 alone: each waited in a
    collective, until the stall guard ended the job 600 s later with a line that could not say
    why, or for ever (generate). Now a warning names the fix after half the wait (here 4.5 s of
    9, 90% of a stall timeout of 10 s), and the call fails at the end of it, leaving no file. A
    process that comes late (11 s; the warning at 9 s of 18) to a save that every process makes
    meets the others after the warning: the save succeeds; and so does a save on process 0 alone
    of variables every process holds whole."""
    program = tmp_path / "user_program.py"
    program.write_text(ALONE_PROGRAM)
    folder = tmp_path / "shared"
    folder.mkdir()
    done = subprocess.run([sys.executable, "-m", "meshfit", "launch", "--processes", "2",
                           "--devices-per-process", "2", "--", sys.executable, str(program),
                           str(folder), when],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MESHFIT_STALL_TIMEOUT": "20" if when == "late" else "10"})
    out = done.stdout + done.stderr
    if when == "replicated":
        assert done.returncode == 0 and "meshfit: warning" not in out, out[-4000:]
        assert os.listdir(folder) == ["model.keras"]
        return
    doing = {"predict": "calls predict, which runs on the devices of all 2 processes",
             "computed": "reads a value computed on the devices of all 2 processes"}.get(
        when, "reads a value split across the job's 2 processes (a variable under fsdp or model "
              "parallel, or generate's tokens)")
    warning = f"[0] meshfit: warning: process 0 {doing} and has waited"
    assert warning in out and "not under `if jax.process_index() == 0`" in out, out[-4000:]
    assert "[1] meshfit: warning" not in out, out[-4000:]  # the late one waited for no one
    if when == "late":
        assert done.returncode == 0, out[-4000:]
        assert os.listdir(folder) == ["model.keras"]
        return
    assert done.returncode != 0 and "hung" not in out, out[-4000:]  # the read's verdict, not the guard's
    ending = ("its computation did not end within 9 s" if when == "computed" else
              "the others did not come to it within 9 s")
    assert f"MeshfitError: process 0 {doing} and {ending}" in out, out[-4000:]
    assert os.listdir(folder) == []
