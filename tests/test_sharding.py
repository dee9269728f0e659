"""Sharding (meshfit.parallel.sharding) and the memory plan (meshfit.fit.memory_plan) on 8 simulated devices:
fsdp holds 1/8 of the large state per device and trains to data-parallel's weights; a model too
big for data parallelism under --device-memory is refused with --sharding data and trained with
fsdp by default; its run evaluates, predicts, exports and resumes."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import connect_eight_devices, environment

from meshfit.run import rundir
from meshfit.parallel import modes, sharding
from meshfit.fit.strategy import Strategy
from meshfit.errors import MeshfitError

MIN_BYTES = 100_000  # lowered from 1 MiB so that the tiny models' large kernels are sharded
SMALL_SLACK = 64_000  # bytes of small replicated variables allowed beyond 1/8


def mlp():
    import keras

    return keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                             keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])


def cnn():
    import keras

    return keras.Sequential([keras.Input((8, 8, 4)), keras.layers.Conv2D(64, 3, padding="same"),
                             keras.layers.BatchNormalization(), keras.layers.ReLU(),
                             keras.layers.Conv2D(64, 3, padding="same"),
                             keras.layers.BatchNormalization(), keras.layers.ReLU(),
                             keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])


def attention():
    import keras

    tokens = keras.Input((16,), dtype="int32")
    h = keras.layers.Embedding(1000, 128)(tokens)
    h = h + keras.layers.MultiHeadAttention(4, 64)(h, h)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Dense(256, activation="relu")(h)
    return keras.Model(tokens, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h)))


def data_for(name):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, 64)
    if name == "attention":
        return rng.integers(0, 1000, (64, 16)).astype("int32"), y
    shape = {"mlp": (256,), "cnn": (8, 8, 4)}[name]
    return rng.normal(size=(64, *shape)).astype("float32"), y


def trained(strategy, name):
    """The model `name` built under `strategy`, after 2 epochs of plain fit (4 steps of 32)."""
    import keras

    strategy.activate()
    keras.utils.set_random_seed(0)
    model = {"mlp": mlp, "cnn": cnn, "attention": attention}[name]()
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data_for(name)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    return model


def device0_bytes(variables) -> int:
    total = 0
    for v in variables:
        shard = v.value.addressable_shards[0]
        assert shard.device == v.value.sharding.mesh.devices.flat[0]
        total += int(np.prod(shard.data.shape)) * v.value.dtype.itemsize
    return total


@pytest.mark.parametrize("name", ["mlp", "cnn", "attention"])
def test_fsdp_holds_an_eighth_and_trains_as_data_parallel(strategy, name):
    fsdp = Strategy(strategy.info, "jax", "float32", "fsdp", MIN_BYTES)
    try:
        sharded = trained(fsdp, name)
        state = sharded.variables + sharded.optimizer.variables
        whole = sum(int(np.prod(v.shape)) * 4 for v in state)
        assert device0_bytes(state) <= 1.05 * whole / 8 + SMALL_SLACK
        moments = [v for v in sharded.optimizer.variables if "kernel_momentum" in v.path]
        assert any(v.value.sharding.spec != (None,) * len(v.shape) and "batch" in v.value.sharding.spec
                   for v in moments)  # Adam's moments follow their weights
        replicated = trained(strategy.with_sharding("data"), name)
        assert all(v.value.sharding.is_fully_replicated for v in replicated.variables)
        for a, b in zip(sharded.get_weights(), replicated.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    finally:
        connect_eight_devices()


def test_every_sharded_variable_is_created_in_its_shards(strategy, monkeypatch):
    """Every variable whose layout splits it is drawn by a compiled program straight into its
    shards (meshfit.fit.sharded_init), never made whole and then distributed (Keras'
    distribute_tensor, its path below 256 MiB x devices): with Keras' initializers (int seeds, a
    SeedGenerator, defaults, zeros) and a user's function alike; a user's initializer that cannot
    be traced, or holds a SeedGenerator, runs as in Keras. One compile serves every
    variable of the same initializer, shape and layout; the values are the replicated build's (to
    a float's last bit where XLA fuses a normal draw's scale into it)."""
    import keras
    from keras.src.backend.jax import distribution_lib

    from meshfit.fit import sharded_init

    distributed = []
    spread = distribution_lib.distribute_tensor
    monkeypatch.setattr(distribution_lib, "distribute_tensor",
                        lambda tensor, layout: distributed.append(tuple(tensor.shape)) or spread(tensor, layout))

    def users_own(shape, dtype=None):
        return keras.random.normal(shape, stddev=0.1, seed=5, dtype=dtype)

    def unseeded(shape, dtype=None):  # Keras' global generator: refused inside a trace
        return keras.random.normal(shape, dtype=dtype)

    class Generated(keras.initializers.Initializer):  # advancing it in a trace would leak it
        def __init__(self):
            self.generator = keras.random.SeedGenerator(3)

        def __call__(self, shape, dtype=None):
            return keras.random.uniform(shape, seed=self.generator, dtype=dtype)

    def build(on):
        with on.scope():
            keras.utils.set_random_seed(0)
            return keras.Sequential([
                keras.Input((4,), dtype="int32"), keras.layers.Embedding(1000, 256),  # RandomUniform
                keras.layers.Dense(512), keras.layers.Dense(256), keras.layers.Dense(512),  # Glorot
                keras.layers.Dense(256, kernel_initializer=keras.initializers.RandomNormal(seed=7)),
                keras.layers.Dense(512, kernel_initializer=keras.initializers.HeNormal(
                    seed=keras.random.SeedGenerator(11))),
                keras.layers.Dense(256, kernel_initializer="zeros"),
                keras.layers.Dense(512, kernel_initializer=users_own),
                keras.layers.Dense(384, kernel_initializer=unseeded),
                keras.layers.Dense(640, kernel_initializer=Generated())])

    fsdp = Strategy(strategy.info, "jax", "float32", "fsdp", MIN_BYTES)
    try:
        sharded_init._compiled.cache_clear()
        sharded = build(fsdp)
        split = [v for v in sharded.weights if not v.value.sharding.is_fully_replicated]
        assert len(split) == 10  # the table and every kernel
        # made whole first: only the two a trace would change, in Keras' own way
        assert {tuple(v.shape) for v in split} & set(distributed) == {(512, 384), (384, 640)}
        # Glorot on (256, 512) twice, once on (512, 256); the HeNormal, RandomNormal and table
        # draws once each (zeros are placed from the host, nothing compiled); the user's function
        # is compiled where it is used, not kept
        assert sharded_init._compiled.cache_info().currsize == 5
        replicated = build(strategy.with_sharding("data"))
        for a, b in zip(sharded.weights, replicated.weights, strict=True):  # to 1 ulp (see above)
            np.testing.assert_allclose(a.value, b.value, rtol=3e-7, atol=1e-9, err_msg=a.path)
    finally:
        connect_eight_devices()


def test_a_model_whose_checkpoint_overwrites_it_starts_from_zeros_laid_out_as_drawn(strategy):
    """sharded_init.values_restored_later (a resumed run's build): every variable starts as zeros
    with the layout and dtype a drawn build gives it, under data and fsdp alike; outside the
    block the values are drawn again."""
    import keras

    from meshfit.fit import sharded_init

    def build(on):
        with on.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(1000, 256),
                                      keras.layers.Dense(512), keras.layers.Dropout(0.1, seed=3),
                                      keras.layers.Dense(10)])
            model.compile("adam", "mse")
            return model

    try:
        for mode in ("data", "fsdp"):
            on = Strategy(strategy.info, "jax", "float32", mode, MIN_BYTES)
            with sharded_init.values_restored_later():
                zeroed = build(on)
            drawn = build(on)
            for z, d in zip(zeroed.variables, drawn.variables, strict=True):
                assert z.value.sharding == d.value.sharding and z.value.dtype == d.value.dtype, z.path
                assert not np.asarray(z.value).any(), z.path
            assert any(np.asarray(d.value).any() for d in drawn.weights)
    finally:
        connect_eight_devices()


def test_a_sharded_draw_holds_a_share_not_the_whole(strategy):
    """XLA's memory analysis of the compiled draw of a (1024, 512) Glorot kernel split over 8
    devices: each device's output is its eighth, and what it computes on the way (the random
    bits of its shard) stays below the whole variable's 2 MiB."""
    import keras
    from jax.sharding import NamedSharding, PartitionSpec

    from meshfit.fit import sharded_init

    layout = NamedSharding(strategy.distribution.device_mesh.backend_mesh, PartitionSpec(None, "batch"))
    draw = sharded_init._compiled(keras.initializers.GlorotUniform, (), (1024, 512), "float32",
                                  layout, seeded=True)
    memory = draw.lower(np.array([3, 0], np.uint32)).compile().memory_analysis()
    whole = 1024 * 512 * 4
    assert memory.output_size_in_bytes == whole // 8
    assert memory.temp_size_in_bytes < whole // 2
    values = draw(np.array([3, 0], np.uint32))
    assert {s.data.shape for s in values.addressable_shards} == {(1024, 64)}


def test_rule_sizes_and_modes():
    assert sharding.shard_axis((512, 512), "float32", 8, 1 << 20) == 1  # tie: the trailing one
    assert sharding.shard_axis((1024, 24), "float32", 8, 1) == 0
    assert sharding.shard_axis((1001, 12), "float32", 8, 1) is None  # nothing divides by 8
    assert sharding.shard_axis((4096,), "int32", 8, 1) is None
    assert sharding.shard_axis((256, 256), "float32", 8, 1 << 20) is None  # under the threshold
    assert sharding.parse_size("48MB") == 48_000_000 and sharding.parse_size("1MiB") == 1 << 20
    for bad in ("12XB", "-1GB", "0"):
        with pytest.raises(MeshfitError, match="size|at least"):
            sharding.parse_size(bad)
    with pytest.raises(MeshfitError, match="unknown sharding 'zero'"):
        modes.check_sharding("zero")


def test_fsdp_x_model_splits_what_model_leaves_whole_over_both_axes():
    # On a 2 x 4 mesh (batch x model) under fsdp: 'model' takes a kernel's heads or wider side,
    # 'batch' the largest other dimension it divides; what 'model' leaves whole (a vector, one
    # key/value head) goes over all 8 devices where 8 divides a dimension.
    def spec(shape, sharding_="fsdp"):
        return modes.mode_named(sharding_).partition(shape, "float32", 2, 1, "batch", 4)

    assert spec((32, 128)) == ["batch", "model"]  # an up-projection
    assert spec((32, 4, 8)) == ["batch", "model", None]  # query heads
    assert spec((32, 2, 8)) == [("batch", "model"), None, None]  # 2 key/value heads: not over 4
    assert spec((32,)) == [("batch", "model")]  # a norm's scale
    assert spec((64, 3)) == [("model", "batch"), None]  # a classifier head: 3 divides by nothing
    assert spec((12,)) == ["batch"]  # 8 does not divide, 2 does
    assert spec((32,), "data") == [None] and spec((32, 2, 8), "data") == [None] * 3
    for shape in ((32, 128), (32, 2, 8), (32,), (64, 3), (12,)):  # every device holds as much
        held = sharding.bytes_per_device(shape, "float32", spec(shape), {"batch": 2, "model": 4})
        assert held * (8 if shape != (12,) else 2) == 4 * np.prod(shape)


def test_a_convolution_kernel_is_split_along_its_channels_never_its_window():
    # XLA's partitioner doubled a ViT patch embedding's gradient with its window split
    # (benchmarks/xla_conv_window_gradient.py): only the last two axes (in, out) are split.
    def spec(shape, batch=4, model=2):
        return modes.FSDP.partition(shape, "float32", batch, 1, "batch", model)

    assert spec((4, 4, 3, 32)) == [None, None, None, ("model", "batch")]  # keras-hub ViT's patches
    assert spec((16, 16, 3, 768)) == [None, None, None, ("model", "batch")]  # ViT-B/16's
    assert spec((3, 3, 64, 128)) == [None, None, "batch", "model"]
    assert spec((8, 8, 3, 6), 8, 1) == [None] * 4  # no channel divides: whole, not the window
    assert sharding.shard_axis((8, 8, 3, 6), "float32", 8, 1) is None
    assert sharding.shard_axis((8, 4, 32), "float32", 8, 1) == 2  # 3-D: every axis, as before


RECIPE = '''import numpy as np

import meshfit


def dataset(seed):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 296)
    x = np.clip(20 * labels[:, None, None, None] + rng.normal(0, 40, (296, 16, 16, 1)), 0, 255)
    return (x[:256].astype("uint8"), labels[:256]), (x[256:].astype("uint8"), labels[256:])


def build_model(input_shape, num_classes):
    import keras

    return keras.Sequential([keras.Input(input_shape), keras.layers.Rescaling(1 / 255),
                             keras.layers.Flatten(), keras.layers.Dense(512, activation="relu"),
                             keras.layers.Dense(512, activation="relu"),
                             keras.layers.Dense(num_classes, activation="softmax")])


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.Adam(1e-3)


RECIPE = meshfit.Recipe(name="wide", dataset=dataset, build_model=build_model,
                        optimizer=optimizer, epochs=1, global_batch=64)
'''
MEMORY = ["--device-memory", "4MB", "--fsdp-min-bytes", "100KB"]  # data needs ~8 MB, fsdp ~1.2 MB


@pytest.fixture(scope="module")
def wide_recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide") / "wide.py"
    path.write_text(RECIPE)
    return str(path)


def test_when_neither_mode_fits_plan_and_train_name_the_largest_batch_that_does(strategy, wide_recipe,
                                                                              capsys):
    """1 MB per device: the wide model fits neither replicated (8 MB) nor sharded (1.2 MB) at its
    batch of 64. plan says so and names the largest global batch that fits, train refuses in one
    line naming it, and at that batch the sharded step does fit."""
    from meshfit import cli

    small = ["--simulate-devices", "8", "--engine", "jax", "--device-memory", "1MB", "--fsdp-min-bytes", "100KB"]
    try:
        assert cli.main(["plan", wide_recipe, *small]) == 0
        using = capsys.readouterr().out.strip().splitlines()[-1]
        largest = int(re.search(r"the largest global batch that fits is (\d+) \(--global-batch \d+\)$", using)[1])
        assert "and sharded it needs 1.2 MB: neither fits" in using and 8 <= largest < 64
        assert using.startswith("  nothing fits: ")  # no mode claimed
        assert cli.main(["train", wide_recipe, *small, "--out", "unused"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("meshfit: error: out of device memory:")
        assert f"it does not fit replicated either (8.0 MB); use --global-batch {largest} or less" in err[0]
        assert cli.main(["plan", wide_recipe, *small, "--global-batch", str(largest), "--json"]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["modes"]["fsdp"]["fits"] is True and result["fits"] is True
    finally:
        connect_eight_devices()


def test_too_big_for_data_parallel_is_refused_then_trained_with_fsdp(strategy, wide_recipe, tmp_path,
                                                                      capsys):
    """In this process (the CLI's main on the same 8 devices): --sharding data is refused in one
    line (exit 2); plan reports both modes; the default trains fsdp, and its run evaluates,
    resumes from its sharded checkpoints (with its threshold), predicts and exports on the CPU."""
    from meshfit import cli
    from meshfit.serve import export, inference

    run = str(tmp_path / "run")
    devices = ["--simulate-devices", "8", "--engine", "jax"]
    try:
        assert cli.main(["train", wide_recipe, *devices, "--sharding", "data", "--out", run, *MEMORY]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("meshfit: error:"), err
        assert err[0].startswith("meshfit: error: out of device memory:")
        assert "per device with --sharding data" in err[0] and "a device has 4.0 MB of memory" in err[0]
        assert "--sharding fsdp" in err[0]
        assert cli.main(["plan", wide_recipe, *devices, "--json", *MEMORY]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["sharding"] == "fsdp" and result["device_memory"] == 4_000_000
        modes = result["modes"]
        assert modes["data"]["fits"] is False and modes["fsdp"]["fits"] is True
        assert modes["fsdp"]["weights"] * 4 < modes["data"]["weights"]
        assert modes["fsdp"]["largest_per_core_batch"] >= 8

        assert cli.main(["train", wide_recipe, *devices, "--out", run, "--no-tensorboard", *MEMORY]) == 0
        config = json.load(open(os.path.join(run, rundir.CONFIG)))
        metrics = json.load(open(os.path.join(run, rundir.METRICS)))
        assert config["sharding"] == metrics["sharding"] == "fsdp"
        assert cli.main(["train", "--resume", run, "--epochs", "2", "--no-tensorboard", *devices,
                         *MEMORY[:2]]) == 0  # its --fsdp-min-bytes kept
        metrics = json.load(open(os.path.join(run, rundir.METRICS)))
        assert metrics["sharding"] == "fsdp" and metrics["resumed"] and metrics["epochs"] == 2
        assert metrics["fsdp_min_bytes"] == 100_000
        assert cli.main(["eval", run, *devices, "--json"]) == 0
        scores = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert scores["samples"] == 40 and 0 <= scores["test_accuracy"] <= 1
    finally:
        connect_eight_devices()
    images = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 1)).astype("float32")
    probabilities = inference.load_predictor(run, backend="keras").predict(images)
    assert probabilities.shape == (3, 10) and np.allclose(probabilities.sum(axis=1), 1, atol=1e-4)
    assert os.path.isfile(export.export_keras(run, str(tmp_path / "served.keras")))


def test_old_config_without_sharding_reads_as_data():
    from meshfit.run.spec import RunSpec

    fields = {"recipe": "r", "dataset": "d", "class_names": ["a"], "input_shape": [1], "num_classes": 1,
              "epochs": 1, "steps_per_epoch": 1, "global_batch": 8, "steps_per_dispatch": 1,
              "micro_batches": 1, "seed": 0, "precision": "float32", "engine": "jax", "replicas": 8,
              "platform": "cpu", "device_kind": "cpu"}
    assert RunSpec.from_dict(fields).sharding == "data"


FSDP_784 = """
import itertools, json, sys, numpy as np, meshfit

def one_step(sharding, x, y):
    strategy = meshfit.connect(simulate_devices=8, engine="jax", sharding=sharding, fsdp_min_bytes=100_000,
                               verbose=False)
    import keras
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(1024, activation="relu"),
                                  keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    initial = [np.asarray(w, np.float64) for w in model.get_weights()]
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    return initial, model.get_weights()

def float64_step(w, x, y, flips=()):
    # The same SGD step in float64; `flips`: (layer, row, unit) ReLUs taken on their other side.
    h, pre, masks = x.astype(np.float64), [], []
    for layer in (0, 1):
        a = h @ w[2 * layer] + w[2 * layer + 1]
        mask = a > 0
        for flip in flips:
            if flip[0] == layer:
                mask[flip[1:]] = ~mask[flip[1:]]
        pre.append(a); masks.append(mask); h = a * mask
    z = h @ w[4] + w[5]
    p = np.exp(z - z.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
    dz = p.copy(); dz[np.arange(len(y)), y] -= 1; dz /= len(y)
    da2 = (dz @ w[4].T) * masks[1]; da1 = (da2 @ w[2].T) * masks[0]
    h1 = pre[0] * masks[0]
    grads = [x.astype(np.float64).T @ da1, da1.sum(0), h1.T @ da2, da2.sum(0), h.T @ dz, dz.sum(0)]
    return [a - 0.1 * g for a, g in zip(w, grads)], pre

distance = lambda a, b: max(float(np.abs(p - q).max()) for p, q in zip(a, b))
result = {}
for seed in map(int, sys.argv[1:]):
    x = np.random.default_rng(seed).random((64, 784)).astype("float32")
    y = np.random.default_rng(seed + 1).integers(0, 10, 64)
    initial, data = one_step("data", x, y)
    _, fsdp = one_step("fsdp", x, y)
    _, pre = float64_step(initial, x, y)
    # ReLUs whose side float32 rounding of their 784- or 1024-term sum can decide (|a| < 1e-6)
    open_ = [(layer, *map(int, i)) for layer, a in enumerate(pre) for i in zip(*np.nonzero(np.abs(a) < 1e-6))]
    steps = [float64_step(initial, x, y, flips)[0]
             for k in range(len(open_) + 1) for flips in itertools.combinations(open_, k)] if len(open_) <= 3 else []
    result[seed] = {"margin": min(float(np.abs(a).min()) for a in pre), "open": len(open_),
                    "fsdp_data": distance(fsdp, data),
                    "data_float64": min(distance(data, s) for s in steps) if steps else None,
                    "fsdp_float64": min(distance(fsdp, s) for s in steps) if steps else None}
print(json.dumps(result))
"""
WELL_POSED, ON_A_KINK = 7, 0  # input seeds: nearest pre-activation 2e-5 and 1.5e-7 from zero


def test_fsdp_steps_as_data_parallel_at_xlas_default_optimization():
    """A 784-1024-1024-10 MLP, one SGD step under fsdp and under data parallelism, in a process
    with XLA's default optimizations (the tests' own run at level 0), against a float64 NumPy step.

    On an input whose every ReLU is decided beyond float32 rounding (the margin is checked, so a
    change of Keras' initializers cannot make the comparison ill-posed unnoticed), fsdp's weights
    are data parallelism's. On an input with a pre-activation 1.5e-7 from zero, the two may take
    that ReLU on different sides (their sums run in different orders; which one depends on the CPU,
    XLA's version and its YNNPACK flags), and a flipped ReLU moves the step by 1e-4: there each must
    be the float64 step for one choice of that ReLU's side (docs/reference/relu-kink.md)."""
    out = subprocess.run([sys.executable, "-c", FSDP_784, str(WELL_POSED), str(ON_A_KINK)], capture_output=True,
                         text=True, timeout=600, env=environment({"XLA_FLAGS": "", "MESHFIT_SIMULATE_DEVICES": None}))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    well, kink = result[str(WELL_POSED)], result[str(ON_A_KINK)]
    assert well["margin"] > 1e-5 and well["open"] == 0, well
    assert well["fsdp_data"] < 1e-6, well
    assert well["data_float64"] < 1e-7 and well["fsdp_float64"] < 1e-7, well
    assert kink["margin"] < 1e-6 and 1 <= kink["open"] <= 3, kink
    assert kink["data_float64"] < 1e-7 and kink["fsdp_float64"] < 1e-7, kink


def test_plan_of_a_built_in_recipe_needs_no_data(strategy, tmp_path, monkeypatch, capsys):
    """`meshfit plan fashion-mnist-cnn` with no dataset anywhere: the model is built from the
    dataset's known shape and classes (its metric chosen from the class names), not its files."""
    from meshfit import cli

    monkeypatch.setenv("MESHFIT_OFFLINE", "1")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MESHFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MESHFIT_DATA", raising=False)
    try:
        assert cli.main(["plan", "fashion-mnist-cnn", "--simulate-devices", "8", "--json",
                         "--device-memory", "1GB"]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["recipe"] == "fashion-mnist-cnn" and result["modes"]["data"]["fits"] is True
    finally:
        connect_eight_devices()
