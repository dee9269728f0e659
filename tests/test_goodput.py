"""Goodput and MFU (meshfit.watch.goodput, meshfit.watch.peak, the fit hooks' accounting): where
a run's wall time goes, for plain model.fit after connect() and for meshfit train, killed and
resumed."""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import SIGNAL_AT, environment, run_meshfit

from meshfit.watch import goodput


def test_the_parts_add_up_to_the_wall_time_and_moves_keep_the_total():
    ledger = goodput.Ledger(start=time.time())
    time.sleep(0.02)
    ledger.switch("train")
    with ledger.part("eval"):
        time.sleep(0.01)
        ledger.move(0.004, "compile")  # an evaluation's compilation
    time.sleep(0.01)
    ledger.move(0.003, "input_wait")
    totals = ledger.totals()
    seconds = totals["seconds"]
    assert sum(seconds.values()) == pytest.approx(totals["wall_seconds"], abs=1e-3)
    assert seconds["startup"] >= 0.02 and seconds["eval"] >= 0.006
    assert seconds["compile"] == pytest.approx(0.004) and seconds["input_wait"] == pytest.approx(0.003)
    # fraction is train / wall unrounded; the seconds and wall_seconds shown are rounded to 0.1 ms,
    # so fraction x wall_seconds and seconds["train"] differ by at most 0.1 ms, however long the
    # sleeps took (a ratio of the rounded values was off by 1.0e-3 at a 0.04 s wall)
    assert totals["fraction"] * totals["wall_seconds"] == pytest.approx(seconds["train"], abs=1.1e-4)


def test_a_resume_counts_the_steps_run_again_and_the_gap_as_lost(tmp_path):
    path = str(tmp_path / "goodput.json")
    before = goodput.Ledger(start=time.time())
    before.switch("train")
    before.start -= 50.0  # as if it had trained 50 s for the 100 steps it dispatched: 0.5 s a step
    before.seconds["train"] += 50.0
    before.steps = 100
    before.persist_to = path
    before.write()
    written = json.load(open(path))["written_at"]
    after = goodput.Ledger(start=written + 30.0)  # restarted 30 s after its last write
    lost = after.resume(path, checkpoint_step=90)  # its newest checkpoint: step 90 of the 100
    assert lost["recomputed_steps"] == 10 and lost["recomputed_seconds"] == pytest.approx(5.0)
    assert lost["gap_seconds"] == pytest.approx(30.0)
    totals = after.totals(now=after.start + 10.0)
    assert totals["sessions"] == 2
    assert totals["seconds"]["lost"] == pytest.approx(35.0)
    assert totals["seconds"]["train"] == pytest.approx(45.0, abs=0.1)
    assert sum(totals["seconds"].values()) == pytest.approx(totals["wall_seconds"], abs=1e-3)
    assert totals["wall_seconds"] == pytest.approx(50.0 + 30.0 + 10.0, abs=0.5)
    # A finished run extended later (--epochs) lost nothing in between.
    record = json.load(open(path))
    json.dump({**record, "finished": True}, open(path, "w"))
    extended = goodput.Ledger(start=written + 3600.0)
    assert extended.resume(path, checkpoint_step=100)["gap_seconds"] == 0.0
    assert extended.totals()["seconds"]["lost"] == 0.0
    assert goodput.Ledger().resume(str(tmp_path / "none.json"), 0) is None  # a run from before


def test_a_resume_keeps_the_train_its_checkpoint_holds(tmp_path):
    """Given the training seconds of the checkpoint's history, the earlier sessions' train part
    is exactly that: the steps after it are lost however long they took (the mean step time
    once made train 0.024 s more than the epoch lines of an elastic run); training after the
    ledger's last write (or in generations another process of the job ran) comes from the gap."""
    path = str(tmp_path / "goodput.json")
    before = goodput.Ledger(start=time.time() - 50.0)
    before.seconds.update(train=40.0, other=10.0)
    before.steps, before.persist_to = 100, path
    before._since = time.time()
    before.write()
    written = json.load(open(path))["written_at"]
    after = goodput.Ledger(start=written + 30.0)
    lost = after.resume(path, checkpoint_step=90, checkpoint_train=31.0)  # the last 10 took 9 s
    assert lost["recomputed_seconds"] == pytest.approx(9.0) and lost["recomputed_steps"] == 10
    totals = after.totals(now=after.start)
    assert totals["seconds"]["train"] == pytest.approx(31.0, abs=1e-3)
    assert totals["seconds"]["lost"] == pytest.approx(39.0, abs=1e-3)
    assert sum(totals["seconds"].values()) == pytest.approx(totals["wall_seconds"], abs=1e-3)
    behind = goodput.Ledger(start=written + 30.0)  # the checkpoint holds 12 s more than the file
    lost = behind.resume(path, checkpoint_step=120, checkpoint_train=52.0)
    assert lost["recomputed_seconds"] == 0.0 and lost["gap_seconds"] == pytest.approx(18.0)
    totals = behind.totals(now=behind.start)
    assert totals["seconds"]["train"] == pytest.approx(52.0, abs=1e-3)
    assert totals["seconds"]["lost"] == pytest.approx(18.0, abs=1e-3)
    assert sum(totals["seconds"].values()) == pytest.approx(totals["wall_seconds"], abs=1e-3)


def test_the_slowest_host_and_the_input_bound_advice():
    # As gathered from the hosts: numpy float32 rows, written to metrics.json as JSON.
    rows = np.array([[8.0 if p == "train" else 0.0 for p in goodput.PARTS] + [10.0],
                     [6.0 if p == "train" else 0.0 for p in goodput.PARTS] + [10.0]], "float32")
    job = goodput.slowest([goodput.summary(dict(zip(goodput.PARTS, r[:-1])), r[-1]) for r in rows])
    assert job["host"] == 1 and job["fraction"] == pytest.approx(0.6) and len(job["hosts"]) == 2
    assert json.loads(json.dumps(job))["hosts"][0]["seconds"]["train"] == 8.0
    block = goodput.format_block(job).splitlines()
    assert block[0].endswith("wall time; host 1, the slowest of 2")  # the block says whose it is
    # and shows host 0's train and compile, which the epoch lines and metrics.json's
    # train_seconds and compile_seconds are
    assert block[-2] == ("  per host: 0: 80.0%, train 8.00 s, compile 0.00 s (the epoch lines'); "
                         "1: 60.0%, train 6.00 s, compile 0.00 s (slowest)")
    assert goodput.input_bound_line(0.5, 10.0, "generator") is None  # 5%: not input-bound
    line = goodput.input_bound_line(3.0, 10.0, "generator")
    assert line.startswith("meshfit: input-bound:") and "30%" in line and "PyDataset" in line
    assert "workers" in goodput.input_bound_line(3.0, 10.0, "folder")
    assert "--steps-per-dispatch" in goodput.input_bound_line(3.0, 10.0, "arrays", 1, "gpu")


def test_a_keras_hub_tasks_own_pipeline_gets_advice_its_user_can_follow(strategy):
    """fit(texts) on a keras-hub task reaches Keras' fit as a grain pipeline the task built around
    its preprocessor: the advice is to preprocess once, not to tune grain workers the user does
    not hold; a grain dataset given to a model without a preprocessor keeps grain's."""
    import types

    import grain

    from meshfit.fit import sources

    pipeline = grain.MapDataset.source([1, 2, 3]).to_iter_dataset()
    task, plain = types.SimpleNamespace(preprocessor=object()), types.SimpleNamespace()
    assert sources.kind(pipeline, task) == "preprocessor"
    assert sources.kind(pipeline, plain) == sources.kind(pipeline) == "grain"
    line = goodput.input_bound_line(3.0, 10.0, "preprocessor")
    assert "model.preprocessor(data)" in line and "preprocessor=None" in line


def test_the_cpu_peak_is_probed_once_and_cached(strategy, tmp_path, monkeypatch):
    from meshfit.watch import peak

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peak, "_measured", {})
    monkeypatch.setattr(peak.CoreUse, "others_share", lambda self: 0.0)  # a quiet machine
    first = peak.peak_of(strategy)
    assert first["flops"] > 1e8 and "measured now" in first["source"] and first["precision"] == "float32"
    cached = json.load(open(tmp_path / "meshfit" / "peak.json"))
    assert [(e["flops"], e["quiet"]) for e in cached.values()] == [(first["flops"], True)]
    assert "8 devices|float32|jax" in next(iter(cached))
    monkeypatch.setattr(peak, "_measured", {})
    again = peak.peak_of(strategy)
    assert again["flops"] == first["flops"] and "cached" in again["source"]


def test_probing_again_keeps_the_highest_peak_ever_measured(tmp_path, monkeypatch):
    from meshfit.watch import peak

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peak, "_measured", {})
    monkeypatch.setattr(peak.CoreUse, "others_share", lambda self: 0.0)
    measured = iter([5e10, 3e10, 8e10])  # a busy machine's probe is low
    monkeypatch.setattr(peak, "probe", lambda *args: next(measured))
    assert peak.cpu_peak([0], "float32") == (5e10, "measured now")
    monkeypatch.setattr(peak, "_measured", {})  # a new process
    assert peak.cpu_peak([0], "float32") == (5e10, "cached")  # no probe
    assert peak.cpu_peak([0], "float32", again=True)[0] == 5e10  # 3e10 measured, 5e10 kept
    assert peak.cpu_peak([0], "float32", again=True)[0] == 8e10
    (kept,) = json.load(open(tmp_path / "meshfit" / "peak.json")).values()
    assert kept["flops"] == 8e10 and kept["quiet"]


def test_a_peak_probed_under_load_is_said_so_and_probed_again_until_a_quiet_probe(tmp_path, monkeypatch):
    """A probe sharing its cores is low and would make MFU read high for every later run: it is
    marked, a run REPROBE_SECONDS later probes again, and a quiet probe ends the probing."""
    from meshfit.watch import peak

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probes = iter([(4e10, 0.45), (6e10, 0.5), (9e10, 0.02)])  # (FLOP/s, others' share of the cores)
    share = {}

    def probe(*args):
        flops, share["now"] = next(probes)
        return flops

    clock = [1000.0]
    monkeypatch.setattr(peak, "probe", probe)
    monkeypatch.setattr(peak.CoreUse, "others_share", lambda self: share["now"])
    monkeypatch.setattr(peak.time, "time", lambda: clock[0])
    for expected in (4e10, 6e10, 9e10):
        monkeypatch.setattr(peak, "_measured", {})  # a new process
        flops, how = peak.cpu_peak([0], "float32")
        assert flops == expected and how.startswith("measured now")
        assert ("other work used" in how) == (expected < 9e10), how
        if expected == 4e10:
            assert "45% of the cores" in how
            monkeypatch.setattr(peak, "_measured", {})  # a run soon after: the kept figure, said so
            assert peak.cpu_peak([0], "float32") == (4e10, how.replace("measured now", "cached"))
        clock[0] += peak.REPROBE_SECONDS
    monkeypatch.setattr(peak, "_measured", {})
    clock[0] += 10 * peak.REPROBE_SECONDS
    assert peak.cpu_peak([0], "float32") == (9e10, "cached")  # quiet: never probed again
    # A bare number, as kept before, is not known to be quiet: probed again.
    kept_file = tmp_path / "meshfit" / "peak.json"
    key = next(iter(json.load(open(kept_file))))
    kept_file.write_text(json.dumps({key: 7e10}))
    probes = iter([(5e10, 0.0)])
    monkeypatch.setattr(peak, "_measured", {})
    assert peak.cpu_peak([0], "float32") == (7e10, "measured now")
    assert json.load(open(kept_file))[key]["quiet"]


def test_the_core_use_sees_busy_processes_beside_it():
    """Two busy loops beside this process take a large share of its cores' time (whatever else
    the machine runs: a loaded machine only raises the share)."""
    from meshfit.watch import peak

    if not os.path.exists("/proc/stat"):
        return  # the share is unknown off Linux, and the probe counts as quiet there
    cores = len(os.sched_getaffinity(0))
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.3)
        use = peak.CoreUse()
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:  # this process busy too, as the probe is
            pass
        share = use.others_share()
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert share is not None and share > peak.LOADED_SHARE, share


def _model(strategy):
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(4, activation="softmax")])
        model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_plain_fit_reports_goodput_mfu_and_eval(strategy, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rng = np.random.default_rng(0)
    x, y = rng.random((512, 16), dtype="float32"), rng.integers(0, 4, 512)
    model = _model(strategy)
    history = model.fit(x, y, batch_size=64, epochs=2, validation_data=(x[:128], y[:128]), verbose=2)
    result = history.goodput
    spent, seconds = result["goodput"], result["goodput"]["seconds"]
    assert set(seconds) == set(goodput.PARTS)
    assert sum(seconds.values()) == pytest.approx(spent["wall_seconds"], rel=1e-3)
    assert 0 < spent["fraction"] < 1 and seconds["train"] > 0
    assert seconds["compile"] > 0 and seconds["eval"] > 0 and seconds["startup"] > 0
    assert 0 < result["mfu"] < 1 and "matmul probe" in result["peak"]["source"]
    out = capsys.readouterr().out
    assert "goodput " in out and "  input wait " in out and "MFU " in out
    assert [line for line in out.splitlines() if line.startswith("epoch ") and "MFU n/a" in line] == []


def test_the_epochs_train_seconds_are_the_ledgers_train_whenever_its_clock_is_read(
        strategy, tmp_path, monkeypatch):
    """Every read of the ledger's clock here is 1 ms later than the one before (as a thread
    switch under load makes it): the epochs' windows still hold all of the ledger's train. They
    once read an edge apart from the switch at it, so the time between was train in no window
    (2 ms an epoch here; 0.5 ms in one elastic run in CI)."""
    import meshfit

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rng = np.random.default_rng(0)
    x, y = rng.random((256, 16), dtype="float32"), rng.integers(0, 4, 256)
    model = _model(strategy)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)  # compiled before the timed fit
    reads = iter(range(1, 10**9))

    class LateClock:
        def __getattr__(self, name):
            return getattr(time, name)

        def time(self):
            return time.time() + 1e-3 * next(reads)

    monkeypatch.setattr(goodput, "time", LateClock())
    before = goodput.ledger().charged()["train"]
    report = meshfit.EpochReport(batch_size=64, stream=io.StringIO())
    model.fit(x, y, batch_size=64, epochs=3, verbose=0, callbacks=[report])
    trained = goodput.ledger().charged()["train"] - before
    assert len(report.epochs) == 3
    assert sum(e["train_seconds"] for e in report.epochs) == pytest.approx(trained, abs=1e-9)


def test_a_slow_generator_is_input_wait_and_gets_the_input_bound_line(strategy, tmp_path,
                                                                      monkeypatch, capsys):
    """Each batch comes 1 s late, far longer than any step of this model, loaded or not: the
    sleeps are input wait, not train, and the input-bound line is printed. Only bounds that load
    cannot break: a fetch that sleeps 1 s takes at least 1 s, and its wait goes uncounted only
    while the step before it still runs (this step took milliseconds on a 2-core CPU under load
    12-30; it asserted `waited > trained` before, a ratio of two times that load reversed)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 16), dtype="float32"), rng.integers(0, 4, 64)
    model = _model(strategy)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)  # compiled before the timed fit
    late = 1.0

    def slow():
        while True:
            time.sleep(late)
            yield x, y

    before = goodput.ledger().totals()["seconds"]
    history = model.fit(slow(), steps_per_epoch=4, epochs=1, verbose=2)
    after = history.goodput["goodput"]["seconds"]
    waited = after["input_wait"] - before["input_wait"]
    assert waited >= 4 * late / 2  # each late batch counts but for the step still running then
    out = capsys.readouterr().out
    bound = [line for line in out.splitlines() if line.startswith("meshfit: input-bound:")]
    assert len(bound) == 1 and "PyDataset" in bound[0]
    epoch = [line for line in out.splitlines() if line.startswith("epoch 1/1")]
    assert len(epoch) == 1 and " s input wait)" in epoch[0]  # the epoch line shows it apart


def _slow_on_device_model(strategy, seconds):
    """A model whose every train step sleeps `seconds` on the device (a callback in the step)."""
    import jax
    import keras

    class SlowOnDevice(keras.layers.Layer):
        def call(self, x):
            def sleep(value):
                time.sleep(seconds)
                return value
            return jax.pure_callback(sleep, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), SlowOnDevice(),
                                  keras.layers.Dense(4, activation="softmax")])
        model.compile("adam", "sparse_categorical_crossentropy")
    return model


def test_a_slow_batch_read_while_steps_are_queued_leaves_their_time_to_train(strategy,
                                                                             monkeypatch):
    """Python dispatches several steps ahead of the devices: while it waits for a slow batch the
    devices still run the queued steps. That time is training; input wait is only what remains
    after them (each step here takes 0.2 s on the device; every 4th batch comes 1.2 s late, when
    3 or 4 steps are queued)."""
    from meshfit.fit import hooks

    monkeypatch.setattr(hooks, "_clock", hooks._InputClock())  # no device time of other models
    model = _slow_on_device_model(strategy, 0.2)
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 16), dtype="float32"), rng.integers(0, 4, 64)

    def every_4th_late():
        for i in range(1_000):
            if i % 4 == 3:
                time.sleep(1.2)
            yield x, y

    model.fit(every_4th_late(), steps_per_epoch=4, epochs=1, verbose=0)  # compiled, clock probed
    before = goodput.ledger().totals()["seconds"]
    model.fit(every_4th_late(), steps_per_epoch=8, epochs=1, verbose=0)
    after = goodput.ledger().totals()["seconds"]
    trained, waited = after["train"] - before["train"], after["input_wait"] - before["input_wait"]
    assert trained >= 0.9 * 8 * 0.2  # every step's device time; before: 1.0 s of its 1.6 s lost
    assert waited <= 2 * 1.2 - 3 * 0.2  # 1.0 s idle in truth; before: 2.0 s (1 step's time less)


def test_a_save_charges_the_steps_it_waited_for_to_train_not_to_checkpoint(strategy, tmp_path):
    """Dispatch is asynchronous: a save reads the state of steps the devices may still be
    running. That device time is training (each step here sleeps 0.3 s on the device); only the
    save's own work is checkpoint time."""
    from meshfit.run import checkpoint_format
    from meshfit.run.keras_side import checkpoints, fit_and_score

    model = _slow_on_device_model(strategy, 0.3)
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 16), dtype="float32"), rng.integers(0, 4, 64)
    model.fit(x[:8], y[:8], batch_size=8, verbose=0)  # compiled before the timed fit
    checkpointer = fit_and_score.charged_to_checkpoint(
        checkpoints.Checkpointer(tmp_path / "checkpoints", 8, every_steps=4))
    before = goodput.ledger().totals()["seconds"]
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[checkpointer])
    after = goodput.ledger().totals()["seconds"]
    trained = after["train"] - before["train"]
    assert trained >= 0.9 * 8 * 0.3  # all 8 steps' device time; before: half of it in checkpoint
    assert checkpoint_format.latest(tmp_path / "checkpoints").endswith("ckpt-00000008")


def test_the_stop_vote_of_a_job_is_charged_to_train_not_to_checkpoint(strategy, tmp_path):
    """In a job of several processes the checkpointer votes on stopping at every step; reading
    the previous vote waits for the steps dispatched before it, which is training. Charged to
    checkpoint, that wait made 20 s saves look like 35-44% of a 2-process job's wall time. The
    vote at an epoch's end comes after its training window closed (the steps were waited for
    there, meshfit.watch.keras_side.epoch_clock): it precedes the save, and no epoch line
    counts it, so it is checkpoint time."""
    from meshfit.run.keras_side import checkpoints, fit_and_score

    seen = []

    class Vote:  # stands in for hosts.Vote of a job: records where the ledger charges it
        def cast(self, value):
            seen.append(goodput.ledger().current)
            return 0

        def settle(self):
            seen.append(goodput.ledger().current)
            return 0

    checkpointer = fit_and_score.charged_to_checkpoint(
        checkpoints.Checkpointer(tmp_path / "checkpoints", 8, epoch_end=False))
    checkpointer._vote = Vote()
    ledger = goodput.ledger()
    ledger.switch("train")  # inside an epoch's training window, as EpochClock makes it
    for batch in range(3):
        checkpointer.on_train_batch_begin(batch)
    ledger.switch("other")  # the window closed: the epoch's end
    checkpointer.on_epoch_end(0)  # casts, then settles
    assert seen == ["train"] * 3 + ["checkpoint"] * 2


def test_the_command_line_exits_without_collecting_the_whole_heap_again():
    """After its last atexit handler, a `meshfit` process's teardown skips the cyclic collector's
    passes over the heap of TensorFlow, JAX and Keras (1.3-2.9 s on a loaded 2-core CPU, outside
    every ledger): the heap is frozen once the garbage there is has been collected."""
    program = textwrap.dedent("""
        import atexit, gc, sys
        atexit.register(lambda: print("frozen", gc.get_freeze_count()))  # first in, last out
        from meshfit.cli import main
        sys.argv = ["meshfit", "recipe", "mnist-mlp-bf16"]
        sys.exit(main())
    """)
    out = subprocess.run([sys.executable, "-c", program], env=environment(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    frozen = int(out.stdout.split("frozen ")[-1].split()[0])
    assert frozen > 10_000  # meshfit's modules at least


def test_a_killed_and_resumed_train_run_accumulates_its_goodput(data_dir, tmp_path):
    """meshfit train SIGKILLed mid-epoch, restarted a second later: metrics.json's goodput spans
    both sessions and the stop, its parts add up to its wall time, which the two processes'
    lifetimes bound."""
    run = str(tmp_path / "run")
    changes = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "MESHFIT_OFFLINE": "1"}
    env = environment(changes)
    started = time.time()
    killed = subprocess.run([sys.executable, "-c", SIGNAL_AT, data_dir, run, "1", "5", "SIGKILL"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    saved = json.load(open(os.path.join(run, "goodput.json")))
    assert saved["steps_done"] >= 1 and not saved["finished"]
    time.sleep(1.0)
    resumed = run_meshfit("train", "--resume", run, env=changes)
    ended = time.time()
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    metrics = json.load(open(os.path.join(run, "metrics.json")))
    spent, seconds = metrics["goodput"], metrics["goodput"]["seconds"]
    assert spent["sessions"] == 2 and seconds["lost"] >= 1.0  # the second between the two
    assert sum(seconds.values()) == pytest.approx(spent["wall_seconds"], rel=1e-3)
    assert spent["wall_seconds"] <= ended - started + 0.1
    assert seconds["checkpoint"] > 0 and seconds["eval"] > 0 and seconds["train"] > 0
    assert 0 < metrics["mfu"] < 1 and metrics["peak_flops"] > 0 and "probe" in metrics["peak_source"]
    assert json.load(open(os.path.join(run, "goodput.json")))["finished"]


def test_meshfit_runs_shows_a_goodput_column_and_a_stacked_bar_figure(tmp_path):
    from meshfit.commands import runs

    def write_run(name, train, finished):
        folder = tmp_path / name
        folder.mkdir()
        config = {"recipe": "r", "platform": "cpu", "replicas": 2, "engine": "jax", "epochs": 1}
        (folder / "config.json").write_text(json.dumps(config))
        spent = goodput.summary({**dict.fromkeys(goodput.PARTS, 1.0), "train": train}, train + 8.0)
        if finished:
            (folder / "metrics.json").write_text(json.dumps({**config, "goodput": spent, "mfu": 0.2}))
            (folder / "history.json").write_text("[]")
        else:  # still training: its goodput.json
            (folder / "goodput.json").write_text(json.dumps(spent))

    write_run("done", 12.0, True)
    write_run("going", 2.0, False)
    rows = runs.collect([str(tmp_path)])
    assert [round(r["goodput"], 2) for r in rows] == [0.6, 0.2]
    assert rows[0]["mfu"] == 0.2 and rows[1]["status"] == "unfinished"
    table = runs.format_table(rows)
    assert "goodput" in table.splitlines()[0] and "60.0%" in table and "20.0%" in table
    figure = runs.plot_goodput(rows, str(tmp_path / "goodput.png"))
    bars = figure.axes[0].patches
    assert len(bars) == 2 * len(goodput.PARTS)  # one segment per part per run
    assert (tmp_path / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_scaling_times_each_device_count_with_its_goodput_parts(tmp_path):
    out = tmp_path / "scaling"
    result = subprocess.run(
        [sys.executable, "-m", "meshfit", "bench", "mnist-mlp-bf16", "--scaling", "1,2",
         "--global-batches", "16", "--steps", "2", "--repeats", "1", "--out", str(out)],
        env=environment({"XDG_CACHE_HOME": str(tmp_path / "cache"), "MESHFIT_SIMULATE_DEVICES": None}),
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "vs linear" in result.stdout and "simulated devices sharing" in result.stdout
    saved = json.load(open(out / "scaling.json"))
    rows = saved["rows"]
    assert [(r["devices"], r["replicas"], r["global_batch"]) for r in rows] == [(1, 1, 16), (2, 2, 16)]
    assert rows[0]["efficiency"] == 1.0
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["samples_per_s"] / (2 * rows[0]["samples_per_s"]))
    for r in rows:
        assert r["goodput_seconds"]["train"] > 0 and r["goodput_seconds"]["compile"] > 0
        assert r["mfu"] > 0 and "probe" in r["peak_source"]
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TENSORFLOW_SLOW_GENERATOR = textwrap.dedent("""
    import json, time
    import meshfit
    meshfit.connect(engine="tensorflow", verbose=False)
    import keras
    import numpy as np

    x, y = np.random.rand(64, 16).astype("float32"), np.random.randint(0, 4, 64)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy")

    def slow():
        while True:
            time.sleep(0.05)
            yield x, y

    history = model.fit(slow(), steps_per_epoch=12, epochs=1, verbose=2)
    print(json.dumps(history.goodput["goodput"]))
""")


def test_tensorflow_times_the_wait_for_a_slow_generator_too(tmp_path):
    """On TensorFlow each batch is read in Python (see hooks._tensorflow_timed), so the sleeps
    show as input wait there as well."""
    env = environment({"XDG_CACHE_HOME": str(tmp_path), "XLA_FLAGS": "", "KERAS_BACKEND": None,
                       "MESHFIT_SIMULATE_DEVICES": None})
    out = subprocess.run([sys.executable, "-c", TENSORFLOW_SLOW_GENERATOR], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    spent = json.loads(out.stdout.strip().splitlines()[-1])
    assert spent["seconds"]["input_wait"] >= 0.5 * 12 * 0.05
    assert sum(spent["seconds"].values()) == pytest.approx(spent["wall_seconds"], rel=1e-3)
    assert "meshfit: input-bound:" in out.stdout


def test_a_ledger_that_cannot_be_written_leaves_no_file_behind(tmp_path, monkeypatch):
    """A run directory whose renames fail (its config.json unwritable too): the ledger's write is
    skipped without a trace, so the same --out can be given again (it refuses other files)."""
    ledger = goodput.Ledger(start=time.time())
    ledger.persist_to = str(tmp_path / "goodput.json")

    def refused(*args, **kwargs):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "replace", refused)
    ledger.write()
    assert os.listdir(tmp_path) == []
