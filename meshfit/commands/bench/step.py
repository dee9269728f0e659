"""`meshfit bench`: train-step time per engine, precision, batch size and steps per dispatch.

For every combination two models of the recipe are timed on random data of its input shape (no
download), each in a fresh process per engine (Keras fixes its backend per process):
  plain    raw Keras: `keras` imported with the engine as backend, `model.compile` + `model.fit`
           (`steps_per_execution` = steps per dispatch; Keras' own `DataParallel` on several JAX
           devices); nothing of meshfit runs in that process but the model building of `meshfit train`;
  meshfit  `meshfit.connect(engine=...)`, `Strategy.fit` with the per-epoch report, on TensorFlow
           its cache-sized micro-batches (`meshfit.fit.tf_microbatch`, shown in the micro-batches column),
           and with more than one step per dispatch the on-device loop of `meshfit.fit.jax_loop`;
  meshfit+tensorboard  (with `--tensorboard`) the meshfit path plus the TensorBoard log of every
           `meshfit train` (scalars every 10 steps); its `vs meshfit` column is the logging's cost.
Each fit runs 1 + repeats epochs of `steps` steps: the first is warm-up (compilation, reported as
its extra time over a timed epoch), the others are timed between device synchronizations and the
median is reported. Columns: ms/step, samples/s, MFU (XLA's FLOPs of the step / peak FLOP/s; n/a
where the peak is unknown, as on CPUs), compile seconds, `vs plain` (samples/s / the plain row of
the same engine, precision, batch and steps per dispatch) and `vs fastest` (samples/s / the fastest
plain Keras row of any engine at that precision and batch: the baseline a user could get without
meshfit). Writes bench.csv, bench.json and bench.png to --out (default runs/bench-<time>/).
On several (simulated) CPU devices both paths finish each dispatch before the next, since XLA:CPU
collectives can deadlock with several programs in flight on fewer cores than devices. The paths
run one after the other, so a change in the machine's load between them moves their ratio:
`--rounds R` runs every engine and path R times, alternating (plain, meshfit, plain, ...), and
reports for each row the median samples/s over the rounds (`rounds_samples_per_s` lists them).

Both paths build the model as `meshfit train` does (meshfit.run.train.build: the recipe's
build_model, prepare and compile) on random data of the recipe's shape, and read the replicas and
peak FLOP/s from meshfit's `Strategy`; only the meshfit path activates it.
"""

from __future__ import annotations

import inspect
import io
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from meshfit import recipes
from meshfit.commands.bench import table, worker
from meshfit.errors import MeshfitError
from meshfit.parallel import devices as devices_lib
from meshfit.parallel import engine as engine_lib
from meshfit.parallel import planning
from meshfit.parallel import sharding as sharding_lib
from meshfit.run import rundir

DEFAULT_REPEATS = 5
DEFAULT_STEPS = 10  # timed steps per repeat (rounded up to a multiple of the steps per dispatch)
BENCH_ENGINES = ("jax", "tensorflow")
PATHS = ("plain", "meshfit")
TENSORBOARD_PATH = "meshfit+tensorboard"
WORKER = "meshfit.commands.bench.step"  # this module, run in a fresh process per engine and path


def bench(recipe: str = recipes.DEFAULT, *, engines: list[str] | None = None,
          precisions: list[str] | None = None, batch_sizes: list[int] | None = None,
          steps_per_dispatch: list[int] | None = None, simulate_devices: int | None = None,
          repeats: int = DEFAULT_REPEATS, steps: int = DEFAULT_STEPS, rounds: int = 1,
          out: str | None = None, tensorboard: bool = False, sharding: str | None = None,
          fsdp_min_bytes: int | str = sharding_lib.DEFAULT_FSDP_MIN_BYTES,
          device_memory: int | str | None = None) -> dict:
    """Run the benchmark (one process per engine, path and round) and write its files; returns
    the results.

    Lists left as None take the defaults described in `meshfit bench --help`. batch_sizes are
    global batches in samples. sharding, fsdp_min_bytes, device_memory (bytes or '16GB'): the
    meshfit path's, as for meshfit.connect (plain Keras stays data-parallel).
    """
    the_recipe = recipes.load(recipe)
    sharding = sharding_lib.check_mode(sharding)
    fsdp_min_bytes = sharding_lib.parse_size(fsdp_min_bytes, "--fsdp-min-size")
    device_memory = sharding_lib.parse_size(device_memory)
    for name in precisions or []:
        planning.precision_name(name)
    for name in engines or []:
        if name not in BENCH_ENGINES:
            raise MeshfitError(f"unknown engine {name!r} in --engines; use any of: {', '.join(BENCH_ENGINES)}")
    if repeats < 1 or steps < 1 or rounds < 1:
        raise MeshfitError(f"--repeats, --steps and --rounds must be at least 1, got {repeats}, "
                           f"{steps} and {rounds}")
    if simulate_devices is not None and simulate_devices < 1:
        raise MeshfitError(f"--simulate-devices must be at least 1, got {simulate_devices}")
    if engines is None:
        engines = [e for e in BENCH_ENGINES if engine_lib.installed(e)]
        if (devices_lib.requested_simulation(simulate_devices) or 1) > 1:
            engines = ["jax"]  # only JAX runs several devices in meshfit
    spec = {"recipe": the_recipe.file or the_recipe.name, "precisions": precisions, "batch_sizes": batch_sizes,
            "steps_per_dispatch": steps_per_dispatch, "simulate": simulate_devices,
            "repeats": repeats, "steps": steps, "sharding": sharding,
            "fsdp_min_bytes": fsdp_min_bytes, "device_memory": device_memory}
    rows, machine, skipped, unable = [], None, [], set()
    for _ in range(rounds):
        for engine in (e for e in engines if e not in unable):
            for path in PATHS + ((TENSORBOARD_PATH,) if tensorboard else ()):
                found, meta, error = worker.run(WORKER, {**spec, "engine": engine, "path": path})
                if error:
                    unable.add(engine)
                    skipped.append(f"{engine}: {error}")
                    print(f"meshfit: note: skipped engine {engine}: {error}", file=sys.stderr,
                          flush=True)
                    break
                rows += found
                machine = machine or meta
    rows = median_over_rounds(rows)
    if not rows:
        raise MeshfitError("nothing was measured; " + "; ".join(skipped))
    add_ratios(rows)
    out = out or rundir.timestamped("bench")
    result = {"recipe": the_recipe.name, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": worker.command_line(),
              "machine": machine, "skipped": skipped, "out": out,
              "baseline": "vs_fastest = samples/s / the fastest plain-Keras row (any engine, any "
                          "steps per dispatch) at the same precision and batch",
              "rows": rows}
    table.write_files(result, out)
    return result


def median_over_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (engine, path, precision, batch, steps per dispatch): the round with the median
    samples/s (the lower middle one for an even count), with every round's samples/s attached."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(_key(row) + (row["path"],), []).append(row)
    merged = []
    for group in groups.values():
        ranked = sorted(group, key=lambda r: r["samples_per_s"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["rounds"] = len(group)
        row["rounds_samples_per_s"] = [r["samples_per_s"] for r in group]
        merged.append(row)
    return merged


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Fill `vs_plain`, `vs_fastest` and `vs_meshfit` in place (see the module docstring)."""
    plain = {_key(r): r["samples_per_s"] for r in rows if r["path"] == "plain"}
    meshfit = {_key(r): r["samples_per_s"] for r in rows if r["path"] == "meshfit"}
    fastest: dict[tuple, float] = {}
    for r in rows:
        if r["path"] == "plain":
            group = (r["precision"], r["batch"])
            fastest[group] = max(fastest.get(group, 0.0), r["samples_per_s"])
    for r in rows:
        base = plain.get(_key(r))
        r["vs_plain"] = r["samples_per_s"] / base if base else None
        best = fastest.get((r["precision"], r["batch"]))
        r["vs_fastest"] = r["samples_per_s"] / best if best else None
        own = meshfit.get(_key(r)) if r["path"] == TENSORBOARD_PATH else None
        r["vs_meshfit"] = r["samples_per_s"] / own if own else None


def _key(row: dict[str, Any]) -> tuple:
    return row["engine"], row["precision"], row["batch"], row["steps_per_dispatch"]


# ------------------------------------------------------------------------ measurement (worker)

@dataclass(frozen=True)
class RandomData:
    """The bench's random images and labels, as meshfit.run.train.build reads a run's data:
    input_shape (height, width, channels), num_classes, and train = (x, y) for a recipe's prepare."""

    input_shape: tuple[int, ...]
    num_classes: int
    train: tuple


def class_count(recipe: recipes.Recipe) -> int:
    """Classes of the random labels: a built-in dataset's; for the "synthetic" dataset the model's
    own head (the default of build_model's second argument, see recipes.resnet50_synthetic); else 10."""
    names = recipes.dataset_class_names(recipe.dataset)
    if names:
        return len(names)
    if recipe.dataset == "synthetic":
        arguments = list(inspect.signature(recipe.build_model).parameters.values())
        if len(arguments) < 2 or arguments[1].default is inspect.Parameter.empty:
            raise MeshfitError(f"recipe {recipe.name}: a synthetic dataset's build_model needs a "
                               "default number of classes (its second argument)")
        return int(arguments[1].default)
    return 10


def default_batch(recipe: recipes.Recipe, strategy) -> int:
    """The recipe's global batch on the strategy's devices, as `meshfit train` would use it."""
    return planning.plan_global_batch(strategy.replicas, strategy.platform, strategy.device_kind,
                                      global_batch=recipe.global_batch,
                                      per_core_batch=recipe.per_core_batch)


def _fresh_session(strategy=None) -> None:
    """A fresh Keras session, with `strategy` active when given. Not run.train.start_session: its
    seeding imports TensorFlow under JAX and its op determinism would change what is timed."""
    import keras

    keras.backend.clear_session()
    if strategy is not None:
        strategy.activate()


def _epoch_timer():
    import keras

    from meshfit.watch.report import wait_for_device

    class EpochTimer(keras.callbacks.Callback):
        """Seconds of each epoch, between device synchronizations."""

        def __init__(self):
            super().__init__()
            self.seconds: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            wait_for_device(self.model)
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            wait_for_device(self.model)
            self.seconds.append(time.perf_counter() - self._start)

    return EpochTimer()


def _wait_each_dispatch(info) -> list:
    """On several CPU devices, a callback finishing each dispatch, as meshfit's train function does.

    XLA:CPU collectives can deadlock with several programs in flight when the machine has fewer
    cores than (simulated) devices, so plain Keras needs the same wait to finish at all.
    """
    if info.platform != "cpu" or info.device_count == 1:
        return []
    import jax
    import keras

    return [keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: jax.block_until_ready(logs))]


def measure(spec: dict) -> None:
    """(In the worker) time one engine and path for every precision, batch and steps per dispatch."""
    engine, path = spec["engine"], spec["path"]
    if path != "plain":
        from meshfit.parallel.distribution import connect

        info = connect(simulate=spec["simulate"], engine=engine, verbose=False).info
    else:
        info = devices_lib.discover(simulate=spec["simulate"])
        engine_lib.choose(engine, info.platform, info.device_count)  # the same rules as meshfit
        os.environ["KERAS_BACKEND"] = engine
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    from meshfit.fit import tf_microbatch
    from meshfit.parallel import memory_plan
    from meshfit.parallel.distribution import Strategy
    from meshfit.run import train
    from meshfit.watch.report import EpochReport, train_step_flops

    recipe = recipes.load(spec["recipe"])
    auto_engine = engine_lib.fastest(info.platform, info.device_count)
    worker.emit_machine({"platform": info.platform, "device_kind": info.device_kind,
                         "devices": info.device_count, "simulated": info.simulated,
                         "cpu": devices_lib.cpu_model(), "auto_engine": auto_engine,
                         "keras": keras.__version__, "python": sys.version.split()[0]})
    shape = recipes.input_shape(recipe)
    classes = class_count(recipe)
    dispatches = spec["steps_per_dispatch"] or ([1] if info.platform == "cpu" else [1, 8])
    repeats = spec["repeats"]
    for name in spec["precisions"] or [recipe.precision]:
        precision = planning.resolve_precision(name, info.platform, info.compute_capability,
                                                recipe.precision)
        # The replicas, batch plan and peak FLOP/s; the plain path reads them, never activates it.
        strategy = (Strategy(info, engine, precision) if path == "plain" else
                    Strategy(info, engine, precision, spec["sharding"], spec["fsdp_min_bytes"],
                             spec["device_memory"]))
        peak = strategy.peak_flops
        batches = [strategy.check_batch(b) for b in spec["batch_sizes"] or []] or \
            [default_batch(recipe, strategy)]
        for batch in batches:
            for k in dispatches:
                steps = -(-spec["steps"] // k) * k
                rng = np.random.default_rng(0)
                x = rng.integers(0, 256, (steps * batch, *shape), dtype=np.uint8)
                y = rng.integers(0, classes, steps * batch).astype(np.int32)
                data = RandomData(shape, classes, (x, y))

                def build():
                    return train.build(recipe, data, steps, repeats + 1, k)

                _fresh_session()
                if path == "plain":
                    keras.config.set_dtype_policy(planning.keras_policy(precision))
                    if engine == "jax" and strategy.replicas > 1:
                        keras.distribution.set_distribution(keras.distribution.DataParallel())
                    chosen = None
                else:
                    chosen, _ = memory_plan.settle(strategy, build, batch, _fresh_session, verbose=False)
                    _fresh_session(chosen)
                model = build()
                timer = _epoch_timer()
                fit = dict(batch_size=batch, epochs=repeats + 1, shuffle=False, verbose=0)
                if chosen is not None:  # Strategy.fit runs k steps per dispatch (meshfit.fit.jax_loop)
                    report = EpochReport(batch_size=batch, strategy=chosen, stream=io.StringIO())
                    with tempfile.TemporaryDirectory(prefix="meshfit-bench-tb-") as logdir:
                        logs = []
                        if path == TENSORBOARD_PATH:
                            from meshfit.watch.tensorboard import TensorBoardLog

                            logs = [TensorBoardLog(logdir, report=report, global_batch=batch)]
                        chosen.fit(model, x, y, callbacks=[timer, report, *logs], **fit)
                    flops = report.flops_per_step
                    slices = tf_microbatch.installed(model)
                else:
                    model.fit(x, y, callbacks=[timer] + _wait_each_dispatch(info), **fit)
                    flops = train_step_flops(model, batch) if peak else None
                    slices = 1
                median = statistics.median(timer.seconds[1:])
                step_seconds = median / steps
                row = {"recipe": recipe.name, "engine": engine, "path": path, "precision": precision,
                       "batch": batch, "steps_per_dispatch": k, "micro_batches": slices,
                       "sharding": chosen.sharding if chosen else "data", "replicas": strategy.replicas,
                       "ms_per_step": 1000 * step_seconds, "samples_per_s": batch / step_seconds,
                       "mfu": flops / step_seconds / peak if (flops and peak) else None,
                       "compile_s": max(timer.seconds[0] - median, 0.0), "flops_per_step": flops or None,
                       "auto_engine": auto_engine, "platform": info.platform,
                       "device_kind": info.device_kind, "repeats": repeats, "steps_per_repeat": steps,
                       "epoch_seconds": timer.seconds}
                worker.emit_row(row)
                print(f"bench: {engine} {path} {precision} batch {batch} x{k}: "
                      f"{row['ms_per_step']:.1f} ms/step, {row['samples_per_s']:,.0f} samples/s "
                      f"(+{row['compile_s']:.1f} s compile)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(worker.main(measure, sys.argv[1:]))
