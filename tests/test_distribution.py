"""Data parallelism (meshfit.fit.strategy): replicated weights, sharded batches, the global batch,
mixed precision and Strategy.fit."""

import dataclasses
import warnings

import numpy as np
import pytest
from helpers import compiled_cnn, random_images

import meshfit
from meshfit.parallel import planning
from meshfit.fit.strategy import Strategy
from meshfit.recipes import fashion_mnist_cnn


def train_weights(strategy, x, y, batch, steps):
    import keras

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = fashion_mnist_cnn.build_model()
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
        model.fit(x[: batch * steps], y[: batch * steps], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return [np.asarray(v) for v in model.get_weights()]


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
    for a, b in zip(w1, w8):  # rounding apart: the sums over the batch are split differently
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


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


def test_fit_uses_every_sample_when_the_last_batch_cannot_split(strategy):
    x, y = random_images(1001, seed=2)
    model = compiled_cnn(strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a short last batch (1001 = 15 x 64 + 41) needs no warning
        history = strategy.fit(model, x, y, batch_size=64, epochs=1, validation_data=(x[:99], y[:99]))
    loss = model.evaluate(x[:99], y[:99], batch_size=64, verbose=0)  # 64 + 35: all 99 scored
    np.testing.assert_allclose(loss, history.history["val_loss"][0], rtol=1e-5)
    assert model.predict(x[:3], verbose=0).shape == (3, 10)
