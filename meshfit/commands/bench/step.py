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
median is reported. Columns: ms/step, samples/s, MFU (XLA's FLOPs of the step / peak FLOP/s: the
data sheet's on TPUs and GPUs, a measured one on CPUs, see meshfit.watch.peak), compile seconds, `vs plain` (samples/s / the plain row of
the same engine, precision, batch and steps per dispatch) and `vs fastest` (samples/s / the fastest
plain Keras row of any engine at that precision and batch: the baseline a user could get without
meshfit). Writes bench.csv, bench.json and bench.png to --out (default runs/bench-<time>/).
On several (simulated) CPU devices both paths finish each dispatch before the next, since XLA:CPU
collectives can deadlock with several programs in flight on fewer cores than devices. The paths
run one after the other, so a change in the machine's load between them moves their ratio:
`--rounds R` runs every engine and path R times, alternating (plain, meshfit, plain, ...), and
reports for each row the median samples/s over the rounds (`rounds_samples_per_s` lists them).

Both paths build the model as `meshfit train` does (meshfit.run.keras_side.fitting.build: the
recipe's build_model, prepare and compile) on random data of the recipe's shape, and read the
replicas and peak FLOP/s from meshfit's `Strategy`; only the meshfit path activates it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import meshfit
from meshfit import recipes
from meshfit.commands.bench import table, worker
from meshfit.errors import MeshfitError
from meshfit.parallel import devices as devices_lib
from meshfit.parallel import engine as engine_lib
from meshfit.parallel import modes, planning
from meshfit.parallel import sharding as sharding_lib
from meshfit.run import rundir

DEFAULT_REPEATS = 5
DEFAULT_STEPS = 10  # timed steps per repeat (rounded up to a multiple of the steps per dispatch)
BENCH_ENGINES = ("jax", "tensorflow")
PATHS = ("plain", "meshfit")
TENSORBOARD_PATH = "meshfit+tensorboard"
WORKER = "meshfit.commands.bench.step"  # this module, run in a fresh process per engine and path


def bench(recipe: str = recipes.DEFAULT, *, engines: list[str] | None = None,
          precisions: list[str] | None = None, global_batches: list[int] | None = None,
          steps_per_dispatch: list[int] | None = None, simulate_devices: int | None = None,
          repeats: int = DEFAULT_REPEATS, steps: int = DEFAULT_STEPS, rounds: int = 1,
          out: str | None = None, tensorboard: bool = False, sharding: str | None = None,
          fsdp_min_bytes: int | str | None = None, device_memory: int | str | None = None,
          profile: tuple[int, int] | None = None) -> dict:
    """Run the benchmark (one process per engine, path and round) and write its files; returns
    the results.

    Lists left as None take the defaults described in `meshfit bench --help`. global_batches are
    in samples over all replicas. sharding, fsdp_min_bytes, device_memory (bytes or '16GB'): the
    meshfit path's, as for meshfit.connect (plain Keras stays data-parallel). profile: (START,
    STOP) train steps of each meshfit row to trace into OUT/profile/<row>/.
    """
    the_recipe = recipes.load(recipe)
    check_counts(engines, precisions, repeats, steps, rounds, simulate_devices)
    spec = {"recipe": the_recipe.file or the_recipe.name, "precisions": precisions,
            "global_batches": global_batches, "steps_per_dispatch": steps_per_dispatch,
            "simulate_devices": simulate_devices, "repeats": repeats, "steps": steps,
            "sharding": modes.check_sharding(sharding),
            "fsdp_min_bytes": sharding_lib.parse_fsdp_min_bytes(fsdp_min_bytes),
            "device_memory": sharding_lib.parse_size(device_memory)}
    out = out or rundir.timestamped("bench")
    if profile:
        spec.update(profile=list(profile), profile_dir=os.path.abspath(os.path.join(out, "profile")))
    engines = engines or default_engines(simulate_devices)
    paths = PATHS + ((TENSORBOARD_PATH,) if tensorboard else ())
    rows, machine, skipped = measure_rounds(spec, engines, paths, rounds)
    rows = median_over_rounds(rows)
    if not rows:
        raise MeshfitError("nothing was measured; " + "; ".join(skipped))
    add_ratios(rows)
    result = {"recipe": the_recipe.name, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": worker.command_line(),
              "machine": machine, "skipped": skipped, "out": out,
              "baseline": "vs_fastest = samples/s / the fastest plain-Keras row (any engine, any "
                          "steps per dispatch) at the same precision and batch",
              "rows": rows}
    table.write_files(result, out)
    return result


def check_counts(engines: list[str] | None, precisions: list[str] | None, repeats: int, steps: int,
                 rounds: int, simulate_devices: int | None) -> None:
    """A one-line MeshfitError for an unknown engine or precision or a count below 1."""
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


def default_engines(simulate_devices: int | None) -> list[str]:
    """Every installed engine that runs on these devices: only JAX on several devices."""
    if (devices_lib.requested_simulation(simulate_devices) or 1) > 1:
        return ["jax"]  # only JAX runs several devices in meshfit
    return [e for e in BENCH_ENGINES if engine_lib.installed(e)]


def measure_rounds(spec: dict, engines: list[str], paths: tuple[str, ...], rounds: int):
    """(rows, machine, skipped): every engine and path measured `rounds` times, alternating, each
    in a fresh worker process. An engine that cannot run here is skipped (with a note) from then on."""
    rows, machine, skipped, unable = [], None, [], set()
    for _ in range(rounds):
        for engine in (e for e in engines if e not in unable):
            for path in paths:
                found, meta, error = worker.run(WORKER, {**spec, "engine": engine, "path": path})
                if error:
                    unable.add(engine)
                    skipped.append(f"{engine}: {error}")
                    print(f"meshfit: note: skipped engine {engine}: {error}", file=sys.stderr,
                          flush=True)
                    break
                rows += found
                machine = machine or meta
    return rows, machine, skipped


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
            group = (r["precision"], r["global_batch"])
            fastest[group] = max(fastest.get(group, 0.0), r["samples_per_s"])
    for r in rows:
        base = plain.get(_key(r))
        r["vs_plain"] = r["samples_per_s"] / base if base else None
        best = fastest.get((r["precision"], r["global_batch"]))
        r["vs_fastest"] = r["samples_per_s"] / best if best else None
        own = meshfit.get(_key(r)) if r["path"] == TENSORBOARD_PATH else None
        r["vs_meshfit"] = r["samples_per_s"] / own if own else None


def _key(row: dict[str, Any]) -> tuple:
    return row["engine"], row["precision"], row["global_batch"], row["steps_per_dispatch"]


# ------------------------------------------------------------------------ measurement (worker)

def measure(spec: dict) -> None:
    """(In the worker) time one engine and path for every precision, batch and steps per dispatch.

    The engine is chosen first: the meshfit path connects, the plain path only finds the devices
    and sets KERAS_BACKEND (by meshfit's rules); then the timing module brings Keras in.
    """
    engine = spec["engine"]
    if spec["path"] != "plain":
        info = meshfit.connect(simulate_devices=spec["simulate_devices"], engine=engine,
                               verbose=False).info
    else:
        info = devices_lib.discover(simulate_devices=spec["simulate_devices"])
        engine_lib.choose_engine(engine, info.platform, info.device_count)  # the same rules as meshfit
        os.environ["KERAS_BACKEND"] = engine
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # the engine line: Keras on the engine just chosen
    from meshfit.commands.bench.keras_side import timing

    timing.measure(spec, info)


if __name__ == "__main__":
    sys.exit(worker.main(measure, sys.argv[1:]))
