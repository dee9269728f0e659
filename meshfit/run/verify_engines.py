"""`meshfit verify --engines jax,tensorflow` and `--processes P`: the one-device reference (JAX)
against the same steps on another engine, trained in a child process of its own (Keras fixes its
backend once per process), or on a job of P processes started by `meshfit launch`, each running
meshfit.run.keras_side.verify_worker.

The child gets everything through files in a temporary folder: job.pkl (how to build the model:
the user's function, pickled by reference, or the recipe's TARGET; steps, batch, seed,
precision; for a job, the user's batch function when importable), arrays.npz (the reference's
initial weights and every global batch). It trains the same steps from the same weights on the
same batches and writes its trace back (process 0 of a job: trace.npz,
trace.json), which meshfit.run.verify_report judges like any configuration's.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Any, Callable, Iterator, Sequence

from meshfit.errors import MeshfitError

ENGINES = ("jax", "tensorflow")
_NAMES = {"jax": "JAX", "tensorflow": "TensorFlow"}
JOB, ARRAYS, TRACE_ARRAYS, TRACE_JSON = "job.pkl", "arrays.npz", "trace.npz", "trace.json"
WORKER = "meshfit.run.keras_side.verify_worker"
TIMEOUT_SECONDS = 3600  # a child that has not finished by then is stopped: never a hang
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def parse_engines(text: str | Sequence[str]) -> tuple[str, ...]:
    """'jax,tensorflow' (or a sequence) as engine names, in order, once each."""
    words = text.split(",") if isinstance(text, str) else list(text)
    names = tuple(dict.fromkeys(w.strip().lower() for w in words if w.strip()))
    for name in names:
        if name not in ENGINES:
            raise MeshfitError(f"unknown engine {name!r} for --engines; use {', '.join(ENGINES)}")
    if not names:
        raise MeshfitError("--engines: give engines separated by commas, e.g. jax,tensorflow")
    return names


def check_rebuildable(build: Callable) -> None:
    """A one-line MeshfitError unless `build` (the model's function, or the batches') can be
    rebuilt in a child process: a function at the top level of an importable module (pickled by
    reference)."""
    module = getattr(build, "__module__", None)
    fix = ("define the function that builds the model at the top level of an importable module "
           "(not a lambda, a nested function or in __main__) and pass that")
    if module in (None, "__main__"):
        raise MeshfitError(f"meshfit.verify: another engine (engines=...) or a job of several "
                           f"processes (processes=...) trains in processes of its own, which must "
                           f"rebuild {getattr(build, '__qualname__', 'the model')}; {fix}")
    try:
        pickle.dumps(build)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise MeshfitError(f"meshfit.verify: {getattr(build, '__qualname__', build)} cannot be "
                           f"rebuilt in another process ({str(e).splitlines()[0]}); {fix}") from None


def random_state(paths: Sequence[str]) -> str | None:
    """The first variable path that is a random generator's state (Dropout, noise, random
    augmentation layers), or None."""
    return next((p for p in paths if "seed_generator" in p), None)


def not_comparable(engine: str, paths: Sequence[str]) -> str | None:
    """Why `engine` cannot be compared with JAX on a model with these variables, or None."""
    found = random_state(paths)
    if found is None:
        return None
    return (f"not comparable: the model draws random numbers ({found}: Dropout, noise or random "
            f"augmentation), which {_NAMES.get(engine, engine)} and JAX draw differently from the "
            "same seed; verify the engines on the model without its random layers")


def _flat(prefix: str, value, out: dict) -> None:
    """A batch part (an array, a dict of arrays, or None: no y) into `out` under `prefix`."""
    import numpy as np  # start-up: this module is read by the command line before the data

    if value is None:
        return
    if isinstance(value, dict):
        for key, part in value.items():
            out[f"{prefix}/{key}"] = np.asarray(part)
    else:
        out[prefix] = np.asarray(value)


def unflat(arrays, prefix: str):
    """What `_flat` wrote under `prefix`: an array, a dict of arrays, or None (nothing)."""
    if prefix in arrays:
        return arrays[prefix]
    return {key[len(prefix) + 1:]: arrays[key] for key in arrays
            if key.startswith(prefix + "/")} or None


def importable(function) -> bool:
    """Whether another process can rebuild `function` (see check_rebuildable)."""
    try:
        check_rebuildable(function)
        return True
    except MeshfitError:
        return False


def train_in_child(engine: str, build, start: list, source: Callable[[int], Iterator], *,
                   steps: int, global_batch: int, seed: int, precision: str, processes: int = 1,
                   devices: int = 1, sharding: str = "data",
                   model_parallel: int = 1) -> dict[str, Any]:
    """`steps` steps of the model on `engine` in a child process (with `processes` > 1: a job of
    `meshfit launch`, `devices` split over them, under `sharding`) from the weights `start`, on
    `source(0)`'s first `steps` batches (`source` itself when importable, so that an order that
    depends on the job shows): the trace's fields (steps, logs, weights, paths, seconds), or
    {"refused": why} when the model there cannot be compared."""
    import numpy as np  # start-up: this module is read by the command line before the data

    arrays: dict[str, Any] = {f"start/{j}": value for j, value in enumerate(start)}
    by_reference = processes > 1 and importable(source)
    batches = source(0)
    for step in range(0 if by_reference else steps):
        x, y = next(batches)
        _flat(f"x/{step}", x, arrays)
        _flat(f"y/{step}", y, arrays)
    with tempfile.TemporaryDirectory(prefix="meshfit-verify-engine-") as folder:
        with open(os.path.join(folder, JOB), "wb") as f:
            pickle.dump({"build": build, "steps": steps, "global_batch": global_batch,
                         "seed": seed, "precision": precision, "sharding": sharding,
                         "model_parallel": model_parallel,
                         "source": source if by_reference else None}, f)
        np.savez(os.path.join(folder, ARRAYS), **arrays)
        _run_child(engine, folder, processes, devices)
        with open(os.path.join(folder, TRACE_JSON)) as f:
            found = json.load(f)
        if "refused" in found:
            return found
        with np.load(os.path.join(folder, TRACE_ARRAYS)) as saved:
            found["weights"] = [[saved[f"{i}/{j}"] for j in range(len(found["paths"]))]
                                for i in range(len(found["steps"]))]
    return found


def _run_child(engine: str, folder: str, processes: int = 1, devices: int = 1) -> None:
    """Run the worker on `engine` over `folder` (in a job of `processes`, through `meshfit
    launch`); a one-line MeshfitError when it fails."""
    environment = dict(os.environ, KERAS_BACKEND=engine, MESHFIT_ENGINE=engine,
                       TF_ENABLE_ONEDNN_OPTS=os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1"),
                       PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the build's module
    # The simulated devices of this process are JAX's; the child's engine runs on one CPU.
    flags = environment.get("XLA_FLAGS", "").split()
    environment["XLA_FLAGS"] = " ".join(f for f in flags if not f.startswith(_DEVICE_COUNT_FLAG))
    command = [sys.executable, "-m", WORKER, folder]
    if processes > 1:
        command = [sys.executable, "-m", "meshfit", "launch", "--processes", str(processes),
                   "--devices-per-process", str(devices // processes), "--", *command]
    try:
        done = subprocess.run(command, env=environment, capture_output=True, text=True,
                              timeout=TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        raise MeshfitError(f"the {engine} engine's run did not finish in {TIMEOUT_SECONDS} s; "
                           "verify fewer --steps or a smaller --global-batch") from None
    if done.returncode or not os.path.exists(os.path.join(folder, TRACE_JSON)):
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        what = f"the {processes} processes' job" if processes > 1 else f"the {engine} engine's run"
        raise MeshfitError(f"{what} failed (exit {done.returncode}): "
                           f"{lines[-1] if lines else 'no message'}")
