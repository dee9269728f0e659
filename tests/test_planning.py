"""Planning from the hardware (meshfit.parallel.planning): precision and peak FLOP/s."""

import pytest

import meshfit
from meshfit.parallel import planning


def test_precision_auto_and_forced():
    assert planning.resolve_precision("auto", "tpu") == "bfloat16"
    assert planning.resolve_precision("auto", "gpu", "9.0") == "bfloat16"
    assert planning.resolve_precision("auto", "gpu", "7.0") == "float16"
    assert planning.resolve_precision("auto", "cpu") == "float32"
    assert planning.resolve_precision("bf16", "cpu") == "bfloat16"
    with pytest.raises(meshfit.MeshfitError, match="unknown precision 'fp8x'.*float32, bfloat16, float16"):
        planning.resolve_precision("fp8x", "cpu")


def test_peak_flops_known_for_accelerators_and_not_cpus():
    assert planning.peak_flops("gpu", "NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert planning.peak_flops("tpu", "TPU v4", "bfloat16") == 275e12
    assert planning.peak_flops("cpu", "AMD EPYC 7B13", "float32") is None


def hardware(platform="cpu", replicas=1, engine="jax", device_kind="cpu", capability=None):
    """A stand-in for a Strategy: what plan_batch() reads of it."""
    import types

    return types.SimpleNamespace(platform=platform, replicas=replicas, engine=engine,
                                 device_kind=device_kind,
                                 info=types.SimpleNamespace(compute_capability=capability))


def test_auto_precision_is_the_recipes_else_the_hardwares_on_every_route():
    assert planning.resolve_precision("auto", "cpu", recipe="bfloat16") == "bfloat16"
    assert planning.resolve_precision("auto", "cpu", recipe="auto") == "float32"
    assert planning.resolve_precision("auto", "tpu", recipe="auto") == "bfloat16"
    assert planning.resolve_precision("float16", "tpu", recipe="bfloat16") == "float16"
    assert planning.asked_precision("auto", "bf16") == "bfloat16"
    assert planning.asked_precision("auto", "auto") == "auto"
    with pytest.raises(meshfit.MeshfitError, match="unknown precision 'fp9'"):
        planning.asked_precision("auto", "fp9")  # a recipe's precision is checked too


def test_plan_decides_batch_steps_dispatch_and_micro_batches_in_one_value():
    """The batch plan; the precision on the same hardware is connect()'s, resolved once."""
    p = planning.plan_batch(hardware(replicas=8), samples=1000, global_batch=100, recipe_steps=3)
    assert (p.global_batch, p.steps_per_epoch, p.steps_per_dispatch) == (104, 3, 1)  # split over 8
    assert (planning.resolve_precision("auto", "cpu"), p.micro_batches) == ("float32", "auto")
    planned = planning.plan_batch(hardware(), samples=100)  # 128 planned: lowered to a quarter of 100
    assert (planned.global_batch, planned.steps_per_epoch) == (25, 4)
    gpu = planning.plan_batch(hardware("gpu", 2, device_kind="NVIDIA H100", capability="9.0"),
                              samples=10_000, recipe_batch=256)
    assert (gpu.global_batch, gpu.steps_per_epoch, gpu.steps_per_dispatch) == (256, 39, 13)
    assert planning.resolve_precision("auto", "gpu", "9.0") == "bfloat16"
    assert planning.plan_batch(hardware(), stream=(32, 5)).steps_per_epoch == 5
    assert planning.plan_batch(hardware(), samples=10, global_batch=20).steps_per_epoch is None
    with pytest.raises(meshfit.MeshfitError, match="not --global-batch 64"):
        planning.plan_batch(hardware(), stream=(32, 5), global_batch=64)
    assert planning.plan_batch(hardware(), samples=100, micro_batches=4).micro_batches == 4  # JAX too
    with pytest.raises(meshfit.MeshfitError, match="does not split evenly"):
        planning.plan_batch(hardware(replicas=8), samples=1000, global_batch=100, rounding=False)


def plan_of(data_total, fsdp_total, memory, largest_per_core):
    """A memory plan (as memory_plan.plan_memory returns it) for two modes' totals."""
    from meshfit.fit import memory_plan

    plans = {mode: memory_plan.ModePlan(mode, 100, 200, total - 300, 10, total, 300, 300,
                                        total <= memory, largest_per_core)
             for mode, total in (("data", data_total), ("fsdp", fsdp_total))}
    choice, why = memory_plan.auto_sharding(plans, memory)
    return memory_plan.MemoryPlan(memory, 64, 8, 1, plans, choice, why)


def test_plan_claims_no_mode_when_nothing_fits():
    """Issue 39 item 5: where neither mode fits, the plan's last line names no mode to use (a run
    would refuse both); it says nothing fits and names the largest global batch that does."""
    from meshfit.fit import memory_plan

    last = memory_plan.summary_lines(plan_of(8000, 6000, 4000, 2), "fsdp")[-1]
    assert last.startswith("  nothing fits: the replicated step needs 8.0 KB") and "using" not in last
    assert last.endswith("the largest global batch that fits is 16 (--global-batch 16)")
    asked = memory_plan.summary_lines(plan_of(8000, 2000, 4000, 2), "data")[-1]  # --sharding data
    assert asked == "  data (as asked) does not fit; the largest global batch that fits is 16 (--global-batch 16)"
    fits = memory_plan.summary_lines(plan_of(8000, 2000, 4000, 2), "fsdp")[-1]
    assert fits.startswith("  using fsdp: the replicated step needs 8.0 KB")


# The keys `meshfit plan --json` wrote while the plan was a dict (meshfit.fit.memory_plan before
# MemoryPlan; checked against that code's output for a recipe where model parallelism was weighed).
PLAN_KEYS = ["device_memory", "global_batch", "devices", "model_parallel", "modes", "choice", "why",
             "model_parallel_plans", "sharding", "fits", "recipe"]
MODE_KEYS = ["mode", "weights", "optimizer", "step_temp", "batch", "total", "replicated", "state", "fits",
             "largest_per_core_batch", "model_parallel", "flops", "bytes_accessed", "collectives",
             "collective_bytes", "replicated_share"]


def test_memory_plan_is_frozen_and_its_json_has_the_keys_meshfit_plan_wrote():
    import dataclasses
    import json

    plan = plan_of(8000, 2000, 4000, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.choice = "data"
    with pytest.raises(TypeError):  # its plans too
        plan.modes["data"] = plan.modes["fsdp"]
    assert list(plan.as_dict()) == PLAN_KEYS[:7]  # undecided, nothing weighed, no recipe
    weighed = dataclasses.replace(plan, model_parallel_plans={"fsdp x model 2": plan.modes["fsdp"]},
                                  sharding="fsdp", recipe="wide")
    written = json.loads(json.dumps(weighed.as_dict()))
    assert list(written) == PLAN_KEYS and list(written["modes"]["data"]) == MODE_KEYS
    assert list(written["model_parallel_plans"]["fsdp x model 2"]) == MODE_KEYS
    assert (written["sharding"], written["fits"], written["modes"]["data"]["fits"]) == ("fsdp", True, False)
    assert written["modes"]["fsdp"]["replicated_share"] == 1.0
    # --sharding data where it does not fit: "fits" is that mode's, and no plan was weighed.
    asked = dataclasses.replace(plan, sharding="data").as_dict()
    assert asked["fits"] is False and "model_parallel_plans" not in asked and "recipe" not in asked


def test_the_global_batch_takes_one_route_for_train_plan_bench_and_strategy():
    """train's check before the data (meshfit plan's too), the batch plan after it, bench's
    default batch and Strategy.global_batch all ask planning.plan_global_batch: one answer."""
    import types

    from meshfit.commands.bench.keras_side import timing
    from meshfit.fit.strategy import Strategy
    from meshfit.run import train
    from meshfit.run.options import TrainOptions

    gpus = hardware("gpu", 2, device_kind="NVIDIA H100")
    for recipe_batch, per_core, asked, expected in ((None, None, None, 256), (96, None, None, 96),
                                                    (None, 16, None, 32), (96, None, 64, 64)):
        recipe = types.SimpleNamespace(global_batch=recipe_batch, per_core_batch=per_core)
        run = types.SimpleNamespace(options=TrainOptions(global_batch=asked), recipe=recipe)
        planned = planning.plan_batch(gpus, global_batch=asked, recipe_batch=recipe_batch,
                                      per_core_batch=per_core)
        assert train.check_batch(run, gpus) == planned.global_batch == expected
        if asked is None:
            assert timing.default_batch(recipe, gpus) == expected
    assert Strategy.global_batch(gpus, 16) == 32
