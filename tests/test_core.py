"""Core: discovery, data parallelism, precision, batch planning, the report and the CLI errors."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import meshfit
from meshfit import planning
from meshfit.distribution import Strategy
from meshfit.recipes import fashion_mnist_cnn


@pytest.fixture(scope="module")
def strategy():
    return meshfit.connect(simulate=8, engine="jax", verbose=False)


def run_cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "meshfit", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def random_images(n, seed):
    """n random 28x28 grey images and labels of 10 classes."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28, 1)).astype("uint8"), rng.integers(0, 10, n)


def compiled_cnn(strategy, metrics=()):
    """The tutorial Fashion-MNIST CNN, built and compiled in `strategy`'s scope."""
    with strategy.scope():
        model = fashion_mnist_cnn.build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=list(metrics))
    return model


def train_weights(strategy, x, y, batch, steps):
    import keras

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = fashion_mnist_cnn.build_model()
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    model.fit(x[: batch * steps], y[: batch * steps], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return [np.asarray(v) for v in model.get_weights()]


def test_connect_finds_eight_simulated_devices(strategy):
    assert strategy.replicas == 8
    assert strategy.platform == "cpu"
    assert strategy.precision == "float32"
    assert strategy.describe()["simulated"] is True


def test_eight_devices_give_the_same_weights_as_one(strategy):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (256, 28, 28, 1)).astype("uint8")
    y = rng.integers(0, 10, 256)
    one = Strategy(dataclasses.replace(strategy.info, devices=strategy.info.devices[:1], devices_per_host=1),
                   "jax", "float32")
    assert one.replicas == 1
    w1 = train_weights(one, x, y, batch=64, steps=4)
    w8 = train_weights(strategy, x, y, batch=64, steps=4)
    strategy.activate()
    assert any(np.abs(a).sum() > 0 for a in w8)
    for a, b in zip(w1, w8):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_weights_are_replicated_and_batches_sharded(strategy):
    import keras

    with strategy.scope():
        model = fashion_mnist_cnn.build_model()
    kernel = model.trainable_variables[0].value
    assert len(kernel.sharding.device_set) == 8
    assert kernel.sharding.is_fully_replicated
    batch = keras.distribution.distribute_tensor(np.zeros((16, 28, 28, 1), "float32"),
                                                 keras.distribution.distribution().get_data_layout((16, 28, 28, 1)))
    assert {s.data.shape[0] for s in batch.addressable_shards} == {2}


def test_global_batch_rounds_to_the_hardware_multiple(strategy):
    assert strategy.global_batch(100) == 800
    tpu = Strategy(dataclasses.replace(strategy.info, platform="tpu", device_kind="TPU v4", devices=()),
                   "tensorflow", "bfloat16")  # engine other than jax: no real devices needed
    assert tpu.per_core_multiple == 128
    with pytest.warns(UserWarning, match="rounded to 128"):
        assert tpu.global_batch(100) == 128
    with pytest.raises(meshfit.MeshfitError, match="multiple of 128"):
        tpu.global_batch(100, rounding=False)
    assert planning.batch_multiple("tpu", "TPU v6 lite") == 256
    assert planning.batch_multiple("gpu", "NVIDIA H100 80GB HBM3") == 8


def test_global_batch_must_split_across_replicas(strategy):
    assert strategy.check_batch(96) == 96
    with pytest.warns(UserWarning, match="rounded up to 104"):
        assert strategy.check_batch(100) == 104
    with pytest.raises(meshfit.MeshfitError, match="does not split evenly across 8 replicas"):
        strategy.check_batch(100, rounding=False)


def test_precision_auto_and_forced():
    assert planning.resolve_precision("auto", "tpu") == "bfloat16"
    assert planning.resolve_precision("auto", "gpu", "9.0") == "bfloat16"
    assert planning.resolve_precision("auto", "gpu", "7.0") == "float16"
    assert planning.resolve_precision("auto", "cpu") == "float32"
    assert planning.resolve_precision("bf16", "cpu") == "bfloat16"
    with pytest.raises(meshfit.MeshfitError, match="unknown precision 'fp8x'.*float32, bfloat16, float16"):
        planning.resolve_precision("fp8x", "cpu")


def test_mixed_bfloat16_keeps_float32_variables(strategy):
    import keras

    mixed = Strategy(strategy.info, "jax", "bfloat16")
    try:
        with mixed.scope():
            model = fashion_mnist_cnn.build_model()
        dense = model.get_layer(index=5)
        assert dense.kernel.dtype == "float32"
        assert dense.compute_dtype == "bfloat16"
        hidden = keras.Model(model.inputs, dense.output)(np.zeros((8, 28, 28, 1), "float32"))
        assert str(hidden.dtype) == "bfloat16"
        assert str(model(np.zeros((8, 28, 28, 1), "float32")).dtype) == "float32"
    finally:
        strategy.activate()


def test_peak_flops_known_for_accelerators_and_not_cpus():
    assert planning.peak_flops("gpu", "NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert planning.peak_flops("tpu", "TPU v4", "bfloat16") == 275e12
    assert planning.peak_flops("cpu", "AMD EPYC 7B13", "float32") is None


def test_epoch_line_reports_throughput_and_compile_apart(strategy, capsys):
    x, y = random_images(512, seed=1)
    model = compiled_cnn(strategy, metrics=["accuracy"])
    strategy.fit(model, x, y, batch_size=64, epochs=2, validation_data=(x[:128], y[:128]))
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("epoch ")]
    assert len(lines) == 2
    assert "samples/s" in lines[0] and "ms/step" in lines[0] and "compile" in lines[0]
    assert "compile" not in lines[1]
    assert "MFU n/a" in lines[0]  # CPU: no published peak, so no invented MFU


def test_fit_trims_a_last_batch_that_cannot_split(strategy, capsys):
    x, y = random_images(1001, seed=2)
    model = compiled_cnn(strategy)
    with pytest.warns(UserWarning, match="dropping the last 1 of 1001 samples"):
        strategy.fit(model, x, y, batch_size=64, epochs=1, validation_data=(x[:99], y[:99]))
    assert len(model.history.history["val_loss"]) == 1


def test_train_step_flops_come_from_xla(strategy):
    from meshfit.report import train_step_flops

    flops = train_step_flops(compiled_cnn(strategy), 64)
    # Conv 26*26*64*9*2 FLOPs forward per image; backward roughly doubles it twice.
    forward_conv = 26 * 26 * 64 * 9 * 2 * 64
    assert 2 * forward_conv < flops < 10 * forward_conv


def test_cli_info_json_reports_eight_replicas():
    out = run_cli("info", "--simulate-devices", "8", "--json", env={"XLA_FLAGS": ""})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["replicas"] == 8 and info["platform"] == "cpu"


@pytest.mark.parametrize("args, message", [
    (["info", "--precision", "fp8x"], "unknown precision 'fp8x'"),
    (["info", "--simulate-devices", "0"], "at least 1"),
    (["info", "--require", "tpu"], "no TPU found"),
])
def test_cli_bad_input_is_one_line(args, message):
    out = run_cli(*args, env={"XLA_FLAGS": ""})
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and message in out.stderr
    assert "Traceback" not in out.stderr


def test_simulate_after_jax_started_is_a_clear_error(strategy):
    with pytest.raises(meshfit.MeshfitError, match="JAX already started with 8 cpu device"):
        meshfit.connect(simulate=4, verbose=False)


def test_engine_switch_too_late_is_a_clear_error(strategy):
    with pytest.raises(meshfit.MeshfitError, match="too late to switch to engine tensorflow"):
        meshfit.connect(engine="tensorflow", verbose=False)
