"""No abort and no hang on simulated CPU devices, also on a busy machine.

XLA:CPU's thread pool is sized so that its collectives cannot deadlock (meshfit.parallel.devices,
THREADS_PER_DEVICE), and a computation that still never finishes ends the process with one line
after MESHFIT_STALL_TIMEOUT seconds, its committed checkpoints intact (meshfit.parallel.stall).
The subprocess tests run with busy processes beside them, two per core: a quiet machine hid the
deadlock before.
"""

import contextlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import BRIGHT_OR_DARK_DATASET, cli_env, environment, run_meshfit

from meshfit.parallel import devices, heartbeat, stall
from meshfit.run import checkpoint_format, rundir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUSY_PER_CORE = 2


@contextlib.contextmanager
def busy_machine():
    """Processes spinning on every core beside the test (two per core), stopped after."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(BUSY_PER_CORE * (os.cpu_count() or 1))]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


# ------------------------------------------------------------------------- the CPU client's settings

def test_simulated_devices_get_a_pool_that_cannot_deadlock_and_the_guards_timeouts(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.setenv("MESHFIT_STALL_TIMEOUT", "30")
    devices._prepare_cpu_client(4)
    assert int(os.environ["PJRT_NPROC"]) == max(devices.THREADS_PER_DEVICE * 4, os.cpu_count())
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_cpu_collective_call_warn_stuck_timeout_seconds=30" in flags
    assert f"--xla_cpu_collective_call_terminate_timeout_seconds={30 + stall.XLA_ABORT_MARGIN_SECONDS}" in flags
    assert not any("ynn_fusion" in flag for flag in flags)  # XLA's default (devices.py says why)


def test_the_users_own_larger_pool_and_xla_flags_win(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_call_terminate_timeout_seconds=7")
    monkeypatch.setenv("PJRT_NPROC", "1000")
    devices._prepare_cpu_client(8)
    assert os.environ["PJRT_NPROC"] == "1000"
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=7" in os.environ["XLA_FLAGS"].split()
    monkeypatch.setenv("PJRT_NPROC", "8")  # too few for 8 devices: raised
    devices._prepare_cpu_client(8)
    assert int(os.environ["PJRT_NPROC"]) >= 24


def test_no_guard_leaves_xlas_own_collective_timeouts(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("MESHFIT_STALL_TIMEOUT", "0")
    devices._prepare_cpu_client(2)
    assert "collective_call" not in os.environ["XLA_FLAGS"]


def test_eager_collectives_on_eight_devices_finish_on_a_busy_machine():
    """The plain-JAX reproduction of the deadlock (thousands of small eager programs with an
    all-reduce), started through meshfit.connect: it finishes. With XLA's own pool (8 threads on
    this 2-core machine) it aborted in every run tried (BENCHMARKS.md, section 2)."""
    with busy_machine():
        out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "xla_cpu_deadlock.py"),
                              "--meshfit", "--devices", "8", "--steps", "2000"],
                             capture_output=True, text=True, timeout=900,
                             env=environment({"XLA_FLAGS": "", "MESHFIT_SIMULATE_DEVICES": None}))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("done: 2000 steps")


@pytest.mark.slow
def test_the_stress_harness_short_version():
    """benchmarks/stress_cpu_devices.py's subclassed model with its own train_step, through plain
    fit and through `meshfit train FILE.py`, with a busy process per core: both finish. (The whole
    harness, 8 families at two busy processes per core: BENCHMARKS.md, section 2; one per core
    here, since the busy processes slow the suite's other worker too.)"""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "stress_cpu_devices.py"),
                          "--rounds", "1", "--families", "train_step", "--no-reference", "--busy", "1",
                          "--stall", "300", "--limit", "900"],
                         capture_output=True, text=True, timeout=1900,
                         env=environment({"XLA_FLAGS": "", "MESHFIT_SIMULATE_DEVICES": None}))
    assert out.returncode == 0, out.stderr[-3000:]
    for route in ("plain", "cli"):
        assert f"| train_step | {route} | 1 | 1 | 0 | 0 | 0 |" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "2 runs, 0 not finished" in out.stdout


# ------------------------------------------------------------------------------------ the stall guard

def test_where_names_a_main_thread_in_python():
    kind, at = heartbeat.where()
    assert kind == "python" and at.startswith("meshfit/parallel/heartbeat.py:")


def test_every_checkpoint_module_counts_as_checkpoint_work():
    """A thread inside any module of checkpoints (the Checkpointer, its files, writing, restoring)
    writes or reads a checkpoint, for the stall guard's line and the goodput ledger."""
    import glob

    files = sorted(glob.glob(os.path.join(ROOT, "meshfit", "run", "**", "checkpoint*.py"), recursive=True))
    assert len(files) >= 4, files
    for path in files:
        scope = {}
        exec(compile("import sys\nframe = sys._getframe()", path, "exec"), scope)  # a frame "in" path
        assert heartbeat._doing(scope["frame"])[0] == "checkpoint", path


# A layer that passes its input through, and from the moment the file $HANG_FILE exists never
# returns: a device computation that never finishes, as a deadlocked collective would.
HANGING_LAYER = '''
class HangWhenTold(keras.layers.Layer):
    def call(self, x, training=None):
        import os
        import time

        import jax

        def wait(value):
            while os.path.exists(os.environ.get("HANG_FILE", "/nonexistent")):
                time.sleep(0.5)
            return value

        if not training:
            return x
        return jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
'''

STALL_RECIPE = '''"""hang: a linear model on bright or dark 8x8 images, hanging when told (a test recipe)."""
import numpy as np
import keras

import meshfit
''' + HANGING_LAYER + '''

''' + BRIGHT_OR_DARK_DATASET + '''

def build_model(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Rescaling(1 / 255),
                             keras.layers.Flatten(), HangWhenTold(),
                             keras.layers.Dense(num_classes, activation="softmax")])


def optimizer(steps_per_epoch, epochs):
    return keras.optimizers.Adam(0.02)


RECIPE = meshfit.Recipe(name="hang", dataset=dataset, build_model=build_model, optimizer=optimizer,
                        epochs=2, global_batch=16, validation_split=0.0)
'''


def stalled_output_is_one_line(out, timeout):
    """The stall guard's exit: code 124, one line naming the wait, no traceback or abort."""
    assert out.returncode == stall.EXIT_CODE, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"meshfit: error: stalled for {timeout} s after ") and \
        "waits in a device computation" in last, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Termination timeout" not in out.stderr
    return last


@pytest.mark.slow
def test_a_stalled_run_ends_with_one_line_and_resumes_to_the_uninterrupted_weights(tmp_path):
    recipe, hang = tmp_path / "hang.py", tmp_path / "hang-now"
    recipe.write_text(STALL_RECIPE)
    env = {**cli_env(tmp_path), "MESHFIT_STALL_TIMEOUT": "5", "HANG_FILE": str(hang)}
    train = ["train", str(recipe), "--simulate-devices", "8", "--engine", "jax", "--seed", "0"]
    reference = str(tmp_path / "reference")
    out = run_meshfit(*train, "--out", reference, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]

    run = str(tmp_path / "run")
    command = [sys.executable, "-m", "meshfit", *train, "--epochs", "1000", "--out", run,
               "--checkpoint-every", "4"]
    with busy_machine():
        job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=environment(env))
        first = os.path.join(run, "checkpoints", "ckpt-00000004")
        while not rundir.checkpoint_complete(first) and job.poll() is None:
            time.sleep(0.1)
        hang.touch()  # from the next step on, the device computation never finishes
        stdout, stderr = job.communicate(timeout=600)
    hang.unlink()
    last = stalled_output_is_one_line(subprocess.CompletedProcess(command, job.returncode, stdout, stderr), 5)
    assert last.endswith(f"its committed checkpoints are intact: continue with meshfit train --resume {run} "
                         "(see docs/troubleshooting.md#a-job-hangs)")

    newest = checkpoint_format.latest(os.path.join(run, "checkpoints"))
    assert newest is not None and checkpoint_format.read_state(newest)["global_step"] >= 4
    out = run_meshfit("train", "--resume", run, "--epochs", "2", env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming" in out.stdout

    from meshfit.serve.export import load_keras_model  # rebuilt by the run's recipe copy

    weights = [load_keras_model(os.path.join(r, "model.keras"), run=r).get_weights()
               for r in (reference, run)]
    for a, b in zip(*weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


PLAIN_FIT = '''
import meshfit
strategy = meshfit.connect(simulate_devices=8)
import keras
import numpy as np
''' + HANGING_LAYER + '''
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), HangWhenTold(), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
x = np.ones((64, 4), "float32")
model.fit(x, np.zeros((64, 2), "float32"), batch_size=16, epochs=1, verbose=0)
open(MARKER_PATH, "w").close()
model.fit(x, np.zeros((64, 2), "float32"), batch_size=16, epochs=1, verbose=0)
print("not reached")
'''


@pytest.mark.slow
def test_plain_fit_that_stalls_ends_with_one_line(tmp_path):
    hang = str(tmp_path / "hang-now")
    with busy_machine():
        out = subprocess.run([sys.executable, "-c", PLAIN_FIT.replace("MARKER_PATH", repr(hang))],
                             capture_output=True, text=True, timeout=600,
                             env=environment({"XLA_FLAGS": "", "MESHFIT_SIMULATE_DEVICES": None,
                                              "MESHFIT_STALL_TIMEOUT": "5", "HANG_FILE": hang}))
    stalled_output_is_one_line(out, 5)
    assert "not reached" not in out.stdout


WAITING_CALLBACK = '''
import subprocess
import sys
import time
import meshfit
strategy = meshfit.connect(simulate_devices=8, engine="jax", verbose=False)
import keras, numpy as np

class Waits(keras.callbacks.Callback):  # an evaluation job or upload it waits for, a pdb prompt
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            time.sleep(4)

    def on_epoch_end(self, epoch, logs=None):
        subprocess.run(["sleep", "4"])

with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.random.rand(32, 3).astype("float32")
model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=[Waits()])
print("fit done")
'''


def test_a_callback_that_waits_longer_than_the_stall_timeout_is_no_stall():
    """A user's callback may wait as long as it likes, as in plain Keras: its own code is no
    device computation (before, the guard ended such a fit after MESHFIT_STALL_TIMEOUT with a
    line saying it waited in one). Each wait here is twice the timeout, on a busy machine."""
    with busy_machine():
        out = subprocess.run([sys.executable, "-c", WAITING_CALLBACK], capture_output=True, text=True,
                             timeout=600, env=environment({"XLA_FLAGS": "", "MESHFIT_SIMULATE_DEVICES": None,
                                                           "MESHFIT_STALL_TIMEOUT": "2"}))
    assert out.returncode == 0 and "fit done" in out.stdout, out.stderr[-3000:]


def test_a_callbacks_own_code_is_callback_work_unless_it_waits_on_the_devices():
    """Frames innermost first: a callback's own code called from Keras' callbacks (the trainer
    further out) is a callback's; one that waits in JAX itself is a device computation."""
    import jax

    scope = {"jax": jax}
    trainer = "/x/keras/src/backend/jax/trainer.py"
    callbacks = "/x/keras/src/callbacks/callback_list.py"
    exec(compile("import sys\ndef user(inner):\n    return inner()\n", "/home/me/train.py", "exec"), scope)
    exec(compile("def keras_calls(f):\n    return f()\n", callbacks, "exec"), scope)
    exec(compile("def trainer(f):\n    return f()\n", trainer, "exec"), scope)
    exec(compile("import sys\ndef device():\n    return sys._getframe()\n", "/x/jax/_src/array.py", "exec"), scope)
    here = lambda: sys._getframe()  # noqa: E731 (the callback's innermost frame)
    frame = scope["trainer"](lambda: scope["keras_calls"](lambda: scope["user"](here)))
    assert heartbeat._doing(frame)[0] == "callback"
    frame = scope["trainer"](lambda: scope["keras_calls"](lambda: scope["user"](scope["device"])))
    assert heartbeat._doing(frame)[0] == "device"
    assert heartbeat._doing(scope["trainer"](here))[0] == "device"  # the step, through C++
