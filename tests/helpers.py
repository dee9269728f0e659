"""Shared test helpers: meshfit subprocesses and their environments, generated data, small models.

Fixtures are in conftest.py; these are the plain functions and constants the test files import.
"""

import glob
import json
import os
import struct
import subprocess
import sys

import numpy as np

# A plain single-CPU process: no simulated devices, and meshfit chooses the engine.
ONE_CPU = {"XLA_FLAGS": "", "KERAS_BACKEND": None, "MESHFIT_ENGINE": None, "MESHFIT_SIMULATE_DEVICES": None}

# The size of the generated datasets of write_idx_dataset (and of conftest's data_dir).
# 37 test images: not a multiple of any batch used in the tests.
N_TRAIN, N_TEST = 128, 37


# `python -c SIGNAL_AT DATA_DIR OUT EPOCH BATCH SIGNAL [MICRO_BATCHES]`: meshfit.run.train.train for
# 2 epochs of global batch 16, a checkpoint every 3 steps, that sends itself SIGNAL (e.g. SIGKILL)
# as batch BATCH of epoch EPOCH (both from 0) begins.
# meshfit.connect() comes before `import keras`, as in the CLI: TensorFlow reads its settings
# (TF_ENABLE_ONEDNN_OPTS) once, when Keras imports it; imported first, TF would run its default,
# which is oneDNN off on CPUs without AVX512-VNNI/BF16, AVX-VNNI or AMX (e.g. AMD EPYC Zen 2/3),
# against oneDNN on in the CLI runs this one is compared with and resumed by.
SIGNAL_AT = """
import os, signal, sys
import meshfit
meshfit.connect(verbose=False)
import keras
from meshfit.run.train import train

class SignalAt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == (int(sys.argv[3]), int(sys.argv[4])):
            os.kill(os.getpid(), getattr(signal, sys.argv[5]))

train(data_dir=sys.argv[1], out=sys.argv[2], epochs=2, global_batch=16, checkpoint_every="3",
      micro_batches=int(sys.argv[6]) if len(sys.argv) > 6 else None, callbacks=[SignalAt()],
      verbose=False)
"""


def environment(changes=None) -> dict:
    """This process's environment with `changes` applied (a value of None removes the variable)."""
    merged = dict(os.environ)
    for key, value in (changes or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def cli_env(home, engine=None) -> dict:
    """Changes for a meshfit subprocess: no downloads, no real ~/.keras, cache or $MESHFIT_DATA
    (all under `home`); with engine="tensorflow", one CPU device and meshfit's own choice of
    engine, which is tensorflow on a single CPU. Apply with environment() or run_meshfit(env=)."""
    changes = {"MESHFIT_OFFLINE": "1", "HOME": str(home), "MESHFIT_CACHE": os.path.join(home, "cache"),
               "MESHFIT_DATA": None}
    if engine == "tensorflow":
        changes.update({"KERAS_BACKEND": None, "XLA_FLAGS": ""})
    return changes


def run_meshfit(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    """`python -m meshfit args...` with `env` changes applied over this process's environment
    (see environment()); its output captured as text."""
    return subprocess.run([sys.executable, "-m", "meshfit", *args], capture_output=True, text=True,
                          timeout=timeout, env=environment(env))


def connect_eight_devices():
    """meshfit on the tests' 8 simulated JAX CPU devices (fast once JAX has started)."""
    import meshfit

    return meshfit.connect(simulate_devices=8, engine="jax", verbose=False)


def write_idx_dataset(folder, n_train=N_TRAIN, n_test=N_TEST, seed=0):
    """A tiny MNIST-like dataset in its 4 canonical IDX .gz files under `folder`.

    The images' brightness depends on their class, so a trained model does better than chance.
    Returns the arrays written: x_train, y_train, x_test, y_test (uint8, images 28x28).
    """
    from meshfit.data import datasets, file_formats

    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    labels = [rng.integers(0, 10, n, dtype=np.uint8) for n in (n_train, n_test)]
    images = [np.clip(rng.normal(20 * y[:, None, None], 40, (len(y), 28, 28)), 0, 255).astype(np.uint8)
              for y in labels]
    arrays = (images[0], labels[0], images[1], labels[1])
    for name, array in zip(datasets.IDX_FILES, arrays):
        file_formats.write_idx(os.path.join(folder, name), array)
    return arrays


def random_images(n, seed):
    """n random 28x28 grey images and labels of 10 classes."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28, 1)).astype("uint8"), rng.integers(0, 10, n)


def compiled_cnn(strategy, metrics=()):
    """The tutorial Fashion-MNIST CNN, built and compiled in `strategy`'s scope."""
    from meshfit.recipes import fashion_mnist_cnn

    with strategy.scope():
        model = fashion_mnist_cnn.build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=list(metrics))
    return model


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files of `logdir`: tag -> [(step, value)] sorted by step.

    TFRecord framing: 8-byte length, 4-byte CRC, the Event proto, 4-byte CRC.
    """
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return {tag: sorted(points) for tag, points in scalars.items()}


def drop_state_field(checkpoint: str, field: str) -> None:
    """Remove `field` from a checkpoint's state.json and update its manifest entry to match, as a
    hand edit that keeps the checksums right would: only the state's own check can find it."""
    from meshfit.run import rundir

    state = os.path.join(checkpoint, rundir.CHECKPOINT_STATE)
    manifest_path = os.path.join(checkpoint, rundir.CHECKPOINT_MANIFEST)
    with open(state) as f:
        content = json.load(f)
    del content[field]
    with open(state, "w") as f:
        f.write(json.dumps(content))
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["files"][rundir.CHECKPOINT_STATE] = {"bytes": os.path.getsize(state),
                                                  "sha256": rundir.file_sha256(state)}
    with open(manifest_path, "w") as f:
        f.write(json.dumps(manifest))


# The test recipes' data: 160 bright or dark 8x8 grey images (128 to train, 32 to test), from a
# callable in memory; recipe files paste it below their `import numpy as np`.
BRIGHT_OR_DARK_DATASET = '''def dataset(seed):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 160)
    x = np.clip(70 + 110 * labels[:, None, None, None] + rng.normal(0, 30, (160, 8, 8, 1)), 0, 255)
    return (x[:128].astype("uint8"), labels[:128]), (x[128:].astype("uint8"), labels[128:])
'''


# Recipe-file text for tests that write recipe files (the file must `import os`): a callback that
# SIGKILLs the run at the start of the train batch KILL_AT="epoch,batch" names.
KILL_AT_CALLBACKS = '''def callbacks():
    import signal

    import keras

    class KillAt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if f"{self.epoch},{batch}" == os.environ.get("KILL_AT"):
                os.kill(os.getpid(), signal.SIGKILL)

    return [KillAt()]
'''


# ------------------------------------------------------------ multi-process jobs (test_launch,
# test_schedulers): the run's weights against one process's, and each process's shards

def model_weights(path) -> list:
    """The weights of the model.keras file at `path`."""
    import keras

    return keras.saving.load_model(path, compile=False).get_weights()


def assert_same_weights(a, b, atol=1e-6):
    """Two trained models' weights are equal up to float rounding (and not all zero)."""
    assert len(a) == len(b) and any(np.abs(w).sum() > 0 for w in a)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=atol)


def assert_each_process_wrote_shards(checkpoint, processes=2):
    """The checkpoint's arrays (orbax) hold shards written by each of the job's processes."""
    for process in range(processes):
        assert os.listdir(os.path.join(checkpoint, "arrays", f"ocdbt.process_{process}", "d")), process


def run_following_progress(command, log, env=None, stall_seconds=300) -> tuple[int, str]:
    """Run `command` with its output in the file `log`; stop it (SIGKILL of its process group)
    once the output has not grown for `stall_seconds`, which a busy machine never reaches while
    the command makes progress. Returns (exit code, -9 when stopped; the output)."""
    import signal
    import time

    with open(log, "w") as out:
        job = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment(env),
                               start_new_session=True)
    size, moved = -1, time.monotonic()
    while job.poll() is None:
        if os.path.getsize(log) != size:
            size, moved = os.path.getsize(log), time.monotonic()
        elif time.monotonic() - moved > stall_seconds:
            os.killpg(job.pid, signal.SIGKILL)
        time.sleep(0.5)
    with open(log, errors="replace") as f:
        return job.wait(), f.read()
