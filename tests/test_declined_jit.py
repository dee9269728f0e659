"""A model that Keras would run op by op only because one of its own layers declines XLA is
compiled on JAX (meshfit.fit.declined_jit): the same numbers as op by op, the layer's Python
called at tracing only; op by op where the user asked for it, where a layer of the user's own
declines, and (with one warning) where a layer does not trace."""

import warnings

import numpy as np
import pytest


def _data():
    rng = np.random.default_rng(0)
    return rng.random((96, 12, 12, 3), dtype=np.float32), np.arange(96) % 4


def _fit(strategy, first, jit_compile="auto"):
    """Losses, validation losses, evaluate's and predict's numbers of a small CNN whose first
    layers are `first()`'s (made after the seed is set: a layer draws its seed when made), and
    how often RandomRotation's Python ran (op by op: once a step)."""
    import keras

    calls = []
    rotation = keras.layers.RandomRotation
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((12, 12, 3)), *first(), keras.layers.RandomFlip(),
                                  keras.layers.Conv2D(4, 3), keras.layers.GlobalAveragePooling2D(),
                                  keras.layers.Dense(4)])
        model.compile(keras.optimizers.SGD(0.05),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit_compile)
    call = rotation.call

    def counted(self, *args, **kwargs):
        calls.append(1)
        return call(self, *args, **kwargs)

    x, y = _data()
    rotation.call = counted
    try:
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, validation_split=0.25)
        evaluated = model.evaluate(x, y, batch_size=16, verbose=0)
        predicted = model.predict(x[:5], verbose=0)
    finally:
        rotation.call = call
    return history.history, evaluated, predicted, len(calls)


def _rotation():
    import keras

    return [keras.layers.RandomRotation(0.1)]


def _crop_and_rotation():
    import keras

    return [keras.layers.RandomCrop(10, 10), keras.layers.RandomRotation(0.1)]


def test_keras_layers_that_decline_xla_are_compiled_with_the_same_numbers(strategy):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: it traces
        compiled, evaluated, predicted, calls = _fit(strategy, _rotation)
    eager, eager_evaluated, eager_predicted, eager_calls = _fit(strategy, _rotation, jit_compile=False)
    assert eager_calls >= 2 * 5 + 2 * 2 + 6 + 1  # op by op: each train, validation, test, predict step
    assert calls <= 8  # compiled: traced once per function and batch shape
    for name in ("loss", "val_loss"):
        np.testing.assert_allclose(compiled[name], eager[name], rtol=2e-5)
    np.testing.assert_allclose(evaluated, eager_evaluated, rtol=2e-5)
    np.testing.assert_allclose(predicted, eager_predicted, rtol=2e-5, atol=1e-6)


def test_a_layer_that_does_not_trace_runs_op_by_op_with_one_warning(strategy):
    """Keras 3.15's RandomCrop cutting a larger image slices with traced offsets: its training
    step runs op by op, as Keras would run it, and its evaluation (a centre crop) compiles."""
    import keras

    with pytest.warns(UserWarning) as caught:
        fallen, _, _, calls = _fit(strategy, _crop_and_rotation)
    lines = [str(w.message) for w in caught if "op by op" in str(w.message)]
    assert len(lines) == 1 and lines[0].startswith("RandomCrop declined XLA and this model's training step")
    assert "tf.data" in lines[0] and "\n" not in lines[0]
    eager, _, _, eager_calls = _fit(strategy, _crop_and_rotation, jit_compile=False)
    np.testing.assert_allclose(fallen["loss"], eager["loss"], rtol=2e-5)
    assert 2 * 5 <= calls < eager_calls  # training op by op, validation compiled


def test_op_by_op_stays_where_the_user_or_a_users_layer_chose_it(strategy):
    import keras

    class Eager(keras.layers.Layer):  # the user's own layer declining XLA: it may rely on Python
        def __init__(self):
            super().__init__()
            self.supports_jit = False

        def call(self, x):
            return x

    *_, calls = _fit(strategy, lambda: [Eager(), *_rotation()])
    assert calls >= 2 * 5  # each training step op by op
    *_, calls = _fit(strategy, _rotation, jit_compile=False)
    assert calls >= 2 * 5


def test_the_k_step_loop_leaves_such_a_model_to_keras_function(strategy):
    """meshfit train installs the on-device k-step loop (a resume mid-epoch, --steps-per-dispatch)
    whatever the model: one that Keras' own layers keep op by op gets Keras' function instead, so
    a layer that does not trace runs op by op with the warning, not an IndexError."""
    import keras

    from meshfit.fit import jax_loop

    with strategy.scope():
        model = keras.Sequential([keras.Input((12, 12, 3)), *_crop_and_rotation(),
                                  keras.layers.GlobalAveragePooling2D(),
                                  keras.layers.Dense(4)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    jax_loop.install(model, 2)
    assert model.train_function is None and model.steps_per_execution == 2
    x, y = _data()
    with pytest.warns(UserWarning, match="RandomCrop declined XLA"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
