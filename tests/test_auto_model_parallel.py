"""`sharding="auto"` choosing the model parallelism K on 8 simulated devices when neither data nor
fsdp fits the device memory: `meshfit.plan`, `meshfit train` (and `meshfit plan`) choose the
smallest K whose fsdp x model step fits, say why, and train as one device; a plain `fit` names
the model_parallel to connect with in one line and trains nothing; a model that fits
data-parallel keeps K = 1 with no extra compile.

The model: 64 -> 2048 -> 64 -> 10 with Adam, global batch 1024, fsdp over 100 KB. XLA's memory
analysis of its train step (jaxlib 0.10, the tests' XLA flags) per device: data 6.9 MB, fsdp
4.2 MB, fsdp x model 2 4.0 MB; so at 4.1 MB only K = 2 fits (the tests below assert the order
from the plans themselves, so that a new XLA that moves them fails loudly here, not elsewhere).
"""

import json
import os
import sys

import numpy as np
import pytest
from helpers import connect_eight_devices

import meshfit
from meshfit.errors import MeshfitError
from meshfit.fit import memory_plan
from meshfit.parallel import modes
from meshfit.parallel.sharding import format_bytes
from meshfit.run import rundir

MEMORY = {"device_memory": "4.1MB", "fsdp_min_bytes": "100KB"}
FLAGS = ["--device-memory", "4.1MB", "--fsdp-min-bytes", "100KB"]
X = np.random.default_rng(0).normal(size=(2048, 64)).astype("float32")
Y = np.random.default_rng(1).integers(0, 10, 2048)


def wide(seed=0, width=2048):
    """The 64 -> width -> 64 -> 10 MLP with Adam, compiled."""
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def train(model):
    """Two steps of plain fit (global batch 1024, in order); the loss of its one epoch."""
    return model.fit(X, Y, batch_size=1024, epochs=1, verbose=0, shuffle=False).history["loss"]


@pytest.fixture(scope="module")
def one_device_loss():
    import dataclasses

    from meshfit.fit.strategy import Strategy

    eight = connect_eight_devices()
    one = Strategy(dataclasses.replace(eight.info, devices=eight.info.devices[:1], devices_per_host=1),
                   "jax", "float32")
    try:
        with one.scope():
            return train(wide())
    finally:
        connect_eight_devices()


@pytest.fixture
def compiles(monkeypatch):
    """The number of train steps the memory plan compiles, counted."""
    count = [0]
    planning = sys.modules["meshfit.fit.memory_plan.plan"]  # where plan_mode finds it
    compiled = planning.compiled_bytes

    def counted(*args, **kwargs):
        count[0] += 1
        return compiled(*args, **kwargs)

    monkeypatch.setattr(planning, "compiled_bytes", counted)
    return count


def test_plan_chooses_the_smallest_model_parallelism_that_fits_and_says_why(strategy, capsys):
    try:
        meshfit.connect(simulate_devices=8, verbose=False, **MEMORY)
        result = meshfit.plan(wide, 1024)
        out = capsys.readouterr().out
        data, fsdp = result.modes["data"], result.modes["fsdp"]
        tried = result.model_parallel_plans
        assert not data.fits and not fsdp.fits
        assert list(tried) == ["data x model 2", "fsdp x model 2"]
        chosen = tried["fsdp x model 2"]
        assert chosen.fits and not tried["data x model 2"].fits
        assert result.model_parallel == 2 and result.sharding == "fsdp"
        assert chosen.model_parallel == 2 and chosen.weights * 6 < data.weights
        # XLA's cost analysis and the collectives of each compiled step, shown with the reason.
        assert chosen.flops > 1e8 and chosen.bytes_accessed > 0
        assert chosen.collectives > fsdp.collectives > data.collectives >= 1
        assert chosen.collective_bytes > 0
        using = next(line for line in out.splitlines() if "using" in line)
        assert using.startswith("  using fsdp x model 2: model parallel 2: fsdp needs 4.2 MB per device "
                                "(data 6.9 MB), more than 4.1 MB; fsdp x model 2 needs 4.0 MB (each step")
        assert using.endswith(f"; data x model 2 needs {format_bytes(tried['data x model 2'].total)}")
        assert "collectives of" in using and "meshfit.connect(..., sharding='fsdp', model_parallel=2)" in out
        # A model parallelism the user gave is kept: nothing else is tried.
        meshfit.connect(simulate_devices=8, verbose=False, model_parallel=1, **MEMORY)
        kept = meshfit.plan(wide, 1024, verbose=False)
        assert kept.model_parallel == 1 and kept.model_parallel_plans is None
        assert kept.why.endswith("neither fits")
    finally:
        connect_eight_devices()


def plan(mode, k, total, exchanged, memory=100):
    """A made-up plan of `mode` x model `k`: `total` bytes per device, `exchanged` by collectives."""
    return memory_plan.ModePlan(mode, 0, 0, 0, 0, total, 0, 0, total <= memory, None, k,
                                collective_bytes=exchanged)


@pytest.mark.parametrize("plans, chosen", [
    # (data, fsdp) x model K: (total, bytes exchanged); the device has 100 bytes.
    ({2: ((150, 10), (90, 50)), 4: ((80, 10), (60, 5))}, ("fsdp", 2)),  # the smallest K that fits
    ({2: ((90, 40), (60, 50))}, ("data", 2)),  # both fit: the fewer bytes exchanged
    ({2: ((90, 60), (60, 50))}, ("fsdp", 2)),
    ({2: ((90, 50), (60, 50))}, ("data", 2)),  # a tie: data, which gathers no weights
    ({2: ((90, None), (60, 50))}, ("fsdp", 2)),  # unknown bytes lose
    ({2: ((150, 1), (120, 1)), 4: ((150, 1), (110, 1)), 8: ((101, 1), (101, 1))}, None),
])
def test_auto_takes_the_smallest_k_where_data_or_fsdp_x_model_fits_and_the_fewer_bytes_exchanged(
        strategy, plans, chosen):
    seen = []

    def plan_on(candidate, mode):
        k = candidate.model_parallel
        seen.append((mode, k, candidate.distribution.axis_sizes["model"]))
        return plan(mode, k, *plans[k][mode == "fsdp"])

    neither = {"data": plan("data", 1, 400, 1), "fsdp": plan("fsdp", 1, 200, 1)}
    result = memory_plan.MemoryPlan(100, 1024, 8, 1, neither, "fsdp", "neither fits")
    result = memory_plan.model_parallel_plans(strategy, plan_on, result)
    assert all(k == size for _, k, size in seen)  # each planned on its own (8/K) x K mesh
    assert [(m, k) for m, k, _ in seen] == [(m, k) for k in plans for m in ("data", "fsdp")][:len(seen)]
    if chosen is None:
        assert result.model_parallel == 1 and result.why.startswith("neither fits; nor data or fsdp x model 2, 4, 8")
    else:
        assert (result.choice, result.model_parallel) == chosen and seen[-1][1] == chosen[1]
        assert result.why.startswith(f"model parallel {chosen[1]}: ")
        assert result.used(chosen[0]).total == plans[chosen[1]][chosen[0] == "fsdp"][0]


def test_a_plain_fit_names_the_model_parallel_to_connect_with_and_then_trains_as_one_device(
        one_device_loss, capsys):
    try:
        strategy = meshfit.connect(simulate_devices=8, verbose=False, **MEMORY)
        model = wide()
        before = model.get_weights()
        for _ in range(2):  # asked again, it refuses again: never trains what does not fit
            with pytest.raises(MeshfitError) as error:
                train(model)
            message = str(error.value)
            assert "\n" not in message and message.startswith("sharding auto: model parallel 2: ")
            assert "pass model_parallel=2 to meshfit.connect()" in message
        assert "using fsdp x model 2" in capsys.readouterr().out
        assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
        assert strategy.model_parallel == 1 and strategy.sharding is modes.DATA
        # As the line says:
        strategy = meshfit.connect(simulate_devices=8, verbose=False, sharding="fsdp", model_parallel=2,
                                   **MEMORY)
        model = wide()
        np.testing.assert_allclose(train(model), one_device_loss, rtol=1e-5)
        assert strategy.distribution.axis_sizes == {"batch": 4, "model": 2}
        assert tuple(model.layers[0].kernel.value.sharding.spec) == ("batch", "model")
    finally:
        connect_eight_devices()


def test_a_model_that_fits_data_parallel_keeps_one_and_compiles_nothing_more(compiles, capsys):
    try:
        strategy = meshfit.connect(simulate_devices=8, verbose=False, **MEMORY)
        model = wide(width=256)
        train(model)
        assert compiles[0] == 1 and capsys.readouterr().out == ""  # the data step only, as before
        assert (strategy.sharding.name, strategy.model_parallel) == ("data", 1)
        result = meshfit.plan(lambda: wide(width=256), 1024, verbose=False)
        assert compiles[0] == 3 and result.model_parallel == 1 and result.sharding == "data"
        assert result.model_parallel_plans is None
    finally:
        connect_eight_devices()


RECIPE = '''
import numpy as np
import meshfit


def dataset(seed):
    x = np.random.default_rng(0).integers(0, 256, (2304, 8, 8, 1)).astype("uint8")
    y = np.random.default_rng(1).integers(0, 10, 2304)
    return (x[:2048], y[:2048]), (x[2048:], y[2048:])


def build_model(input_shape, num_classes):
    import keras

    return keras.Sequential([keras.Input(input_shape), keras.layers.Rescaling(1 / 255),
                             keras.layers.Flatten(), keras.layers.Dense(2048, activation="relu"),
                             keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(num_classes, activation="softmax")])


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.Adam(1e-3)


RECIPE = meshfit.Recipe(name="wide64", dataset=dataset, build_model=build_model,
                        optimizer=optimizer, epochs=1, global_batch=1024)
'''


@pytest.mark.slow
def test_meshfit_train_chooses_model_parallelism_before_the_mesh_and_records_it(strategy, tmp_path,
                                                                                capsys):
    """meshfit plan and train, in this process: auto picks fsdp x model 2 before building the
    run's model, config.json records model_parallel 2 (as --model-parallel would), --resume
    keeps it, and the losses are data parallelism's (itself one device's, tests/test_sharding.py)."""
    from meshfit import cli

    recipe = tmp_path / "wide64.py"
    recipe.write_text(RECIPE)
    devices = ["--simulate-devices", "8", "--engine", "jax", "--no-tensorboard"]
    try:
        assert cli.main(["plan", str(recipe), *devices[:4], "--json", *FLAGS]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (result["sharding"], result["model_parallel"]) == ("fsdp", 2)
        run, data_run = str(tmp_path / "auto"), str(tmp_path / "data")
        assert cli.main(["train", str(recipe), *devices, "--out", run, *FLAGS]) == 0
        assert "using fsdp x model 2: model parallel 2:" in capsys.readouterr().out
        config = json.load(open(os.path.join(run, rundir.CONFIG)))
        assert (config["sharding"], config["model_parallel"], config["replicas"]) == ("fsdp", 2, 4)
        assert cli.main(["train", str(recipe), *devices, "--out", data_run, "--sharding", "data"]) == 0
        losses = [[e["loss"] for e in json.load(open(os.path.join(r, rundir.HISTORY)))] for r in (run, data_run)]
        np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
        assert cli.main(["train", "--resume", run, "--epochs", "2", *devices, *FLAGS]) == 0
        metrics = json.load(open(os.path.join(run, rundir.METRICS)))
        assert metrics["model_parallel"] == 2 and metrics["resumed"] and metrics["epochs"] == 2
    finally:
        connect_eight_devices()


def test_auto_plans_a_batch_the_devices_do_not_split_as_it_trains_whole():
    """sharding 'auto' with a device memory plans at the first fit with its batch; one of 3 rows
    on 8 devices, which fit places whole on every device, is planned so (its split placement
    does not lower: the plan stopped the fit) and trains as under sharding 'data'."""
    import keras

    losses = {}
    try:
        for sharding in ("auto", "data"):
            meshfit.connect(simulate_devices=8, verbose=False, sharding=sharding, device_memory="16GB")
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
            model.compile(optimizer="adam", loss="mse")
            history = model.fit(np.ones((6, 4), "float32"), np.zeros((6, 2), "float32"), batch_size=3,
                                epochs=1, verbose=0)
            losses[sharding] = history.history["loss"]
    finally:
        connect_eight_devices()
    assert losses["auto"] == losses["data"]


def test_a_step_that_cannot_be_planned_names_each_tries_error(monkeypatch, strategy):
    """The plan lowers the step with sparse labels, then with labels shaped as the outputs; where
    both fail, the line gives each one's error (the second alone blamed a label shape before,
    printing two equal shapes, when the cause was elsewhere)."""
    import keras

    from meshfit.fit.memory_plan import lowering

    tries = iter([ValueError("the real cause\nmore"), ValueError("target.shape != output.shape")])

    def fails(*_, **__):
        raise next(tries)

    monkeypatch.setattr(lowering.report, "lower_train_step", fails)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(MeshfitError) as error:
        lowering.compiled_bytes(model, 8, None, {})
    assert str(error.value) == ("cannot plan the memory of this model's train step (with sparse "
                                "labels: the real cause; with labels shaped as the outputs: "
                                "target.shape != output.shape)")


def test_where_neither_mode_fits_auto_takes_the_smaller():
    """A small model's fsdp step (gathering every weight where it is used) can need more than its
    replicated one: where neither fits, the smaller is trained (fsdp before, whatever its size)."""
    from meshfit.fit.memory_plan import choice

    mode, why = choice.auto_sharding({"data": plan("data", 1, 325, 1), "fsdp": plan("fsdp", 1, 328, 1)}, 60)
    assert mode == "data" and why.endswith("neither fits")
    assert choice.auto_sharding({"data": plan("data", 1, 400, 1), "fsdp": plan("fsdp", 1, 200, 1)}, 60)[0] == "fsdp"
