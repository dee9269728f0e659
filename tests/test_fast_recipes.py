"""Record-speed recipes: cifar10-fast (whitening, schedule, TTA, training) and resnet50-synthetic."""

import dataclasses
import json

import numpy as np
import pytest
from helpers import connect_eight_devices

from meshfit import recipes
from meshfit.data.splits import RunData
from meshfit.fit.strategy import Strategy
from meshfit.recipes import cifar10_fast, resnet50_synthetic

SMALL_WIDTHS = (16, 32, 32)


@pytest.fixture(scope="module")
def images():
    """Smooth, correlated 32x32 RGB images (like photos) with some pixel noise, uint8."""
    rng = np.random.default_rng(0)
    coarse = rng.uniform(0, 255, (512, 8, 8, 3))
    smooth = coarse.repeat(4, axis=1).repeat(4, axis=2)
    smooth = 0.6 * smooth + 0.4 * smooth.mean(axis=-1, keepdims=True)  # correlated channels
    return np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype("uint8")


@pytest.fixture(scope="module")
def prepared(images):
    """A small-width cifar10-fast model in mixed bfloat16, whitening set from `images`."""
    strategy = connect_eight_devices()  # conftest's strategy fixture is made for each test
    mixed = Strategy(strategy.info, "jax", "bfloat16")
    try:
        with mixed.scope():
            model = cifar10_fast.build_model(widths=SMALL_WIDTHS)
        cifar10_fast.prepare(model, dataset_of(images))
    finally:
        strategy.activate()
    return model


def dataset_of(x_train, y_train=None):
    """The splits as training hands them to a recipe's prepare()."""
    labels = np.zeros(len(x_train), "int32") if y_train is None else y_train
    return RunData("generated", tuple("0123456789"), x_train.shape[1:], (x_train, labels), None,
                   (x_train[:8], labels[:8]))


def numpy(tensor):
    from keras import ops

    return np.asarray(ops.convert_to_numpy(tensor))


def test_recipes_are_registered_with_their_hooks():
    fast = recipes.get("cifar10-fast")
    assert (fast.dataset, fast.global_batch, fast.augment) == ("cifar10", 1024, "flip-crop")
    assert fast.tta_flip and fast.prepare is cifar10_fast.prepare and callable(fast.loss)
    assert fast.precision == "bfloat16" and "BENCHMARKS.md" in fast.doc
    assert (fast.crop_padding, fast.flips) == (2, "alternate")
    resnet = recipes.get("resnet50-synthetic")
    assert (resnet.dataset, resnet.input_shape, resnet.per_core_batch) == ("synthetic", (224, 224, 3), 256)


def test_cifar10_fast_model_frozen_whitening_identity_filters_float32_norms(prepared):
    from keras import layers

    whiten = prepared.get_layer("whiten")
    assert not whiten.kernel.trainable and whiten.bias.trainable
    assert whiten.kernel.path not in [v.path for v in prepared.trainable_variables]
    assert whiten.kernel.shape == (2, 2, 3, 24) and whiten.compute_dtype == "bfloat16"
    convs = [l for l in prepared.layers if isinstance(l, layers.Conv2D)]
    assert [l.filters for l in convs[1:]] == [16, 16, 32, 32, 32, 32]
    first = numpy(convs[1].kernel)  # the first 3x3 conv: its first 16 filters are identities
    np.testing.assert_array_equal(first[1, 1, :16, :16], np.eye(16))
    assert np.count_nonzero(first[..., :16]) == 16 and np.count_nonzero(first[..., 16:]) == 0
    norms = [l for l in prepared.layers if isinstance(l, layers.BatchNormalization)]
    assert len(norms) == 6 and all(v.dtype == "float32" for l in norms for v in l.weights)
    probabilities = prepared.predict(np.zeros((8, 32, 32, 3), "uint8"), verbose=0)
    assert probabilities.dtype == np.float32 and probabilities.shape == (8, 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)


def test_whitening_makes_patch_covariance_the_identity(prepared, images):
    import keras

    kernel = numpy(prepared.get_layer("whiten").kernel)
    np.testing.assert_allclose(kernel, cifar10_fast.whitening_kernel(images), rtol=1e-6)
    np.testing.assert_array_equal(kernel[..., 12:], -kernel[..., :12])
    # Top-left 2x2 patch of each normalized image, in the conv kernel's (row, column, channel) order.
    normalized = (images.astype("float64") - cifar10_fast.CIFAR_MEAN) / cifar10_fast.CIFAR_STD
    patches = normalized[:, :2, :2].reshape(len(images), 12)
    assert np.corrcoef(patches.T)[0, 3] > 0.5  # neighbouring pixels are correlated before
    filters = kernel.reshape(12, 24)[:, :12]
    assert np.linalg.norm(filters[:, 0]) < np.linalg.norm(filters[:, -1])  # largest eigenvalue first

    whitened = keras.Model(prepared.inputs, prepared.get_layer("whiten").output)
    out = numpy(whitened(images[:128].astype("float32"))).astype("float64")[..., :12].reshape(-1, 12)
    np.testing.assert_allclose(out.T @ out / len(out), np.eye(12), atol=0.1)  # and white after


def test_tta_flip_evaluation_averages_each_image_with_its_mirror(prepared, images):
    from meshfit.fit.predict import predict

    x = images[:16]
    plain = prepared.predict(x, batch_size=16, verbose=0)
    mirrored = prepared.predict(x[:, :, ::-1], batch_size=16, verbose=0)
    assert np.abs(plain - mirrored).max() > 1e-3  # the model itself is not mirror-symmetric
    tta = predict(prepared, x, global_batch=16, tta_flip=recipes.get("cifar10-fast").tta_flip)
    np.testing.assert_allclose(tta, (plain + mirrored) / 2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(predict(prepared, x[:, :, ::-1], global_batch=16, tta_flip=True), tta,
                               rtol=1e-5, atol=1e-7)


def test_multi_crop_tta_averages_the_mirrors_and_one_pixel_translations(prepared, images):
    """airbench's multi-crop: half on the image and its mirror, a quarter on each translation by
    one pixel (down-right, up-left; reflect-padded), each with its mirror; on the device as on
    the host."""
    from meshfit.data.arrays import EvalBatches
    from meshfit.fit.predict import predict

    x = images[:16]
    assert recipes.get("cifar10-fast").tta_translate == 1

    def both(view):
        return (prepared.predict(view, batch_size=16, verbose=0)
                + prepared.predict(view[:, :, ::-1], batch_size=16, verbose=0)) / 2

    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="reflect")
    down_right, up_left = padded[:, :32, :32], padded[:, 2:, 2:]
    assert np.array_equal(down_right[:, 1:, 1:], x[:, :-1, :-1]) and np.array_equal(up_left[:, :-1, :-1], x[:, 1:, 1:])
    expected = both(x) / 2 + both(down_right) / 4 + both(up_left) / 4
    assert np.abs(expected - both(x)).max() > 1e-4  # the translations count
    for on_device in (False, True):
        batches = EvalBatches(x, 16, on_device=on_device)
        tta = predict(prepared, batches, tta_flip=True, tta_translate=1)
        np.testing.assert_allclose(tta, expected, rtol=1e-4, atol=1e-6)


def test_lookahead_moves_the_weights_to_their_slow_copy_every_k_steps(strategy):
    """airbench's lookahead in cifar10-fast's optimizer, against the same arithmetic in NumPy:
    every 2nd step slow <- slow + (1 - decay)(w - slow), w <- slow, decay = 0.95^5 (t/T)^3;
    after the last step w <- slow."""
    import keras

    total, every, rate = 7, 3, 0.1
    sgd = cifar10_fast.keras_classes().BiasScaledSGD(learning_rate=rate, momentum=0.0,
                                                      lookahead_every=every, total_steps=total)
    kernel = keras.Variable(np.array([1.0, -2.0], "float32"), name="kernel")
    gradients = np.random.default_rng(0).normal(size=(total, 2)).astype("float32")
    w = np.array([1.0, -2.0])
    slow = w.copy()  # the weights it starts from
    for t, gradient in enumerate(gradients, start=1):
        sgd.apply([gradient], [kernel])
        w = w - rate * gradient
        if t % every == 0 or t == total:
            decay = 1.0 if t == total else 0.95 ** 5 * (t / total) ** 3
            slow = slow + (1 - decay) * (w - slow)
            w = slow.copy()
        np.testing.assert_allclose(numpy(kernel), w, rtol=1e-5, atol=1e-6)
    assert cifar10_fast.optimizer(10, 14).get_config()["lookahead_every"] == cifar10_fast.LOOKAHEAD_EVERY


def test_schedule_and_fast_batch_norm_biases(strategy):
    import keras

    peak = cifar10_fast.PEAK_LEARNING_RATE
    schedule = cifar10_fast.keras_classes().TriangleSchedule(peak, total_steps=100)
    values = [float(schedule(step)) for step in (0, 23, 60, 100, 120)]
    expected = [0.2 * peak, peak, peak * (1 - 0.93 * 37 / 77), 0.07 * peak, 0.07 * peak]
    np.testing.assert_allclose(values, expected, rtol=1e-5)
    optimizer = cifar10_fast.optimizer(steps_per_epoch=10, epochs=10)
    assert optimizer.nesterov and optimizer.momentum == cifar10_fast.MOMENTUM
    np.testing.assert_allclose(float(optimizer.learning_rate), 0.2 * peak, rtol=1e-5)

    sgd = cifar10_fast.keras_classes().BiasScaledSGD(learning_rate=0.01)
    beta, kernel = keras.Variable(np.zeros(3), name="beta"), keras.Variable(np.zeros(3), name="kernel")
    sgd.apply([np.ones(3), np.ones(3)], [beta, kernel])
    np.testing.assert_allclose(numpy(beta), -0.64, rtol=1e-5)
    np.testing.assert_allclose(numpy(kernel), -0.01, rtol=1e-5)


def test_cifar10_fast_learns_a_small_task_and_saves(strategy, images, tmp_path):
    import keras

    keras.utils.set_random_seed(0)
    labels = np.random.default_rng(1).integers(0, 4, len(images)).astype("int32")
    x = np.clip(images * 0.5 + labels[:, None, None, None] * 40, 0, 255).astype("uint8")  # brightness
    with strategy.scope():
        model = cifar10_fast.build_model(widths=SMALL_WIDTHS, num_classes=4)
        cifar10_fast.prepare(model, dataset_of(x, labels))
        model.compile(optimizer=cifar10_fast.optimizer(steps_per_epoch=4, epochs=4),
                      loss=cifar10_fast.loss(), metrics=["accuracy"])
    history = model.fit(x, labels, batch_size=128, epochs=4, verbose=0).history
    assert history["loss"][-1] < 0.75 * history["loss"][0]
    assert history["accuracy"][-1] > 0.8
    # Inference uses the batch-norm moving averages. After 16 steps at the recipe's high learning
    # rates they trail the weights: inference predicted one or two classes (accuracy 0.27 or 0.50,
    # by the CPU's rounding). Forward passes in training mode change only the averages: 16 bring
    # them to the final weights' statistics (momentum 0.6, 0.6^16 of the old ones left). One
    # jitted function: 16 eager calls on 8 devices took 40 of the test's 85 s on a loaded 2-core VM.
    set_moving_averages(model, [x[start:start + 128] for start in range(0, len(x), 128)] * 4)
    assert model.evaluate(x, labels, batch_size=128, verbose=0, return_dict=True)["accuracy"] > 0.6

    path = str(tmp_path / "model.keras")
    model.save(path)
    assert "meshfit" not in json.dumps(model.get_config())  # compile=False loads need no meshfit
    restored = keras.saving.load_model(path)  # compiled: the recipe's classes are registered
    assert restored.optimizer.bias_scale == cifar10_fast.BIAS_LEARNING_RATE_SCALE
    assert restored.loss.label_smoothing == cifar10_fast.LABEL_SMOOTHING
    np.testing.assert_allclose(restored.predict(x[:16], verbose=0), model.predict(x[:16], verbose=0),
                               rtol=1e-4, atol=1e-6)


def set_moving_averages(model, batches) -> None:
    """Run `model` in training mode over `batches` (one compiled program), keeping only what
    that changes: the non-trainable variables (batch-norm moving averages)."""
    import jax

    @jax.jit
    def forward(trainable, non_trainable, batches):
        for x in batches:
            _, non_trainable = model.stateless_call(trainable, non_trainable, x.astype("float32"),
                                                    training=True)
        return non_trainable

    values = forward([v.value for v in model.trainable_variables],
                     [v.value for v in model.non_trainable_variables], batches)
    for variable, value in zip(model.non_trainable_variables, values, strict=True):
        variable.assign(value)


def test_train_step_flops_for_full_cifar10_fast_in_bfloat16(strategy):
    from meshfit.watch.keras_side.report import train_step_flops

    mixed = Strategy(strategy.info, "jax", "bfloat16")
    try:
        with mixed.scope():
            model = cifar10_fast.build_model()
            model.compile(optimizer=cifar10_fast.optimizer(10, 1), loss=cifar10_fast.loss())
        flops = train_step_flops(model, 64)
    finally:
        strategy.activate()
    # Forward multiply-adds per image: whitening conv, then the two 3x3 convs of each block.
    macs = (31 * 31 * 4 * 3 * 24 + 31 * 31 * 9 * 24 * 64 + 15 * 15 * 9 * 64 * 64
            + 15 * 15 * 9 * 64 * 256 + 7 * 7 * 9 * 256 * 256 + 7 * 7 * 9 * 256 * 256 + 3 * 3 * 9 * 256 * 256)
    forward = 2 * macs * 64
    assert 2 * forward < flops < 6 * forward


@pytest.mark.slow
def test_resnet50_small_input_counts_flops_and_trains_one_step(strategy):
    from meshfit.watch.keras_side.report import train_step_flops

    # One device: the step needs no data parallelism (test_distribution covers it) and compiles faster.
    one = Strategy(dataclasses.replace(strategy.info, devices=strategy.info.devices[:1], devices_per_host=1),
                   "jax", "float32")
    try:
        with one.scope():
            model = resnet50_synthetic.build_model((32, 32, 3), num_classes=10)
            model.compile(optimizer=resnet50_synthetic.optimizer(1, 1),
                          loss=recipes.get("resnet50-synthetic").loss)
            assert model.output_shape == (None, 10) and model.count_params() > 23_000_000
            # ResNet-50 v1: ~3.9e9 multiply-adds per 224x224 image forward; 32x32 is (32/224)^2 of it.
            forward = 2 * 3.9e9 * (32 / 224) ** 2 * 8
            assert 2 * forward < train_step_flops(model, 8) < 6 * forward
            rng = np.random.default_rng(0)
            x, y = rng.integers(0, 256, (8, 32, 32, 3)).astype("float32"), rng.integers(0, 10, 8)
            kernel = model.trainable_variables[0]
            before = numpy(kernel)
            assert np.isfinite(model.train_on_batch(x, y))
            assert np.abs(numpy(kernel) - before).max() > 0
    finally:
        strategy.activate()
