"""Multi-host: joining a job, each process feeding its rows, and `meshfit launch`.

The slow tests run real 2-process x 4-device jobs on JAX's distributed runtime (gloo collectives
between CPU processes) on small generated Fashion-MNIST files, and compare them with one process
of 8 simulated devices.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import (assert_same_weights, cli_env, environment, model_weights, run_meshfit,
                     write_idx_dataset)

from meshfit import env
from meshfit.fit import hosts
from meshfit.parallel import cluster
from meshfit.launch import job_command, local, watchdog
from meshfit.run import rundir
from meshfit.errors import MeshfitError

TRAIN = ["fashion-mnist-cnn", "--global-batch", "64", "--seed", "0"]
EPOCHS = 2
# A job's time limit follows its progress, not the clock: launch's watchdog ends a job none of
# whose processes took a step for STALL_SECONDS, in one line naming each process's step and wait,
# however long a busy machine makes the job; SAFETY_SECONDS only ends a test whose watchdog failed.
STALL_SECONDS = 180
SAFETY_SECONDS = 1800


@pytest.fixture(autouse=True)
def stall_limit(monkeypatch):
    """Every job of this file (run_meshfit passes this environment on) under the watchdog."""
    monkeypatch.setenv(env.STALL_TIMEOUT, str(STALL_SECONDS))


def launch_args(*command, processes=2, devices=4):
    return ["launch", "--processes", str(processes), "--devices-per-process", str(devices), "--",
            *command]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Small Fashion-MNIST files: 256 training images (4 steps of 64), 64 test images (instead of
    conftest's smaller data_dir)."""
    root = tmp_path_factory.mktemp("data")
    write_idx_dataset(root / "fashion-mnist", n_train=256, n_test=64)
    return str(root)


def train_single_process(data_dir, run, epochs):
    """`meshfit train` for `epochs` epochs in one process with 8 simulated devices: a reference."""
    out = run_meshfit("train", *TRAIN, "--epochs", str(epochs), "--data-dir", data_dir, "--out", run,
                      "--simulate-devices", "8", timeout=SAFETY_SECONDS)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def single_process_run(data_dir, tmp_path_factory):
    """The reference run of EPOCHS epochs."""
    return train_single_process(data_dir, str(tmp_path_factory.mktemp("single") / "run"), EPOCHS)


# ----------------------------------------------------------------------------- the job's settings

def test_no_job_without_variables(monkeypatch):
    for name in (env.COORDINATOR, env.NUM_PROCESSES, env.PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    assert cluster.describe_job() is None


def test_variables_describe_a_job():
    job = cluster.job_from_variables({"MESHFIT_COORDINATOR": "10.0.0.1:1234", "MESHFIT_NUM_PROCESSES": "4",
                                      "MESHFIT_PROCESS_ID": "3", "MESHFIT_LOCAL_DEVICE_IDS": "0,1"})
    assert job == cluster.Job("MESHFIT_* variables", 4, "10.0.0.1:1234", 3, (0, 1))
    assert cluster.describe_job({"MESHFIT_NUM_PROCESSES": "1"}) is None


@pytest.mark.parametrize("environ, message", [
    ({"MESHFIT_COORDINATOR": "10.0.0.1"}, "is not host:port"),
    ({"MESHFIT_COORDINATOR": "h:1", "MESHFIT_NUM_PROCESSES": "2"}, "MESHFIT_PROCESS_ID is not"),
    ({"MESHFIT_COORDINATOR": "h:1", "MESHFIT_NUM_PROCESSES": "2", "MESHFIT_PROCESS_ID": "2"}, "not below"),
    ({"MESHFIT_NUM_PROCESSES": "2"}, "MESHFIT_COORDINATOR is not set"),
    ({"MESHFIT_COORDINATOR": "h:1", "MESHFIT_NUM_PROCESSES": "two", "MESHFIT_PROCESS_ID": "0"}, "not a whole"),
])
def test_bad_variables_are_one_line_errors(environ, message):
    with pytest.raises(MeshfitError, match=message):
        cluster.job_from_variables(environ)


def test_slurm_job_is_detected_only_with_several_tasks(monkeypatch):
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0"}
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert cluster.detected_cluster() is None  # one task: a plain run, nothing to wait for
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert cluster.detected_cluster() == cluster.Job("SlurmCluster", 2)


def test_each_process_feeds_its_devices_rows():
    devices = [SimpleNamespace(process_index=p) for p in (0, 0, 1, 1)]
    # 2 global batches of 8 rows, 2 rows per device, plus a last batch of 4 (1 row per device).
    np.testing.assert_array_equal(cluster.local_rows(20, 8, devices, 1), [4, 5, 6, 7, 12, 13, 14, 15, 18, 19])
    interleaved = [SimpleNamespace(process_index=p) for p in (0, 1, 0, 1)]
    np.testing.assert_array_equal(cluster.local_rows(8, 8, interleaved, 0), [0, 1, 4, 5])
    (x, y), local_batch = hosts.share([np.arange(16), None], 8, devices, 0)
    assert local_batch == 4 and y is None
    np.testing.assert_array_equal(x, [0, 1, 2, 3, 8, 9, 10, 11])
    with pytest.warns(UserWarning, match="last 3 samples are left out"):
        assert len(cluster.local_rows(11, 8, devices, 0)) == 4


# Each process prints, per source, the job's steps per epoch and how often it trained on each
# sample (a count per sample id kept on the devices, summed over every global batch).
SAMPLES_SEEN = """
import json
import sys
import meshfit
import numpy as np

strategy = meshfit.connect(verbose=False)
import keras

SAMPLES, BATCH, EPOCHS = 64, 16, 2


class Seen(keras.layers.Layer):
    def build(self, shape):
        self.counts = self.add_weight(shape=(SAMPLES,), initializer="zeros", trainable=False)

    def call(self, ids, training=False):
        if training:
            hits = keras.ops.one_hot(keras.ops.cast(ids[:, 0], "int32"), SAMPLES)
            self.counts.assign(self.counts + keras.ops.sum(hits, axis=0))
        return ids


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return SAMPLES // BATCH

    def __getitem__(self, i):
        ids = np.arange(i * BATCH, (i + 1) * BATCH, dtype="float32")[:, None]
        return ids, np.zeros_like(ids)


ids = np.arange(SAMPLES, dtype="float32")[:, None]
for name, data in [("arrays", dict(x=ids, y=np.zeros_like(ids), batch_size=BATCH)),
                   ("pydataset", dict(x=Batches()))]:
    with strategy.scope():
        seen = Seen()
        model = keras.Sequential([keras.Input((1,)), seen, keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    strategy.fit(model, epochs=EPOCHS, report=False, shuffle=False, **data)
    counts = np.asarray(seen.counts.value.addressable_data(0)).astype(int)
    steps = int(np.asarray(model.optimizer.iterations.value.addressable_data(0)))
    print(json.dumps({"source": name, "steps": steps, "counts": counts.tolist(),
                      "tensorflow": "tensorflow" in sys.modules}), flush=True)
"""


def test_each_sample_is_trained_once_per_epoch_over_all_processes(tmp_path):
    """Exactly one per-process sharding applies: meshfit's (each process feeds its rows of every
    global batch). Keras from 3.16 (keras-team/keras#23044, #23046) also shards arrays and
    PyDatasets across processes where the distribution's auto_shard_dataset is on; both at once
    would train each process on a half of its half (and Keras refuses arrays so)."""
    script = tmp_path / "samples_seen.py"
    script.write_text(SAMPLES_SEEN)
    out = run_meshfit(*launch_args(sys.executable, str(script)), timeout=SAFETY_SECONDS)
    assert out.returncode == 0, out.stderr[-3000:]
    found = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if " {" in line]
    assert sorted((f["source"], f["steps"]) for f in found) == [("arrays", 8), ("arrays", 8),
                                                                ("pydataset", 8), ("pydataset", 8)]
    for f in found:  # 2 epochs of 4 global batches of 16: every one of the 64 samples twice
        assert f["counts"] == [2] * 64, f
        # joining seeds Keras on every process (hosts.agree_on_seed): that must not import
        # TensorFlow on the JAX engine (2.3 s of each process's start-up)
        assert f["tensorflow"] is False, f


# A user's own script, unchanged: plain fit (203 samples in batches of 40: a last batch of 3 per
# process), validation (37), evaluate (batches of 16: 11 last) and predict (9 in batches of 4),
# each process passing its own rows (Keras' multi-process input), 3 steps per execution, with
# model_parallel $MODEL_PARALLEL. Run on one process (4 devices) with the argument I, it prints
# what process I of a 2 x 2 job must print.
PLAIN_KERAS = """
import json, os, sys
import meshfit, numpy as np
strategy = meshfit.connect(verbose=False, model_parallel=int(os.environ["MODEL_PARALLEL"]),
                           **({"simulate": 4, "engine": "jax"} if sys.argv[1:] else {}))
import keras, jax
rng = np.random.default_rng(0)
x = rng.random((203, 6)).astype("float32")
y = (x[:, 0] + x[:, 1] > 1).astype("int32")
# data parallel, another seed on each process of the job (process 0's as the one-process
# reference's): fit trains from process 0's weights on every process. (Kernels split over a model
# axis across the processes are drawn in parts, each by the process holding it: one array still.)
replicated = os.environ["MODEL_PARALLEL"] == "1"
keras.utils.set_random_seed(1 + (0 if sys.argv[1:] or not replicated else jax.process_index()))
with strategy.scope():
    features = keras.Input((6,), name="features")
    hidden = keras.layers.Dense(16, activation="relu")(features)
    model = keras.Model(features, keras.layers.Dense(2)(hidden))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=3)
history = model.fit(x, y, batch_size=40, epochs=2, verbose=0, shuffle=False,
                    validation_data=(x[:37], y[:37]))
scores = model.evaluate(x, y, batch_size=16, verbose=0)
i = int(sys.argv[1]) if sys.argv[1:] else jax.process_index()
outputs = model.predict(x[i * 5:i * 5 + 9], batch_size=4, verbose=0)
# meshfit's own fit: every process passes the global arrays (whole batches: several hosts cut
# a last one that does not split; inputs by name), which it cuts to the process's rows
more = strategy.fit(model, {"features": x[:200]}, y[:200], batch_size=40, epochs=1, verbose=0,
                    shuffle=False, report=False)
print(json.dumps({"process": i, "history": history.history, "scores": scores,
                  "outputs": outputs.tolist(), "strategy_fit": more.history["loss"]}), flush=True)
"""


@pytest.mark.parametrize("model_parallel", [1, 4])
def test_plain_keras_fit_evaluate_predict_on_two_processes_as_on_one(tmp_path, model_parallel):
    """Batches whose rows do not split across all the devices (every process's rows together)
    are computed whole on every device, as on one host, where Keras' placement failed (JAX's
    IndivisibleError); predict returns each process the outputs of its own rows, where Keras
    could not fetch outputs that span the hosts. With a model axis across the two processes
    (model_parallel 4), where Keras' placement took each process's rows for the whole batch
    (other losses on each process, silently), every process's rows make the one batch."""
    script = tmp_path / "plain_keras.py"
    script.write_text(PLAIN_KERAS)
    env = {"MODEL_PARALLEL": str(model_parallel)}
    out = run_meshfit(*launch_args(sys.executable, str(script), devices=2), env=env,
                      timeout=SAFETY_SECONDS)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("of the model's weights differed across the 2 processes" in out.stderr) is (model_parallel == 1)
    found = {d["process"]: d for d in (json.loads(line.split(" ", 1)[1])
                                       for line in out.stdout.splitlines() if " {" in line)}
    for i in (0, 1):
        alone = subprocess.run([sys.executable, str(script), str(i)], capture_output=True, text=True,
                               env=environment({**cli_env(tmp_path), **env}), timeout=SAFETY_SECONDS)
        assert alone.returncode == 0, alone.stderr[-3000:]
        expected = json.loads(alone.stdout.strip().splitlines()[-1])
        assert len(found[i]["outputs"]) == 9
        for key in ("history", "scores", "outputs", "strategy_fit"):
            np.testing.assert_allclose(np.asarray(found[i][key] if key != "history" else
                                                  [found[i][key][k] for k in sorted(found[i][key])]),
                                       np.asarray(expected[key] if key != "history" else
                                                  [expected[key][k] for k in sorted(expected[key])]),
                                       rtol=1e-5, atol=1e-6, err_msg=key)


# Process 1 passes a batch fewer (`python FEWER_ROWS 16 16`), batches of another size (16 8), or
# np.array_split's share of 67 rows (0 0: 34 and 33, last batches of 2 and 1).
FEWER_ROWS = """
import sys
import numpy as np, meshfit
strategy = meshfit.connect(verbose=False)
import keras, jax
batch = int(sys.argv[1 + jax.process_index()])
rows = (64 - 16 * jax.process_index() if batch == 16 else 4 * batch if batch else
        len(np.array_split(np.arange(67), 2)[jax.process_index()]))
batch = batch or 16
with strategy.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
model.fit(np.ones((rows, 6)), np.ones((rows, 2)), batch_size=batch, verbose=0)
"""


@pytest.mark.parametrize("batches, sizes", [(("16", "8"), "process 0: 16, process 1: 8"),
                                            (("0", "0"), "process 0: 2, process 1: 1")])
def test_a_process_passing_batches_of_another_size_is_one_line(tmp_path, batches, sizes):
    """Each process took its own rows for its share of a batch of its own size: other losses on
    each process, silently (another batch_size), or a wait (the last batches of np.array_split)."""
    script = tmp_path / "smaller_batches.py"
    script.write_text(FEWER_ROWS)
    out = run_meshfit(*launch_args(sys.executable, str(script), *batches, devices=2), timeout=SAFETY_SECONDS)
    assert out.returncode != 0
    assert f"MeshfitError: the processes pass batches of other sizes ({sizes} rows): each process " \
           "passes its own rows" in out.stderr, out.stderr


def test_a_process_passing_fewer_batches_is_named_not_a_hung_one(tmp_path):
    """Process 1's fit ended a step early and the others waited in the step it never ran, until
    the stall guard blamed it as hung; it now says what it did and the rule, before the guard."""
    script = tmp_path / "fewer_rows.py"
    script.write_text(FEWER_ROWS)
    out = run_meshfit(*launch_args(sys.executable, str(script), "16", "16", devices=2),
                      env={"MESHFIT_STALL_TIMEOUT": "40"}, timeout=SAFETY_SECONDS)
    assert out.returncode != 0
    # whichever comes first: its own line, or the launcher's (no progress for 40 s since step 3)
    assert ("MeshfitError: process 1 finished fit after 3 training step(s) and the others did "
            "not come to it within 36 s: each process passes its own rows to fit" in out.stderr
            or "meshfit: error: process 1 of 2 ran out of batches after starting 3 training steps (the "
               "others started 4), and waits for them: each process passes its own rows" in out.stderr), out.stderr
    assert " hung " not in out.stderr


def test_another_model_on_one_process_is_one_line(tmp_path):
    """A model chosen by process index: their steps' collectives did not match, and gloo ended
    the processes with SIGABRT."""
    script = tmp_path / "other_model.py"
    script.write_text(FEWER_ROWS.replace("keras.layers.Dense(2)]", "keras.layers.Dense(2 + 2 * jax.process_index())]"))
    out = run_meshfit(*launch_args(sys.executable, str(script), "16", "16", devices=2), timeout=SAFETY_SECONDS)
    assert out.returncode != 0 and "SIGABRT" not in out.stderr
    assert "MeshfitError: process(es) 1 fit another model than process 0 (other variables, shapes or " \
           "dtypes; this one has 2 variables)" in out.stderr, out.stderr


def test_unreachable_coordinator_is_a_bounded_one_line_error():
    start = time.monotonic()
    out = run_meshfit("info", env={"MESHFIT_COORDINATOR": "127.0.0.1:9", "MESHFIT_NUM_PROCESSES": "2",
                                   "MESHFIT_PROCESS_ID": "1", "MESHFIT_INIT_TIMEOUT": "2"}, timeout=120)
    assert out.returncode == 2 and time.monotonic() - start < 100
    assert out.stderr.strip().count("\n") == 0
    assert "cannot reach the coordinator 127.0.0.1:9 within 2 s (this is process 1 of 2)" in out.stderr


def test_cpp_stdout_writes_nothing_once_off_and_python_still_prints():
    """Gloo's "[Gloo] Rank i is connected to ..." lines go to C++'s std::cout: join() turns it off
    in every process of a job (srun and mpirun have no launcher to filter them)."""
    code = """
import ctypes, jax
from meshfit.parallel import jax_internals
libstdcxx, libc = ctypes.CDLL("libstdc++.so.6"), ctypes.CDLL(None)
cout = ctypes.addressof(ctypes.c_char.in_dll(libstdcxx, "_ZSt4cout"))
write = libstdcxx._ZStlsISt11char_traitsIcEERSt13basic_ostreamIcT_ES5_PKc  # std::cout << char*
write.argtypes, write.restype = [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
write(cout, b"[Gloo] before\\n"); libc.fflush(None)
jax_internals.cpp_stdout_off()
write(cout, b"[Gloo] after\\n"); libc.fflush(None)
print("python", flush=True)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[Gloo] before", "python"]


# ---------------------------------------------------------------------------------- the launcher

def test_command_line_runs_meshfit_with_this_python():
    assert job_command.command_line(["--", "meshfit", "train"]) == [sys.executable, "-m", "meshfit", "train"]
    assert job_command.command_line(["python", "x.py"]) == ["python", "x.py"]
    with pytest.raises(MeshfitError, match="no command to launch"):
        job_command.command_line(["--"])
    env = local.process_environment(1, 2, 1234, 4, base={"MESHFIT_LOCAL_DEVICE_IDS": "0"})
    assert env["MESHFIT_COORDINATOR"] == "127.0.0.1:1234" and env["MESHFIT_PROCESS_ID"] == "1"
    assert env["MESHFIT_NUM_PROCESSES"] == "2" and env["MESHFIT_SIMULATE_DEVICES"] == "4"
    assert "MESHFIT_LOCAL_DEVICE_IDS" not in env


def test_a_python_that_cannot_import_meshfit_is_refused_before_any_process_starts(tmp_path):
    """`python` on the PATH the system's while meshfit runs from a virtual environment that is not
    activated: every process ended in ModuleNotFoundError; now one line naming this Python. Stand-in
    Pythons answer the import question with their exit code."""
    for name, code in (("python3", 1), ("python3.99", 0)):
        (tmp_path / name).write_text(f"#!/bin/sh\nexit {code}\n")
        (tmp_path / name).chmod(0o755)
    with pytest.raises(MeshfitError) as error:
        job_command.command_line([str(tmp_path / "python3"), "train.py"])
    assert "cannot import meshfit" in str(error.value) and sys.executable in str(error.value)
    assert job_command.command_line([str(tmp_path / "python3.99"), "train.py"])[0] == str(tmp_path / "python3.99")
    assert job_command.command_line([sys.executable, "train.py"]) == [sys.executable, "train.py"]


def test_launch_prefixes_lines_with_the_process_index():
    out = run_meshfit("launch", "--processes", "2", "--", sys.executable, "-c",
                      "import os; print('hello from', os.environ['MESHFIT_PROCESS_ID'], "
                      "os.environ['MESHFIT_NUM_PROCESSES'])", timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(l for l in out.stdout.splitlines()) == ["[0] hello from 0 2", "[1] hello from 1 2"]


FAIL_ONE = ("import os, sys, time; i = int(os.environ['MESHFIT_PROCESS_ID']); print('process', i, flush=True);"
            " time.sleep(0.5) if i == 1 else time.sleep(60); sys.exit(3)")


def test_a_failed_process_stops_the_others_and_is_named():
    start = time.monotonic()
    out = run_meshfit("launch", "--processes", "3", "--show", "first", "--", sys.executable, "-c", FAIL_ONE,
                      timeout=60)
    assert time.monotonic() - start < 40  # not the 60 s the others would sleep
    assert out.returncode == 3
    assert out.stderr.strip().splitlines()[-1] == \
        "meshfit: error: process 1 of 3 failed with exit code 3; stopped the other 2 process(es)"
    assert out.stdout.splitlines() == ["process 0"]  # --show first: process 0 only, unprefixed
    assert "[1] process 1" in out.stderr  # and the failed process's last lines


# Both processes join, line up and leave together with 143 as after an agreed stop; process 1
# comes 3 s late. Without the shutdown barrier process 0 left first and process 1 aborted
# (SIGABRT in JAX's coordination agent), as CI once saw after a SIGTERM.
LEAVE_TOGETHER = """
import os, time
import meshfit
from meshfit.parallel import cluster
meshfit.connect(verbose=False)
cluster.barrier("all here")
if os.environ["MESHFIT_PROCESS_ID"] == "1":
    time.sleep(3)
print("leaving", flush=True)
cluster.exit_failed(143, together=True)
"""


def test_processes_stopped_together_leave_without_aborting_whichever_comes_last():
    out = run_meshfit("launch", "--processes", "2", "--", sys.executable, "-c", LEAVE_TOGETHER,
                      timeout=SAFETY_SECONDS)
    assert out.returncode == 143, out.stderr[-3000:]
    assert "Terminating process" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "meshfit launch: all 2 processes stopped together on SIGTERM"), out.stderr[-3000:]


def test_launch_timeout_stops_everything():
    out = run_meshfit("launch", "--processes", "2", "--timeout", "1", "--", sys.executable, "-c",
                      "import time; time.sleep(60)", timeout=60)
    assert out.returncode == 124
    assert out.stderr.strip().splitlines()[-1] == (
        "meshfit: error: the job ran past --timeout 1 s (process 0 before its first step, process 1 "
        "before its first step); stopped all 2 processes")


# Reports 3 + 3 training steps, then process 0 waits for a batch in meshfit.data and process 1
# sleeps in Python; both stop on SIGTERM as `meshfit train` does after its agreed save (exit 143).
AT_STEP_SIX = """
import os, signal, sys, time
from meshfit.parallel import heartbeat
from meshfit.data import streams
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
heartbeat.advance(3)
heartbeat.advance(3)
print("at step 6", flush=True)
def never():  # a data source that never answers
    time.sleep(600)
    yield
if os.environ["MESHFIT_PROCESS_ID"] == "0":
    next(streams.Source(never, "train").batches())
time.sleep(600)
"""


def test_timeout_names_each_processes_step_and_wait_and_they_stop_to_resume(tmp_path):
    script = tmp_path / "at_step_six.py"
    script.write_text(AT_STEP_SIX)
    out = run_meshfit("launch", "--processes", "2", "--timeout", "15", "--", sys.executable, str(script),
                      timeout=120)
    assert out.returncode == 124, out.stderr[-3000:]
    assert out.stdout.count("at step 6") == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "meshfit: error: the job ran past --timeout 15 s (process 0 at step 6 waiting for input, "
        "process 1 at step 6 in Python); all 2 processes stopped together after saving; continue "
        "with --resume")


def test_gloos_connection_lines_are_not_shown():
    out = run_meshfit("launch", "--processes", "2", "--", sys.executable, "-c",
                      "print('[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected "
                      "peer ranks is : 1'); print('trained')", timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[0] trained", "[1] trained"]


def test_coordinator_bind_address(monkeypatch):
    assert cluster.bind_address("127.0.0.1:1234", {}) == "127.0.0.1:1234"  # a local job stays local
    assert cluster.bind_address("localhost:1234", {}) == "localhost:1234"
    assert cluster.bind_address("10.0.0.1:1234", {}) is None  # JAX's default: every interface
    assert cluster.bind_address("10.0.0.1:1234", {"MESHFIT_COORDINATOR_BIND": "10.0.0.1:1234"}) == "10.0.0.1:1234"
    with pytest.raises(MeshfitError, match="MESHFIT_COORDINATOR_BIND='10.0.0.1' is not host:port"):
        cluster.bind_address("10.0.0.1:1234", {"MESHFIT_COORDINATOR_BIND": "10.0.0.1"})
    assert local.process_environment(0, 2, 1234, 1, base={})["MESHFIT_COORDINATOR_BIND"] == "127.0.0.1:1234"


def test_vote_gives_every_call_the_maximum_of_the_call_before(strategy):
    vote = hosts.Vote()
    assert [vote.cast(v) for v in (15, 0, 2)] == [0, 15, 0]
    assert vote.settle() == 2 and vote.settle() == 0


def test_jax_fatal_messages_name_the_silent_process():
    tail = ["E1123 coordination_service.cc] ... The following tasks are unhealthy (stopped sending heartbeats):",
            "1", "The tasks have crashed.", "*** Check failure stack trace: ***"]
    assert watchdog.diagnosis(tail).startswith(" because process(es) 1 sent no heartbeat for")
    assert "not every process joined" in watchdog.diagnosis(["RPC: /xla.coordination.CoordinationService/RegisterTask"])
    assert watchdog.diagnosis(["Traceback", "ValueError"]) == ""
    assert watchdog.diagnosis(["F1128 client.h:80] Terminating process ... DEADLINE_EXCEEDED: Deadline Exceeded",
                               "RPC: /xla.coordination.CoordinationService/Heartbeat"]).startswith(
        " because process 0, the coordinator, stopped answering heartbeats")


def alive(pid):
    """True while `pid` runs (a zombie or a vanished process is not running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_launch(code, processes=2, sigint_ignored=False):
    """`meshfit launch` of `python -c code` (which prints 'ready'); returns it and its processes'
    pids once every process is ready. sigint_ignored: the launcher starts with SIGINT ignored,
    as a background job of a non-interactive shell does."""
    job = subprocess.Popen([sys.executable, "-m", "meshfit", "launch", "--processes", str(processes),
                            "--", sys.executable, "-c", code], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True,
                           preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
                           if sigint_ignored else None)
    pids = [int(p) for p in re.search(r"pids ([\d ]+)", job.stderr.readline()).group(1).split()]
    ready = [job.stdout.readline() for _ in range(processes)]
    assert all(line.endswith("ready\n") for line in ready), ready
    return job, pids


def wait_until_ended(pids, seconds=60):
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


IGNORES_SIGTERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('ready', flush=True); time.sleep(120)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_processes_die_with_a_killed_launcher():
    job, pids = start_launch(IGNORES_SIGTERM)
    job.kill()
    job.wait()
    left = wait_until_ended(pids)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left


@pytest.mark.parametrize("sigint_ignored", [False, True])
def test_second_ctrl_c_kills_the_processes_instead_of_abandoning_them(sigint_ignored):
    job, pids = start_launch(IGNORES_SIGTERM, sigint_ignored=sigint_ignored)  # would outlive SIGTERM
    job.send_signal(signal.SIGINT)
    time.sleep(0.5)
    job.send_signal(signal.SIGINT)
    try:
        code = job.wait(timeout=60)
    except subprocess.TimeoutExpired:  # say how the launcher stood, and leave nothing running
        with open(f"/proc/{job.pid}/status") as f:
            masks = " ".join(line.strip() for line in f if line.startswith(("SigIgn", "SigBlk", "SigCgt")))
        for p in [job.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        pytest.fail(f"the launcher outlived two Ctrl-Cs by 60 s ({masks})")
    assert code == 130
    left = [p for p in pids if alive(p)]  # the launcher has returned: nothing may run now
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left


# ------------------------------------------------------------- processes that never join or hang

def test_watch_names_the_process_furthest_behind_once_none_progresses(tmp_path):
    watch = watchdog.Watch(str(tmp_path), 3, init_timeout=5, stall_timeout=30)
    for i in range(3):  # in the first dispatch (compiling) for a long time: not armed yet
        (tmp_path / f"progress-{i}").write_text("1 2 1 compiling\n")  # steps, reports, dispatches, doing
    assert watch.poll(0.0) is None and watch.poll(1000.0) is None
    for i, counts in enumerate(["13 40 13 device", "12 38 12 python", "13 41 13 device"]):
        (tmp_path / f"progress-{i}").write_text(counts + "\n")
    assert watch.poll(1001.0) is None and watch.poll(1030.0) is None
    assert watch.poll(1031.5) == (
        "process 1 of 3 hung after starting 12 training steps (the others started 13): no process made "
        "progress for 30 s (MESHFIT_STALL_TIMEOUT; process 0 at step 13 in a device computation, "
        "process 1 at step 12 in Python, process 2 at step 13 in a device computation)")
    (tmp_path / "progress-1").write_text("13 40 13 device\n")  # it moved on: a new 30 s
    assert watch.poll(1040.0) is None
    assert watch.poll(1071.0).startswith("the job hung: no process made progress for 30 s (MESHFIT_STALL_"
                                         "TIMEOUT; process 0 at step 13")
    assert "), and processes 0, 1 stopped at the same point" in watch.poll(1071.0)
    (tmp_path / "progress-0").write_text("13 42 13 device\n")
    assert watch.poll(1072.0) is None
    assert watch.poll(1103.0).startswith("process 1 of 3 hung after starting 13 training steps (the "
                                         "others as many, but got further)")
    # one whose fit ended a step early waits for the others at the call after it: no hung one
    (tmp_path / "progress-1").write_text("12 40 12 meeting\n")
    (tmp_path / "progress-0").write_text("13 43 13 device\n")
    assert watch.poll(1104.0) is None
    assert watch.poll(1135.0).startswith("process 1 of 3 ran out of batches after starting 12 training "
                                         "steps (the others started 13), and waits for them: each process "
                                         "passes its own rows to fit, evaluate and predict")


def test_watch_names_processes_that_never_joined(tmp_path):
    watch = watchdog.Watch(str(tmp_path), 3, init_timeout=5, stall_timeout=0)
    assert watch.poll(0.0) is None and watch.missing() == []  # none has begun joining yet
    (tmp_path / "joining-0").touch()
    assert watch.poll(1.0) is None and watch.missing() == [1, 2]
    assert watch.poll(1.0 + 5 + local.GRACE_SECONDS + 0.5) == (
        "processes 1, 2 of 3 never joined the job (they did not reach meshfit.connect within 5 s; "
        "MESHFIT_INIT_TIMEOUT)")
    for i in (1, 2):
        (tmp_path / f"joining-{i}").touch()
    (tmp_path / "progress-0").write_text("5 6 5 device\n")
    assert watch.poll(100.0) is None and watch.poll(10_000.0) is None  # stall_timeout 0: never


def test_training_reports_progress_before_reading_batches_and_before_each_dispatch(strategy, monkeypatch):
    import keras

    from meshfit.fit import jax_loop
    from meshfit.parallel import heartbeat

    reports = []
    monkeypatch.setattr(heartbeat, "advance", lambda steps=0: reports.append(steps))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    jax_loop.install(model, 2)
    x, y = np.zeros((40, 4), "float32"), np.zeros((40, 2), "float32")
    strategy.fit(model, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 5 steps, 2 per dispatch
    assert reports == [0, 2, 0, 2, 0, 1]  # before reading the batches, then their steps before the dispatch


def test_status_folder_is_given_to_the_processes_and_removed_after():
    out = run_meshfit("launch", "--processes", "2", "--", sys.executable, "-c",
                      "import os; print(os.environ['MESHFIT_LAUNCH_STATUS'])", timeout=60)
    assert out.returncode == 0, out.stderr
    folders = {line.split()[1] for line in out.stdout.splitlines()}
    assert len(folders) == 1 and not os.path.exists(folders.pop())
    bad = run_meshfit("launch", "--processes", "2", "--", sys.executable, "-c", "pass",
                      env={"MESHFIT_STALL_TIMEOUT": "ten"}, timeout=60)
    assert bad.returncode == 2 and "MESHFIT_STALL_TIMEOUT='ten' is not a whole number" in bad.stderr


NEVER_STARTS = ("import os, sys, time\n"
                "if os.environ['MESHFIT_PROCESS_ID'] == '1':\n"
                "    time.sleep(600)  # alive, but never runs meshfit\n"
                "os.execv(sys.executable, [sys.executable, '-m', 'meshfit', 'info'])\n")


def test_a_process_that_never_joins_is_named_and_the_job_ends():
    start = time.monotonic()
    out = run_meshfit("launch", "--processes", "2", "--", sys.executable, "-c", NEVER_STARTS,
                      env={"MESHFIT_INIT_TIMEOUT": "3"}, timeout=120)
    seconds = time.monotonic() - start
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith(
        "meshfit: error: process 1 of 2 never joined the job (it did not reach meshfit.connect within 3 s; "
        "MESHFIT_INIT_TIMEOUT); process 0 gave up waiting"), out.stderr[-3000:]
    assert seconds < 3 + local.GRACE_SECONDS + 45  # the join timeout, the grace, start-up
    pids = [int(p) for p in re.search(r"pids (\d+) (\d+)", out.stderr).groups()]
    assert not [p for p in pids if alive(p)]


# Process 1 hangs alive in Python at step 5 (JAX's heartbeats go on); process 0 then waits in the
# next collective for ever. The progress report comes before each collective, as in meshfit.fit.jax_loop.
HANGS = """
import os, time, meshfit
from meshfit.parallel import heartbeat
meshfit.connect(verbose=False)
from meshfit.fit import hosts
vote = hosts.Vote()
for step in range(1000):
    if os.environ["MESHFIT_PROCESS_ID"] == "1" and step == 5:
        print("hanging", flush=True)
        while True:
            time.sleep(0.1)
    heartbeat.advance(1)
    vote.cast(1)
    vote.settle()
"""
LAUNCH_WITH_SHORT_GRACE = ("import sys; from meshfit.launch.local import launch; "
                           "sys.exit(launch(sys.argv[1:], 2, grace=2))")


def test_a_hung_process_is_named_and_the_job_ends_after_the_stall_timeout(tmp_path):
    stall, grace = 3, 2
    with open(tmp_path / "stderr", "w+") as stderr:
        job = subprocess.Popen([sys.executable, "-c", LAUNCH_WITH_SHORT_GRACE, sys.executable, "-c", HANGS],
                               stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
                               env=dict(os.environ, MESHFIT_STALL_TIMEOUT=str(stall)))
        try:
            for line in job.stdout:
                if line == "[1] hanging\n":
                    break
            hung = time.monotonic()
            code = job.wait(timeout=120)
            seconds = time.monotonic() - hung
        finally:
            if job.poll() is None:
                job.kill()
        stderr.seek(0)
        text = stderr.read()
    assert code == 124, text[-3000:]
    assert text.strip().splitlines()[-1] == (
        "meshfit: error: process 1 of 2 hung after starting 5 training steps (the others started 6): no "
        "process made progress for 3 s (MESHFIT_STALL_TIMEOUT; process 0 at step 6 in a device "
        "computation, process 1 at step 5 in Python); stopped all 2 processes (see "
        "docs/troubleshooting.md#a-job-hangs)")
    # the stall timeout, the progress files' and the launcher's 1 s periods, SIGTERM to SIGKILL
    assert seconds < stall + 2 * local.POLL_SECONDS + grace + 10
    pids = [int(p) for p in re.search(r"pids (\d+) (\d+)", text).groups()]
    assert not [p for p in pids if alive(p)]


LISTENING = """
import os, meshfit
from meshfit.parallel import cluster
meshfit.connect(verbose=False)
def target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the fd of listdir itself, closed by now
        return ""
sockets = {t[8:-1] for t in map(target, os.listdir("/proc/self/fd")) if t.startswith("socket:[")}
found = [line.split()[1] for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6")
         for line in open(table).readlines()[1:] if line.split()[3] == "0A" and line.split()[9] in sockets]
print("listening", *found, flush=True)
cluster.barrier("checked")
"""
LOOPBACK = ("0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_launch_listens_on_the_loopback_only():
    out = run_meshfit("launch", "--processes", "2", "--", sys.executable, "-c", LISTENING, timeout=SAFETY_SECONDS)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {line[:3]: line.split()[2:] for line in out.stdout.splitlines() if " listening" in line}
    assert sorted(lines) == ["[0]", "[1]"] and lines["[0]"]  # process 0 runs the coordinator
    for address in lines["[0]"] + lines["[1]"]:
        assert address.split(":")[0] in LOOPBACK, address


# ------------------------------------------------------------------------------- real 2-host jobs

WEIGHTS_SCRIPT = """
import sys
import keras
import numpy as np
from meshfit.run import train as training

class SaveEveryCopy(keras.callbacks.Callback):
    '''Each process saves every local device's copy of every weight.'''
    def on_train_end(self, logs=None):
        import jax
        copies = {f"{i}-device{s.device.id}": np.asarray(s.data)
                  for i, v in enumerate(self.model.weights) for s in v.value.addressable_shards}
        np.savez(f"{sys.argv[3]}/weights-{jax.process_index()}.npz", **copies)

training.train("fashion-mnist-cnn", epochs=int(sys.argv[4]), global_batch=64, seed=0,
               data_dir=sys.argv[1], out=sys.argv[2], callbacks=[SaveEveryCopy()])
"""


@pytest.mark.slow
def test_two_processes_train_the_same_model_as_one(data_dir, single_process_run, tmp_path):
    script = tmp_path / "train_and_save.py"
    script.write_text(WEIGHTS_SCRIPT)
    run = str(tmp_path / "run")
    out = run_meshfit(*launch_args(sys.executable, str(script), data_dir, run, str(tmp_path), str(EPOCHS)),
                      timeout=SAFETY_SECONDS)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert re.search(r"^\[0\] +hosts +2 \(this is process 0\)$", out.stdout, re.M)  # the discovery report
    assert re.search(r"^\[0\] +devices per host +4$", out.stdout, re.M)
    assert re.search(r"^\[0\] +replicas +8$", out.stdout, re.M)
    assert sum(l.startswith("[0] epoch ") for l in lines) == EPOCHS
    assert not any(l.startswith("[1] epoch ") for l in lines)  # only process 0 reports
    assert_same_weights(model_weights(os.path.join(run, "model.keras")),
                        model_weights(os.path.join(single_process_run, "model.keras")))
    spent = json.loads(open(os.path.join(run, "metrics.json")).read())["goodput"]  # per host
    assert len(spent["hosts"]) == 2 and spent["host"] in (0, 1)
    assert spent["fraction"] == min(h["fraction"] for h in spent["hosts"])
    assert "[0] goodput " in out.stdout and "per host: 0: " in out.stdout
    saved = [np.load(tmp_path / f"weights-{p}.npz") for p in (0, 1)]
    for i in range(len(model_weights(os.path.join(run, "model.keras")))):
        copies = [f[k] for f in saved for k in f.files if k.startswith(f"{i}-")]
        assert len(copies) == 8  # 4 devices on each of the 2 processes
        for copy in copies[1:]:  # one model: every device on every host holds the same weights
            np.testing.assert_array_equal(copy, copies[0])


def launch_until_first_checkpoint(data_dir, run):
    """A 2-process, 50-epoch training job, running once its epoch-1 checkpoint is committed:
    (job, its stdout and stderr lines as read so far, the reader thread, the processes' pids)."""
    first_checkpoint = os.path.join(run, "checkpoints", "ckpt-00000004")  # after epoch 1 (4 steps)
    command = [sys.executable, "-m", "meshfit", *launch_args(
        "meshfit", "train", *TRAIN, "--epochs", "50", "--data-dir", data_dir, "--out", run,
        "--checkpoint-every", "epoch")]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(job.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + SAFETY_SECONDS
    while not rundir.checkpoint_complete(first_checkpoint) and job.poll() is None and \
            time.monotonic() < deadline:  # committed: written by both processes, manifest last
        time.sleep(0.1)
    if job.poll() is not None:
        reader.join(timeout=10)
        raise AssertionError("".join(output)[-3000:])
    pids = re.search(r"pids (\d+) (\d+)", "".join(output)).groups()
    return job, output, reader, [int(p) for p in pids]


@pytest.mark.slow
def test_killed_process_ends_the_launch_and_the_run_resumes(data_dir, single_process_run, tmp_path):
    run = str(tmp_path / "run")
    job, output, reader, pids = launch_until_first_checkpoint(data_dir, run)
    try:
        os.kill(pids[1], signal.SIGKILL)  # process 1 dies mid-run
        killed = time.monotonic()
        job.wait(timeout=120)
        stopped_after = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
    reader.join(timeout=10)
    assert stopped_after < local.GRACE_SECONDS + 30
    assert job.returncode != 0
    assert "meshfit: error: process 1 of 2 failed with SIGKILL (exit code -9)" in "".join(output)

    from meshfit.run import checkpoint_format

    newest = checkpoint_format.latest(os.path.join(run, "checkpoints"))
    assert newest is not None and checkpoint_format.read_state(newest)["epoch"] in (1, 2)
    assert checkpoint_format.read_arrays(newest)  # the last checkpoint is complete and readable

    # resumed by one process of 8 devices: each array read from the 2 processes' shards
    out = run_meshfit("train", "--resume", run, "--epochs", str(EPOCHS), "--simulate-devices", "8",
                      timeout=SAFETY_SECONDS)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming" in out.stdout
    assert_same_weights(model_weights(os.path.join(run, "model.keras")),
                        model_weights(os.path.join(single_process_run, "model.keras")))


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_step_and_the_run_resumes(data_dir, single_process_run,
                                                                          tmp_path):
    run = str(tmp_path / "run")
    job, output, reader, pids = launch_until_first_checkpoint(data_dir, run)
    try:
        os.kill(pids[1], signal.SIGTERM)  # a preemption notice reaching one host only
        assert job.wait(timeout=120) == 143
    finally:
        if job.poll() is None:
            job.kill()
    reader.join(timeout=10)
    text = "".join(output)
    steps = re.findall(r"^\[(\d)\] meshfit: training stopped by SIGTERM after step (\d+)", text, re.M)
    assert sorted(p for p, _ in steps) == ["0", "1"] and steps[0][1] == steps[1][1], text[-3000:]
    assert "all 2 processes stopped together on SIGTERM" in text

    from meshfit.run import checkpoint_format

    newest = checkpoint_format.latest(os.path.join(run, "checkpoints"))
    assert checkpoint_format.read_state(newest)["global_step"] == int(steps[0][1])  # process 0 saved that step
    # resumed with its kernels sharded over the 8 devices of the 2 processes (fsdp), to the end of
    # the epoch after the stop (epoch 2 unless the stop came late), so the resume always trains
    epochs = int(steps[0][1]) // 4 + 1  # 4 steps an epoch
    reference = single_process_run if epochs == EPOCHS else \
        train_single_process(data_dir, str(tmp_path / "reference"), epochs)
    out = run_meshfit(*launch_args("meshfit", "train", "--resume", run, "--epochs", str(epochs),
                                   "--sharding", "fsdp", "--fsdp-min-bytes", "10KB"),
                      timeout=SAFETY_SECONDS)
    assert out.returncode == 0, out.stderr[-3000:]
    final = checkpoint_format.latest(os.path.join(run, "checkpoints"))
    assert final != newest and checkpoint_format.read_state(final)["config"]["sharding"] == "fsdp"
    with open(os.path.join(run, "config.json")) as f:  # a later --resume keeps fsdp
        config = json.load(f)
    assert config["sharding"] == "fsdp" and config["resumed"][-1]["sharding"] == "fsdp"
    for process in (0, 1):  # each process wrote its own shards
        assert os.listdir(os.path.join(final, "arrays", f"ocdbt.process_{process}", "d"))
    # fsdp's reduce-scatter after the stop adds the gradients in another order than the reference's
    # all-reduce (see test_a_run_of_one_process_resumes_on_two; CI measured 8.2e-6 on one weight)
    assert_same_weights(model_weights(os.path.join(run, "model.keras")),
                        model_weights(os.path.join(reference, "model.keras")), atol=1e-5)


@pytest.mark.slow
def test_model_parallel_across_two_processes_trains_as_one_process(data_dir, single_process_run, tmp_path):
    """--model-parallel 8 on 2 processes x 4 devices: every kernel split over a model axis that
    spans both processes (its collectives through gloo), each process feeding the one batch row;
    the run ends as the one-process data-parallel run (atol 1e-5: the reductions differ in order,
    see test_a_run_of_one_process_resumes_on_two)."""
    run = str(tmp_path / "run")
    out = run_meshfit(*launch_args("meshfit", "train", *TRAIN, "--epochs", str(EPOCHS), "--data-dir",
                                   data_dir, "--out", run, "--model-parallel", "8"), timeout=SAFETY_SECONDS)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(os.path.join(run, "config.json")) as f:
        config = json.load(f)
    assert config["model_parallel"] == 8 and config["replicas"] == 1
    assert_same_weights(model_weights(os.path.join(run, "model.keras")),
                        model_weights(os.path.join(single_process_run, "model.keras")), atol=1e-5)


@pytest.mark.slow
def test_a_run_of_one_process_resumes_on_two(data_dir, single_process_run, tmp_path):
    """Epoch 1 on 1 process x 8 devices (fsdp), resumed by 2 processes x 4 devices: each process
    reads its shards of arrays that one process wrote, and the run ends as the one-process run."""
    run = str(tmp_path / "run")
    out = run_meshfit("train", *TRAIN, "--epochs", "1", "--data-dir", data_dir, "--out", run,
                      "--simulate-devices", "8", "--sharding", "fsdp", "--fsdp-min-bytes", "10KB",
                      timeout=SAFETY_SECONDS)
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_meshfit(*launch_args("meshfit", "train", "--resume", run, "--epochs", str(EPOCHS)),
                      timeout=SAFETY_SECONDS)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^\[0\] resuming .* from ckpt-00000004", out.stdout, re.M), out.stdout[-3000:]
    # meshfit launch's 4 devices per process, not the saved run's 8: $MESHFIT_SIMULATE_DEVICES
    # counts as given again
    assert re.search(r"^\[0\] +devices per host +4$", out.stdout, re.M), out.stdout[-3000:]
    assert re.search(r"^\[0\] +replicas +8$", out.stdout, re.M), out.stdout[-3000:]

    from meshfit.run import checkpoint_format

    final = checkpoint_format.latest(os.path.join(run, "checkpoints"))
    assert checkpoint_format.read_state(final)["global_step"] == EPOCHS * 4
    for process in (0, 1):  # fsdp kept: each process wrote its own shards
        assert os.listdir(os.path.join(final, "arrays", f"ocdbt.process_{process}", "d"))
    # The reference trained data parallel: its all-reduce adds the replicas' gradients in another
    # order than fsdp's reduce-scatter across two processes, and Adam's division by sqrt(v)
    # magnifies that rounding where a gradient is near zero (measured: one weight of 64 off by
    # 3.3e-6 after 8 steps, the rest within 1e-6; the same program on 1 and 2 processes, in
    # test_two_processes_train_the_same_model_as_one, stays within 1e-6)
    assert_same_weights(model_weights(os.path.join(run, "model.keras")),
                        model_weights(os.path.join(single_process_run, "model.keras")), atol=1e-5)


def test_a_process_stopped_while_the_job_stops_ends_the_wait(tmp_path):
    """A stop at an agreed step waits for every process; one frozen (SIGSTOP) meanwhile ends the
    wait after local.FROZEN_SECONDS rather than the whole patience."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        process = type("P", (), {"index": 0, "popen": sleeper})()
        process.stopped = lambda: open(f"/proc/{sleeper.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T"
        os.kill(sleeper.pid, signal.SIGSTOP)
        began = time.monotonic()
        local._wait_all([process], 100.0)
        assert time.monotonic() - began < 60 and sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()



LOSES_ITSELF = """
import os, signal, sys, time
index = os.environ["MESHFIT_PROCESS_ID"]
signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(sys.argv[1], "asked-" + index), "w").close())
if index == "1":
    time.sleep(0.5)
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))
time.sleep(120)
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("lost_at_once", [False, True])
def test_a_lost_process_has_the_others_killed_at_once_where_nothing_newer_is_saved(tmp_path, how,
                                                                                  lost_at_once):
    """run_job's lost_at_once (an elastic job copying every step locally): a process killed, or
    seen frozen (SIGSTOP), has every process killed at once (SIGKILL); without it the others are
    asked to stop first (SIGTERM: here they note it and wait on, until SIGKILL after the grace),
    a frozen one continued and asked too (to stop at an agreed step and save)."""
    ended = local.run_job([sys.executable, "-c", LOSES_ITSELF, str(tmp_path), how], 2, 1, None,
                          "all", None, 2.0, lost_at_once=lost_at_once)
    if how == "SIGSTOP":
        assert ended.verdict == 124 and ended.behind == [1], ended
        assert "process(es) 1 of 2 stopped (SIGSTOP) for 0.5 s (seen in /proc)" in ended.verdict_text
    else:
        assert ended.failure == (1, -signal.SIGKILL), ended
    assert [p.popen.returncode for p in ended.started] == [-signal.SIGKILL] * 2
    asked = sorted(os.listdir(tmp_path))
    assert asked == ([] if lost_at_once else ["asked-0"] if how == "SIGKILL" else ["asked-0", "asked-1"])


WAITING_CALLBACK = '''
import time
import meshfit
strategy = meshfit.connect()
import jax, keras, numpy as np

class Waits(keras.callbacks.Callback):  # process 0 waits for an evaluation job of its own
    def on_epoch_end(self, epoch, logs=None):
        if jax.process_index() == 0 and epoch == 0:
            time.sleep(8)

with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.random.default_rng(jax.process_index()).random((16, 3), dtype=np.float32)
model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0, callbacks=[Waits()])
print("fit done")
'''


def test_a_process_waiting_in_its_callback_is_no_hung_job(tmp_path, monkeypatch):
    """Process 0's callback waits 8 s, 4 x the stall timeout, while process 1 waits for it in the
    next step's collective: the launcher's watchdog sees process 0 in a callback's own code
    (its progress file) and the job goes on, as plain Keras would (it named it hung before)."""
    monkeypatch.setenv(env.STALL_TIMEOUT, "2")
    script = tmp_path / "waits.py"
    script.write_text(WAITING_CALLBACK)
    out = run_meshfit(*launch_args(sys.executable, str(script), devices=1), timeout=SAFETY_SECONDS)
    assert out.returncode == 0 and out.stdout.count("fit done") == 2, out.stderr[-3000:]


def test_a_peer_in_its_callback_is_seen_from_the_launchers_folder(tmp_path, monkeypatch):
    """What each process's own stall guard reads: another process's progress file saying it runs
    a callback's own code (its own file does not count)."""
    from meshfit.parallel import heartbeat

    monkeypatch.setenv(env.LAUNCH_STATUS, str(tmp_path))
    monkeypatch.setenv(env.PROCESS_ID, "1")
    (tmp_path / "progress-1").write_text("3 3 3 callback\n")
    (tmp_path / "progress-0").write_text("3 3 3 device\n")
    assert not heartbeat.a_peer_runs_a_callback()
    (tmp_path / "progress-0").write_text("3 4 3 callback\n")
    assert heartbeat.a_peer_runs_a_callback()
