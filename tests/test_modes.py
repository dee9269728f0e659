"""The registry of sharding modes (meshfit.parallel.modes): every mode has a one-line description
and a partition rule, a bad name is one line listing the good ones, the setting has one default,
and a mode registered here, in a test, is planned and trained on the 8 simulated devices like
the built-in ones."""

import math

import numpy as np
import pytest
from helpers import connect_eight_devices

import meshfit
from meshfit.errors import MeshfitError
from meshfit.parallel import modes, sharding


def rows_spec(shape, dtype, devices, fsdp_min_bytes, axis_name="batch", model_devices=1):
    """A test-only rule: a large float variable split along its first axis where `devices`
    divides it, as data elsewhere."""
    spec = sharding.replicated_spec(shape, dtype, devices, fsdp_min_bytes, axis_name, model_devices)
    large = sharding.is_float(dtype) and math.prod(shape) * sharding.itemsize(dtype) >= fsdp_min_bytes
    if large and devices > 1 and shape and spec[0] is None and shape[0] % devices == 0:
        spec[0] = axis_name
    return spec


ROWS = modes.ShardingMode("rows", "large float variables split along their first axis", rows_spec,
                          splits_state=True)


@pytest.fixture
def rows(monkeypatch):
    """ROWS registered for one test (the registry is restored after it)."""
    monkeypatch.setattr(modes, "MODES", dict(modes.MODES))
    return modes.register(ROWS)


def test_every_registered_mode_has_a_description_and_a_rule():
    assert list(modes.MODES) == ["data", "fsdp"] and modes.names() == ("auto", "data", "fsdp")
    for mode in modes.MODES.values():
        assert mode.description and "\n" not in mode.description and len(mode.description) < 100
        assert modes.mode_named(mode.name) is mode and str(mode) == mode.name
        for shape, dtype in (((64, 32), "float32"), ((7,), "int32"), ((), "float32")):
            spec = mode.partition(shape, dtype, 8, 1)
            assert len(spec) == len(shape) and all(a in (None, "batch") for a in spec)
    assert modes.FSDP.partition((64, 32), "float32", 8, 1) == ["batch", None]
    assert modes.DATA.partition((64, 32), "float32", 8, 1) == [None, None]
    assert modes.DATA.partition((32, 128), "float32", 2, 1, "batch", 4) == [None, "model"]
    assert modes.FSDP.layout_name(1) == "fsdp" and modes.FSDP.layout_name(4) == "fsdp x model 4"
    assert all(modes.MODES[m.name] is m for m in modes.AUTO.candidates)
    assert modes.AUTO.description and "\n" not in modes.AUTO.description


def test_a_bad_name_is_one_line_listing_the_good_ones():
    for call, listed in ((modes.mode_named, "data, fsdp"), (modes.check_sharding, "auto, data, fsdp")):
        with pytest.raises(MeshfitError) as error:
            call("zero")
        assert "\n" not in str(error.value) and "'zero'" in str(error.value)
        assert str(error.value).endswith(listed) or f"one of: {listed} " in str(error.value)
    with pytest.raises(MeshfitError, match="unknown sharding 'zero'; use one of: auto, data, fsdp"):
        meshfit.connect(sharding="zero")  # checked before any device is looked for
    with pytest.raises(MeshfitError, match="auto"):
        modes.mode_named("auto")  # a policy, not a layout
    with pytest.raises(MeshfitError, match="taken"):
        modes.register(modes.ShardingMode("data", "again", rows_spec, splits_state=False))


def test_a_mode_is_compared_as_an_object_never_with_its_name():
    assert modes.mode_named(" FSDP ") is modes.FSDP and modes.sharding_named("auto") is modes.AUTO
    assert modes.DATA != modes.FSDP and modes.DATA == modes.mode_named("data")
    with pytest.raises(TypeError, match="mode_named"):
        modes.DATA == "data"  # noqa: B015 (a leftover string comparison fails loudly)
    with pytest.raises(TypeError):
        modes.FSDP in ("data", "fsdp")  # noqa: B015


def test_the_sharding_setting_has_one_default(strategy):
    import argparse

    from meshfit.fit.strategy import Strategy
    from meshfit.run import options

    assert modes.DEFAULT is modes.AUTO and modes.check_sharding(None) == "auto"
    assert options.TrainOptions().sharding is None  # None: the default, or a resumed run's
    assert Strategy(strategy.info, "jax", "float32").sharding_asked is modes.DEFAULT
    assert strategy.sharding_asked is modes.DEFAULT  # connect() without sharding
    parser = argparse.ArgumentParser()
    options.add_flags(parser, "sharding")  # meshfit train, plan, info and bench's --sharding
    flag = next(a for a in parser._actions if a.dest == "sharding")
    assert flag.default is None and "(default: auto)" in flag.help
    assert all(f"{m.name}: {m.description}" in flag.help for m in modes.MODES.values())


def test_a_mode_registered_in_a_test_is_planned_and_trains_as_data_parallel(rows):
    import keras

    assert modes.check_sharding("rows") == "rows" and modes.names()[-1] == "rows"

    def build():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(8)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x = np.random.default_rng(0).normal(size=(64, 32)).astype("float32")
    y = np.random.default_rng(1).integers(0, 8, 64)
    weights = {}
    try:
        for name in ("data", "rows"):
            strategy = meshfit.connect(simulate_devices=8, engine="jax", sharding=name, fsdp_min_bytes=1,
                                       verbose=False)
            assert strategy.sharding is modes.mode_named(name)
            keras.utils.set_random_seed(0)
            model = build()
            model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
            weights[name] = model.get_weights()
        kernel = model.layers[0].kernel.value
        assert tuple(kernel.sharding.spec)[:1] == ("batch",)  # (32, 64) split along its rows
        moment = next(v for v in model.optimizer.variables if "kernel_momentum" in v.path)
        assert tuple(moment.value.sharding.spec)[:1] == ("batch",)  # Adam's moments follow
        for a, b in zip(weights["rows"], weights["data"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        assert strategy.report().splitlines()[-1].split(None, 1)[1].startswith(
            "rows (large float variables split along their first axis; asked;")
        result = meshfit.plan(build, 64, verbose=False)
        assert result.sharding == "rows" and set(result.modes) == {"data", "fsdp", "rows"}
        assert result.modes["rows"].weights < result.modes["data"].weights
    finally:
        connect_eight_devices()
