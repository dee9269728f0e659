"""`meshfit plan`: the memory plan of a recipe's train step, compiled but not run.

It takes the run's own steps (meshfit.run.train: the recipe, its options, connect, the global
batch; meshfit.run.keras_side.fitting: the model and the memory plan, 'auto' decided where a run
decides it), without loading the data where the recipe's dataset says its shape, and without training.
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


def plan_memory(recipe: str | None = None, options: TrainOptions | None = None,
                **settings: Any) -> Any:
    """`meshfit plan`: the memory plan of a recipe's train step on these devices (both modes,
    the largest per-core batch that fits each), without training; printed when `verbose`.
    options (or `settings`, its fields by name): what `meshfit plan` takes of a run's settings,
    global_batch, data_dir and those of connect() (TrainOptions.connect_settings); the engine is
    jax unless given, as the step is compiled with JAX.
    Returns the meshfit.fit.memory_plan.MemoryPlan with its recipe, its sharding (the mode
    `meshfit train` would use with this `sharding`) and `fits` (whether that mode's step fits the
    device memory: False where nothing fits, which `meshfit train` refuses; None where the memory
    is unknown). A plan that finds nothing fitting is still an answer: `meshfit plan` exits 0."""
    options = dataclasses.replace(options, **settings) if options else TrainOptions(**settings)
    datasets.check_data_dir(options.data_dir)
    options = dataclasses.replace(options, engine=options.engine or "jax")
    the_recipe = train.load_recipe(recipe, options)
    asked = train.Asked(the_recipe, train.settle_options(options, the_recipe, None), run="")
    strategy = train.connect_devices(asked)
    if strategy.engine != "jax":
        raise MeshfitError("meshfit plan compiles the train step with JAX; use --engine jax")
    planned_batch = train.check_batch(asked, strategy, warn=True)
    memory = devices.memory_bytes(strategy.info, strategy.device_memory)
    shape = data_shape(the_recipe, options.data_dir)
    result = train.keras_side().memory_plan_of(the_recipe, shape, strategy, planned_batch,
                                               largest=memory is not None, verbose=options.verbose)
    return dataclasses.replace(result, recipe=the_recipe.name)


def data_shape(recipe: recipes.Recipe, data_dir: str | None):
    """What building the model needs of the data (input_shape, num_classes): a built-in dataset's
    without loading it; else the recipe's own data (or data its prepare needs) loaded."""
    names = recipes.dataset_class_names(recipe.dataset)
    if names and recipe.prepare is None:  # what fitting.build reads of a loaded dataset
        return types.SimpleNamespace(input_shape=recipes.input_shape(recipe), num_classes=len(names),
                                     class_names=names)
    return data.load(recipe, data_dir, 0)
