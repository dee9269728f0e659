"""`meshfit.verify` and `meshfit verify`: proof that N devices train the same model as one.

From the same initial weights, seed and batches, a model trains `steps` steps on one device (the
reference) and under every configuration asked (device count, sharding, micro-batches, steps per
dispatch, a stop and resume through a checkpoint in the middle, other engines, several
processes, several precisions); meshfit.run.verify_report compares each with the
reference, step by step and variable by variable, in multiples of the rounding floor measured in
the same run (the reference trained again from weights moved by one rounding unit).

Every configuration but another engine's and several processes' (meshfit.run.verify_engines:
child processes, which rebuild the model) runs in this process on the first N of the devices JAX
started (simulated CPU devices, as many as the largest count asked, when verify starts JAX
itself): the model function and data need not be importable or picklable, and nothing is
started twice. Code that reads `jax.device_count()` sees every started device; read the replica
count of the run in progress from `keras.distribution.distribution()` instead (None on one
device).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import meshfit
from meshfit.errors import MeshfitError
from meshfit.parallel import cluster, modes, planning
from meshfit.run import options, spec, verify_engines, verify_report

DEFAULT_STEPS = 8  # a few steps show a wrong gradient, statistic or order; rounding stays small
DEFAULT_DEVICES = (1, 8)
DEFAULT_SHARDING = ("data", "fsdp")


@dataclass(frozen=True)
class Configuration:
    """One way of training to compare with the one-device reference."""

    devices: int
    sharding: str = "data"  # a mode's name, "auto"; model_parallel K: "model:K" on the command line
    model_parallel: int = 1
    micro_batches: int = 1
    steps_per_dispatch: int = 1
    resume_at: int | None = None  # stop after this many steps, checkpoint, resume from the files
    engine: str = "jax"  # another: one device, in a child process (meshfit.run.verify_engines)
    processes: int = 1  # several: the devices split over a job of `meshfit launch` (verify_engines)

    @property
    def name(self) -> str:
        if self.engine != "jax":
            return f"1 device, {self.engine} engine"
        words = [f"{self.devices} device{'s' if self.devices > 1 else ''}", self.sharding]
        if self.processes > 1:
            words[0] = f"{self.processes} processes x {self.devices // self.processes} devices"
        if self.model_parallel > 1:
            words[-1] = f"{self.sharding} x model {self.model_parallel}"
        if self.micro_batches > 1:
            words.append(f"{self.micro_batches} micro-batches")
        if self.steps_per_dispatch > 1:
            words.append(f"{self.steps_per_dispatch} steps per dispatch")
        if self.resume_at is not None:
            words.append(f"resumed after step {self.resume_at}")
        return ", ".join(words)


@dataclass(frozen=True)
class RecipeModel:
    """A recipe's model as `meshfit verify` builds it: the recipe's build, prepare, optimizer and
    compile for this data (meshfit.run.keras_side.fitting.build), one step per dispatch."""

    recipe: Any
    dataset: Any
    steps_per_epoch: int
    epochs: int
    rebuild: dict | None = None  # for other processes (engines, a job): TARGET, data_dir, seed...


def parse_counts(text: str | Sequence[int], what: str) -> tuple[int, ...]:
    """'1,2,8' (or a sequence) as positive integers, in order, once each."""
    words = text.split(",") if isinstance(text, str) else list(text)
    try:
        counts = tuple(dict.fromkeys(int(str(w).strip()) for w in words if str(w).strip()))
    except ValueError:
        raise MeshfitError(f"{what} {text!r}: give whole numbers separated by commas, "
                           "e.g. 1,2,8") from None
    if not counts or min(counts) < 1:
        raise MeshfitError(f"{what} {text!r}: give whole numbers of at least 1, e.g. 1,2,8")
    return counts


def parse_shardings(text: str | Sequence[str]) -> tuple[tuple[str, int], ...]:
    """'data,fsdp,auto,model:2' (or a sequence) as (mode or 'auto', model parallelism) pairs."""
    words = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for word in (w.strip().lower() for w in words if w.strip()):
        found = re.fullmatch(r"model:(\d+)", word)
        if found:
            out.append(("data", int(found.group(1))))
        else:
            out.append((modes.check_sharding(word), 1))
    if not out:
        raise MeshfitError("--sharding: give modes separated by commas, e.g. data,fsdp,auto,model:2")
    return tuple(dict.fromkeys(out))


def configurations(devices: Sequence[int], shardings: Sequence[tuple[str, int]], *, steps: int,
                   micro_batches: Sequence[int] = (), steps_per_dispatch: Sequence[int] = (),
                   resume: bool = True, engines: Sequence[str] = ("jax",),
                   processes: Sequence[int] = ()) -> list[Configuration]:
    """Every device count but 1 (the reference) under every sharding, then the micro-batches,
    steps per dispatch, the stop and resume and each count of processes, on the largest device
    count under the first sharding, then every engine but JAX on one device."""
    found: list[Configuration] = []
    for count in devices:
        for sharding, k in shardings:
            if count == 1:
                continue  # one device lays nothing out: it is the reference
            if k > 1 and count % k:
                raise MeshfitError(f"model:{k} does not divide {count} devices; use a divisor "
                                   f"of {count}")
            found.append(Configuration(count, sharding, model_parallel=k))
    most, (sharding, k) = max(devices), shardings[0]
    found += [Configuration(most, sharding, k, micro_batches=m) for m in micro_batches if m > 1]
    for d in steps_per_dispatch:
        if d > 1:
            if steps % d:
                raise MeshfitError(f"--steps-per-dispatch {d} does not divide --steps {steps}")
            found.append(Configuration(most, sharding, k, steps_per_dispatch=d))
    if resume and steps >= 2:
        found.append(Configuration(most, sharding, k, resume_at=steps // 2))
    for count in processes:
        if count > 1:
            if most % count:
                raise MeshfitError(f"--processes {count} does not divide {most} devices; give "
                                   f"--devices with a multiple of {count}")
            found.append(Configuration(most, sharding, k, processes=count))
    found += [Configuration(1, engine=engine) for engine in engines if engine != "jax"]
    return list(dict.fromkeys(found))


def target_recipe(target: str, devices: int, engine: str = "jax"):
    """The recipe TARGET names and, for a run directory, its RunSpec (else None); a recipe file
    runs once `devices` simulated devices have started on `engine` (it may import Keras at its
    top)."""
    if os.path.isdir(target):
        saved, _ = spec.read(target)
        if saved.recipe_file:
            meshfit.run.train.start_engine_for_file(devices, engine, None)
        return meshfit.run.models.recipe_of_run(target, saved), saved
    the_options = options.TrainOptions(simulate_devices=devices, engine=engine)
    return meshfit.run.train.load_recipe(target, the_options), None


def array_source(x, y, global_batch: int) -> Callable[[int], Iterator]:
    """Batches of arrays in order: batch s holds samples s*B .. s*B+B-1 (cycling past the end);
    y None for a model that fits on x alone (a keras-hub task whose preprocessor makes the
    targets from the strings)."""
    import numpy as np  # start-up: this module is read by the command line before the data

    def rows(a, index):
        return {k: v[index] for k, v in a.items()} if isinstance(a, dict) else np.asarray(a)[index]

    n = len(next(iter(x.values())) if isinstance(x, dict) else x)
    if n < 1:
        raise MeshfitError("meshfit.verify: x has no samples")

    def source(start: int) -> Iterator:
        step = start
        while True:
            index = np.arange(step * global_batch, (step + 1) * global_batch) % n
            yield rows(x, index), None if y is None else rows(y, index)  # None: fit(x) alone
            step += 1

    return source


def verify(build_model: Callable[[], Any], x, y=None, *, batch_size: int,
           steps: int = DEFAULT_STEPS, devices: str | Sequence[int] = DEFAULT_DEVICES,
           sharding: str | Sequence[str] = DEFAULT_SHARDING, micro_batches: Sequence[int] = (),
           steps_per_dispatch: Sequence[int] = (), resume: bool = True,
           engines: str | Sequence[str] = ("jax",), processes: Sequence[int] = (), seed: int = 0,
           precision: str | Sequence[str] = "auto", plot: str | None = None, verbose: bool = True):
    """Train `build_model()`'s model `steps` steps on one device and under every configuration
    asked, from the same weights and batches, and compare: a meshfit.run.verify_report.Verdicts
    (`.ok`, `.exit_code`, `.lines()`, `.as_dict()`); `plot`: also write that PNG.

    build_model: a function returning a compiled Keras model (or a RecipeModel), called once
    per run under its devices, as one builds inside `strategy.scope()`. x, y: arrays (or dicts
    of arrays; y None for a model fitted on x alone, as a keras-hub task with its preprocessor
    is on strings) taken in order, `batch_size` samples a step (the global batch, split over the devices); or x a function
    `x(first_step)` yielding (x, y) global batches from that step on (a resume reads from the
    middle), y then None. devices: counts such as (1, 2, 8); sharding: modes, 'auto' and
    'model:K'. micro_batches, steps_per_dispatch: values to try on the largest device count.
    resume: also stop after steps/2 and resume from a checkpoint. engines: also train on one
    device of each engine named besides 'jax' ('tensorflow'), in a process of its own that
    rebuilds the model: build_model then must be a function at the top level of an importable
    module; a model that draws random numbers is reported not comparable. processes: counts
    of processes (e.g. (2,)) the largest device count is split over, each a job of `meshfit
    launch` rebuilding the model as for engines (each calls `x` itself when it is a function
    importable by reference; otherwise the batches are read here and sent). Runs on the devices
    of the last meshfit.connect() (the first N of them per configuration); when nothing has
    started JAX yet, on max(devices) simulated CPU devices. precision: as connect()'s ('auto': the connected
    strategy's, else the hardware's); every run, the reference included, trains in it. Several
    ('float32,bfloat16'): every configuration in the first; each further one trains its own
    reference and floor and is compared on the largest device count under the first sharding.
    """
    counts = parse_counts(devices, "devices")
    shardings = parse_shardings(sharding)
    if steps < 1:
        raise MeshfitError(f"steps must be at least 1, got {steps}")
    for count in counts:
        if batch_size % count:
            raise MeshfitError(f"batch_size {batch_size} does not split over {count} devices; use a "
                               f"multiple of {max(counts)}")
    source = x if callable(x) else array_source(x, y, batch_size)
    if callable(x) and y is not None:
        raise MeshfitError("meshfit.verify: x is a function yielding (x, y) batches; give no y")
    parse_precisions(precision)
    processes = parse_counts(processes, "processes") if processes else ()
    engine_names = verify_engines.parse_engines(engines)
    if any(name != "jax" for name in engine_names) or any(p > 1 for p in processes):
        verify_engines.check_rebuildable(build_model)
    runs = configurations(counts, shardings, steps=steps, micro_batches=micro_batches,
                          steps_per_dispatch=steps_per_dispatch, resume=resume, engines=engine_names,
                          processes=processes)
    return compare_runs(max(counts), precision, build_model, source, runs, steps=steps,
                        global_batch=batch_size, seed=seed, plot=plot, verbose=verbose)


def parse_precisions(text: str | Sequence[str]) -> tuple[str, ...]:
    """'float32,mixed_bfloat16' (or a sequence) as precision names ('auto' allowed), in order,
    once each."""
    words = text.split(",") if isinstance(text, str) else list(text)
    names = tuple(dict.fromkeys(planning.precision_name(w.strip()) for w in words if w.strip()))
    return names or (planning.DEFAULT_PRECISION,)


def compare_runs(devices: int, precision: str | Sequence[str], build, source,
                 runs: list[Configuration], *, steps: int, global_batch: int, seed: int,
                 plot: str | None, verbose: bool):
    """Train the reference, the floor run and every configuration on the devices of the last
    meshfit.connect() (when JAX has not started: `devices` simulated CPU devices, connected now)
    in the first precision; in each further one, its own reference and floor and the first
    configuration on the most devices (verdicts.more). The verdicts (printed when verbose, the
    first precision's drawn into `plot`)."""
    precisions = parse_precisions(precision)
    if not cluster.jax_started():
        meshfit.connect(simulate_devices=devices, engine="jax", precision=precisions[0], verbose=False)
    from meshfit.run.keras_side import verify_training as training  # the engine line: connected

    say = print if verbose else (lambda *a, **k: None)
    bases = []
    for name in precisions:  # each once ('auto' may be another one asked), in the order asked
        base = training.base_strategy(name)
        if base.precision not in [b.precision for b in bases]:
            bases.append(base)
    widest = [Configuration(r.devices, r.sharding, r.model_parallel) for r in runs
              if r.devices == devices and r.engine == "jax"][:1]
    say(f"verify: {len(runs)} configuration(s) against 1 device, {steps} steps of {global_batch} "
        f"samples, {bases[0].precision}" + "".join(f"; {len(widest)} in {b.precision}"
                                                   for b in bases[1:]), flush=True)
    verdicts, reference, traces = _judged(training, bases[0], build, source, runs, steps=steps,
                                          global_batch=global_batch, seed=seed, say=say)
    for base in bases[1:]:
        verdicts.more.append(_judged(training, base, build, source, widest, steps=steps,
                                     global_batch=global_batch, seed=seed, say=say)[0])
    bases[0].activate()
    if plot:
        verify_report.plot(verdicts, reference, traces, plot)
    if verbose:
        print("\n".join(verdicts.lines()), flush=True)
        if plot:
            print(f"wrote {plot}", flush=True)
    return verdicts


def _judged(training, base, build_spec, source, runs: list[Configuration], *, steps: int,
            global_batch: int, seed: int, say):
    """The reference, floor run and `runs` in `base`'s precision, judged: (verdicts, the
    reference's trace, each run's trace)."""
    build = training.builder(build_spec)
    reference_strategy = training.strategy_on(base, 1, "data")
    first = next(iter(source(0)))
    start = training.initial_weights(reference_strategy, build, seed, first)
    common = dict(steps=steps, global_batch=global_batch, seed=seed)
    roundoff = training.UNIT_ROUNDOFF.get(_compute_dtype(base.precision), 2.0 ** -24)
    reference = training.train(reference_strategy, build, source, start=start, **common)
    floor = training.train(reference_strategy, build, source,
                           start=training.perturbed(start, roundoff, seed), **common)
    verify_report.check_finite(reference, floor, "1 device")
    traces, refusals = {}, {}
    for run in runs:
        if run.engine != "jax" or run.processes > 1:
            found = _other_process(run, build_spec, reference, start, source, base.precision,
                                   **common)
            if "refused" in found:
                refusals[run.name] = found["refused"]
                say(f"  {run.name}: {found['refused']}", flush=True)
            else:
                traces[run.name] = training.Trace(**found)
                where = "a job of meshfit launch" if run.processes > 1 else "a process of its own"
                say(f"  trained: {run.name} ({found['seconds']:.1f} s, in {where})", flush=True)
            continue
        strategy = training.strategy_on(base, run.devices, run.sharding, run.model_parallel)
        try:
            traces[run.name] = training.train(
                strategy, build, source, start=start, micro_batches=run.micro_batches,
                steps_per_dispatch=run.steps_per_dispatch, resume_at=run.resume_at, **common)
        except MeshfitError as refused:  # meshfit's own check of a setting (e.g. micro-batches of BN)
            refusals[run.name] = str(refused)
            say(f"  not run: {run.name}: {refused}", flush=True)
            continue
        say(f"  trained: {run.name}, {base.precision} ({traces[run.name].seconds:.1f} s)", flush=True)
    verdicts = verify_report.judge(reference, floor, traces, roundoff=roundoff,
                                   precision=base.precision, global_batch=global_batch,
                                   refusals=refusals)
    return verdicts, reference, traces


def _other_process(run: Configuration, build, reference, start, source, precision: str, *,
                   steps: int, global_batch: int, seed: int) -> dict:
    """The trace of a run in other processes (another engine's, or a job of several processes:
    meshfit.run.verify_engines), or {"refused": why}."""
    why = verify_engines.not_comparable(run.engine, reference.paths) if run.engine != "jax" else None
    if why is not None:
        return {"refused": why}
    if isinstance(build, RecipeModel):
        build = build.rebuild
    return verify_engines.train_in_child(
        run.engine, build, start, source, steps=steps, global_batch=global_batch, seed=seed,
        precision=precision, processes=run.processes, devices=run.devices, sharding=run.sharding,
        model_parallel=run.model_parallel)


def _compute_dtype(precision: str) -> str:
    return {"bfloat16": "bfloat16", "float16": "float16"}.get(precision, "float32")
