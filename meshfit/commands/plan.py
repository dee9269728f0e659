"""`meshfit plan`: the memory plan of a recipe's train step, compiled but not run.

It takes the run's own steps (meshfit.run.train: the recipe, its options, connect, the global
batch; meshfit.run.fitting: the model and the memory plan, 'auto' decided where a run decides
it), without loading the data where the recipe's dataset says its shape, and without training.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from meshfit import recipes
from meshfit.data import datasets, splits as data
from meshfit.errors import MeshfitError
from meshfit.parallel import devices
from meshfit.run import train
from meshfit.run.options import TrainOptions


def plan_memory(recipe: str | None = None, *, simulate_devices: int | None = None,
                global_batch: int | None = None, sharding: str | None = None,
                fsdp_min_bytes: int | str | None = None,
                device_memory: int | str | None = None, precision: str | None = None,
                engine: str | None = None, require: str | None = None,
                data_dir: str | None = None, verbose: bool = True,
                model_parallel: int | None = None) -> Any:
    """`meshfit plan`: the memory plan of a recipe's train step on these devices (both modes,
    the largest per-core batch that fits each), without training; printed when `verbose`.
    Returns the meshfit.fit.memory_plan.MemoryPlan with its recipe, its sharding (the mode
    `meshfit train` would use with this `sharding`) and `fits` (whether that mode's step fits the
    device memory: False where nothing fits, which `meshfit train` refuses; None where the memory
    is unknown). A plan that finds nothing fitting is still an answer: `meshfit plan` exits 0."""
    datasets.check_data_dir(data_dir)
    options = TrainOptions(global_batch=global_batch, simulate_devices=simulate_devices,
                           precision=precision or "auto", engine=engine or "jax", require=require,
                           sharding=sharding, fsdp_min_bytes=fsdp_min_bytes,
                           device_memory=device_memory, data_dir=data_dir, verbose=verbose,
                           model_parallel=model_parallel)
    the_recipe = train.load_recipe(recipe, options)
    asked = train.Asked(the_recipe, train.settle_options(options, the_recipe, None), run="")
    strategy = train.connect_devices(asked)
    if strategy.engine != "jax":
        raise MeshfitError("meshfit plan compiles the train step with JAX; use --engine jax")
    planned_batch = train.check_batch(asked, strategy, warn=True)
    memory = devices.memory_bytes(strategy.info, strategy.device_memory)
    shape = data_shape(the_recipe, data_dir)
    result = train.keras_side().memory_plan_of(the_recipe, shape, strategy, planned_batch,
                                               largest=memory is not None, verbose=verbose)
    return dataclasses.replace(result, recipe=the_recipe.name)


def data_shape(recipe: recipes.Recipe, data_dir: str | None):
    """What building the model needs of the data (input_shape, num_classes): a built-in dataset's
    without loading it; else the recipe's own data (or data its prepare needs) loaded."""
    classes = len(recipes.dataset_class_names(recipe.dataset))
    if classes and recipe.prepare is None:
        return types.SimpleNamespace(input_shape=recipes.input_shape(recipe), num_classes=classes)
    return data.load(recipe, data_dir, 0)
