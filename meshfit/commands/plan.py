"""`meshfit plan`: the memory plan of a recipe's train step, compiled but not run."""

from __future__ import annotations

from typing import Any

from meshfit import recipes
from meshfit.data import datasets, splits as data
from meshfit.errors import MeshfitError
from meshfit.parallel import planning
from meshfit.run.train import build, start_session


def plan_memory(recipe: str | None = None, *, simulate_devices: int | None = None,
                batch_size: int | None = None, sharding: str | None = "auto",
                fsdp_min_bytes: int | str | None = None,
                device_memory: int | str | None = None, precision: str | None = None,
                engine: str | None = None, require: str | None = None,
                data_dir: str | None = None, verbose: bool = True) -> dict[str, Any]:
    """`meshfit plan`: the memory plan of a recipe's train step on these devices (both modes,
    the largest per-core batch that fits each), without training. Returns `plan`'s dict with
    "recipe" and "sharding" (the mode `meshfit train` would use with this `sharding`)."""
    import types

    from meshfit.parallel import devices, memory_plan, sharding as sharding_lib
    from meshfit.parallel.distribution import connect

    datasets.check_data_dir(data_dir)
    the_recipe = recipes.load(recipe)
    strategy = connect(require=require, simulate=simulate_devices, engine=engine or "jax",
                       precision=planning.asked_precision(precision, the_recipe.precision),
                       verbose=verbose, sharding=sharding,
                       fsdp_min_bytes=fsdp_min_bytes or sharding_lib.DEFAULT_FSDP_MIN_BYTES,
                       device_memory=device_memory)
    if strategy.engine != "jax":
        raise MeshfitError("meshfit plan compiles the train step with JAX; use --engine jax")
    global_batch = planning.plan_global_batch(
        strategy.replicas, strategy.platform, strategy.device_kind,
        global_batch=batch_size or the_recipe.global_batch, per_core_batch=the_recipe.per_core_batch)
    classes = len(recipes.dataset_class_names(the_recipe.dataset))
    if classes and the_recipe.prepare is None:
        shape = types.SimpleNamespace(input_shape=recipes.input_shape(the_recipe), num_classes=classes)
    else:  # the recipe's own data says its shape and classes (or its prepare needs the data)
        shape = data.load(the_recipe, data_dir, 0)
    planned = strategy.with_sharding("fsdp") if strategy.distribution is not None else strategy
    start_session(planned, 0)
    with planned.scope():
        model = build(the_recipe, shape, 1, the_recipe.epochs, 1)
    memory = devices.memory_bytes(strategy.info, strategy.device_memory)
    result = memory_plan.plan(model, planned, global_batch, memory, largest=memory is not None)
    asked = strategy.sharding_asked
    result.update(recipe=the_recipe.name, sharding=result["choice"] if asked == "auto" else asked)
    return result
