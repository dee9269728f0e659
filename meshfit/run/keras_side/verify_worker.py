"""The child process of `meshfit verify --engines`: `python -m meshfit.run.keras_side.verify_worker
FOLDER` trains the job in FOLDER (meshfit.run.verify_engines writes it) on the engine its parent
set in KERAS_BACKEND and MESHFIT_ENGINE, and writes the trace back into FOLDER: TensorFlow in one
process, or JAX in each process of a job of `meshfit launch` (process 0 writes the trace).

Started by verify_engines only, with KERAS_BACKEND set: this module imports Keras at its top,
which fixes the backend before meshfit.connect() runs here.
"""

from __future__ import annotations

import json
import os
import pickle
import sys

import keras
import numpy as np

import meshfit
from meshfit.run import verify as verify_lib
from meshfit.run import verify_engines
from meshfit.run.keras_side import verify_training as training


def _build(job: dict):
    """The function that builds the model: the user's, or the recipe's from its TARGET."""
    build = job["build"]
    if not isinstance(build, dict):
        return build
    recipe, saved = verify_lib.target_recipe(build["target"], 1, engine=keras.backend.backend())
    dataset = meshfit.data.splits.load(recipe, build["data_dir"], build["seed"],
                                       saved.dataset if saved else None)
    return training.builder(verify_lib.RecipeModel(recipe, dataset, build["steps_per_epoch"],
                                                           build["epochs"]))


def main(folder: str) -> None:
    with open(os.path.join(folder, verify_engines.JOB), "rb") as f:
        job = pickle.load(f)
    several = keras.backend.backend() == "jax"  # a job of `meshfit launch`: its environment
    strategy = meshfit.connect(engine=keras.backend.backend(), precision=job["precision"],
                               sharding=job["sharding"] if several else None,
                               model_parallel=job["model_parallel"] if several else None,
                               verbose=False)
    with np.load(os.path.join(folder, verify_engines.ARRAYS)) as saved:
        arrays = {key: saved[key] for key in saved.files}
    steps = job["steps"]
    start = [arrays[f"start/{j}"] for j in range(sum(k.startswith("start/") for k in arrays))]
    batches = [(verify_engines.unflat(arrays, f"x/{s}"), verify_engines.unflat(arrays, f"y/{s}"))
               for s in range(steps if job.get("source") is None else 0)]

    def source(first: int):
        yield from batches[first:]

    if job.get("source") is not None:  # the user's own, read in this job's processes
        source = job["source"]
        batches = [next(iter(source(0)))]
    build = _build(job)
    model = training.new_model(strategy, build, job["seed"], batches[0])
    shapes = [tuple(v.shape) for v in model.variables]
    if shapes != [value.shape for value in start]:
        _write(folder, {"refused": f"not comparable: the model has other variables on "
                                   f"{keras.backend.backend()} ({len(shapes)}) than on JAX "
                                   f"({len(start)}), or of other shapes"})
        return
    trace = training.train(strategy, build, source, steps=steps, global_batch=job["global_batch"],
                           seed=job["seed"], start=start)
    if strategy.info.process_index:  # process 0 writes the trace
        return
    np.savez(os.path.join(folder, verify_engines.TRACE_ARRAYS),
             **{f"{i}/{j}": value for i, values in enumerate(trace.weights)
                for j, value in enumerate(values)})
    _write(folder, {"steps": trace.steps, "logs": trace.logs, "paths": trace.paths,
                    "seconds": trace.seconds})


def _write(folder: str, found: dict) -> None:
    with open(os.path.join(folder, verify_engines.TRACE_JSON), "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    main(sys.argv[1])
