"""Plain Keras after meshfit.connect() (meshfit.fit.hooks): every dispatch counted as progress
and fit/evaluate/predict under the stall guard, and what plain `fit` prints."""

import numpy as np
import pytest

from meshfit.parallel import heartbeat, stall


def tiny_model(strategy):
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_plain_fit_prints_the_epoch_report_after_connect(strategy, capsys):
    x = np.random.default_rng(0).normal(size=(100, 4)).astype("float32")
    y = np.arange(100) % 3
    model = tiny_model(strategy)
    model.fit(x, y, batch_size=32, epochs=2, verbose=2)  # outside the scope: connect() set it
    printed = capsys.readouterr().out
    assert "epoch 2/2  accuracy" in printed and "samples/s" in printed  # meshfit's line
    assert "4/4 - " in printed  # Keras' own line: 32+32+32+4, the last batch computed whole
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert "epoch 1/1" not in capsys.readouterr().out  # verbose=0 stays silent


def test_every_dispatch_is_progress_and_fit_evaluate_predict_are_guarded(strategy):
    import keras

    x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
    y = np.arange(40) % 3
    guarded = []

    class Guarded(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            guarded.append(("fit", stall._depth))

        def on_test_batch_end(self, batch, logs=None):
            guarded.append(("evaluate", stall._depth))

        def on_predict_batch_end(self, batch, logs=None):
            guarded.append(("predict", stall._depth))

    model = tiny_model(strategy)
    before = heartbeat.counts()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[Guarded()])  # 16, 16 and 8
    trained = heartbeat.counts()
    assert trained[0] - before[0] == 3 and trained[2] - before[2] == 3  # steps and dispatches
    model.evaluate(x, y, batch_size=16, verbose=0, callbacks=[Guarded()])
    model.predict(x[:21], batch_size=16, verbose=0, callbacks=[Guarded()])  # 16 and 5
    after = heartbeat.counts()
    assert after[0] == trained[0] and after[1] - trained[1] >= 3 + 2  # test and predict: reports
    assert {name for name, _ in guarded} == {"fit", "evaluate", "predict"}
    assert all(depth >= 1 for _, depth in guarded) and stall._depth == 0
    watched = []  # a custom loop's calls (no callbacks): the depth seen when each starts
    step = model.make_train_function
    model.train_function = None
    model.make_train_function = lambda *a, **k: watched.append(stall._depth) or step(*a, **k)
    model.train_on_batch(x[:16], y[:16])
    model.test_on_batch(x[:16], y[:16])
    model.predict_on_batch(x[:16])
    assert watched and watched[0] >= 1 and stall._depth == 0


def test_a_distribution_the_user_sets_after_connect_computes_every_sample(strategy):
    """keras.io's DataParallel guide sets its own distribution (here on 4 of the 8 devices):
    batches that do not split over its devices (a last batch of 6, predict on 3 rows) are
    computed whole on each, as under meshfit's own, instead of JAX's IndivisibleError."""
    import jax
    import keras

    x = np.random.default_rng(0).normal(size=(38, 4)).astype("float32")
    y = np.arange(38) % 3
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()[:4]))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # 16, 16 and 6
    assert np.isfinite(history.history["loss"][0])
    kernel, bias = (np.asarray(v.value) for v in model.weights)
    expected = keras.ops.convert_to_numpy(keras.activations.softmax(x[:3] @ kernel + bias))
    np.testing.assert_allclose(model.predict(x[:3], verbose=0), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_a_device_out_of_memory_in_plain_keras_is_jaxs_error_with_a_note_on_the_fixes(strategy, method):
    """XLA's RESOURCE_EXHAUSTED (raised here by a callback, as JAX raises it from a step) reaches
    the user as it is, its type and text unchanged, with one note naming meshfit's fixes."""
    import keras

    class OutOfMemory(keras.callbacks.Callback):
        def _raise(self, batch, logs=None):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 64 bytes.")

        on_train_batch_begin = on_test_batch_begin = on_predict_batch_begin = _raise

    x = np.zeros((16, 4), "float32")
    y = np.zeros(16, "int32")
    model = tiny_model(strategy)
    arguments = (x,) if method == "predict" else (x, y)
    with pytest.raises(RuntimeError, match="^RESOURCE_EXHAUSTED: Out of memory") as caught:
        getattr(model, method)(*arguments, batch_size=8, verbose=0, callbacks=[OutOfMemory()])
    (note,) = caught.value.__notes__
    assert "micro_batches=K" in note and "sharding='fsdp'" in note and "\n" not in note, note
    with pytest.raises(ValueError) as other:  # any other error: no note
        model.fit(x, np.zeros(15, "int32"), verbose=0)
    assert not getattr(other.value, "__notes__", None)


def test_a_recompiled_model_keeps_its_add_loss_term_with_the_report(strategy, capsys):
    """keras-io's subclassing guide: compile with a loss, fit, compile without one, fit again.
    The epoch report's FLOP count once traced the step with labels the loss rejected, and the
    failed trace made Keras drop the layer's add_loss term from the next fit and evaluate."""
    import keras

    class ActivityRegularization(keras.layers.Layer):
        def call(self, inputs):
            self.add_loss(0.01 * keras.ops.sum(inputs))
            return inputs

    x, y = np.ones((16, 3), "float32"), np.zeros((16, 3), "float32")
    expected = 1.0 + 0.01 * x.sum()  # mse 1 (compile keeps the first loss) + the add_loss term
    with strategy.scope():
        inputs = keras.Input((3,))
        model = keras.Model(inputs, ActivityRegularization()(inputs))
        model.compile(optimizer="adam", loss="mse")
    first = model.fit(x, y, batch_size=16, verbose=2)  # the report: one line per epoch
    with strategy.scope():
        model.compile(optimizer="adam")
    second = model.fit(x, y, batch_size=16, verbose=2)
    assert first.history["loss"][0] == pytest.approx(expected)
    assert second.history["loss"][0] == pytest.approx(expected)
    assert model.evaluate(x, y, batch_size=16, verbose=0) == pytest.approx(expected)
    assert "MFU n/a" not in capsys.readouterr().out  # labels shaped like the outputs: FLOPs known


def test_a_dtype_policy_the_user_sets_wins_over_precision_auto_not_over_one_asked(
        strategy, capsys, monkeypatch):
    """Tutorial 3 sets `mixed_bfloat16` itself: under precision 'auto' (float32 on the CPU) the
    scope keeps it, and the strategy reports it, as does connect() run again and a scope after
    clear_session(); a precision given to connect() wins over it."""
    import keras

    import meshfit
    from meshfit.fit import strategy as strategy_module

    monkeypatch.setattr(strategy_module, "_users_policy", None)  # this test's, not the next's
    try:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        model = tiny_model(strategy)
        assert model.layers[0].dtype_policy.name == "mixed_bfloat16"
        assert strategy.precision == "bfloat16" and "bfloat16" in strategy.report()
        model.fit(np.zeros((16, 4), "float32"), np.zeros(16, "int32"), batch_size=8, verbose=2)
        assert "epoch 1/1" in capsys.readouterr().out
        again = meshfit.connect(simulate_devices=8, engine="jax", verbose=False)
        keras.backend.clear_session()  # Keras' policy back to float32: not the user's choice
        assert again.precision == "bfloat16"
        assert tiny_model(again).layers[0].dtype_policy.name == "mixed_bfloat16"
        asked = meshfit.connect(simulate_devices=8, engine="jax", verbose=False, precision="float32")
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        assert tiny_model(asked).layers[0].dtype_policy.name == "float32"
        assert keras.config.dtype_policy().name == "mixed_bfloat16"  # the scope restores the user's
    finally:
        strategy_module.set_dtype_policy("float32")


def test_clear_session_keeps_the_precision_auto_chose(strategy, monkeypatch):
    """keras.backend.clear_session() resets Keras' policy to float32 (meshfit's own runs call it
    before building): a strategy whose 'auto' chose bfloat16 (an accelerator's) keeps it."""
    import keras

    from meshfit.fit import strategy as strategy_module

    monkeypatch.setattr(strategy_module, "_users_policy", None)
    chosen = strategy_module.Strategy(strategy.info, "jax", "bfloat16", precision_auto=True)
    try:
        chosen.activate()
        keras.backend.clear_session()
        assert tiny_model(chosen).layers[0].dtype_policy.name == "mixed_bfloat16"
        assert chosen.precision == "bfloat16"
    finally:
        strategy_module.set_dtype_policy("float32")


def test_float32_set_after_a_mixed_policy_is_the_users_choice(strategy, monkeypatch):
    """As in plain Keras, a model after `set_global_policy("float32")` is float32 with its own
    optimizer, though an earlier one was mixed_float16 (meshfit kept mixed_float16 before, and
    compile wrapped the optimizer in a LossScaleOptimizer)."""
    import keras

    from meshfit.fit import strategy as strategy_module

    monkeypatch.setattr(strategy_module, "_users_policy", None)
    try:
        keras.mixed_precision.set_global_policy("mixed_float16")
        assert tiny_model(strategy).layers[0].dtype_policy.name == "mixed_float16"
        keras.mixed_precision.set_global_policy("float32")
        model = tiny_model(strategy)
        assert model.layers[0].dtype_policy.name == "float32"
        assert type(model.optimizer).__name__ == "SGD" and strategy.precision == "float32"
    finally:
        strategy_module.set_dtype_policy("float32")


def test_clear_session_keeps_the_strategys_devices_and_precision(strategy):
    """A hyperparameter loop calls keras.backend.clear_session() between trials, often inside the
    scope: Keras drops every global setting there, and the next model was built on one device,
    in float32, silently. Both aliases Keras exports (keras.backend, keras.utils)."""
    import keras

    import meshfit

    bf16 = meshfit.connect(simulate_devices=8, engine="jax", precision="bfloat16", verbose=False)
    try:
        with bf16.scope():
            for clear in (keras.backend.clear_session, keras.utils.clear_session):
                clear()
                model = tiny_model(bf16)
                assert len(model.weights[0].value.sharding.device_set) == 8
                assert keras.config.dtype_policy().name == "mixed_bfloat16"
        keras.backend.clear_session(free_memory=False)  # outside the scope: connect()'s settings
        assert keras.distribution.distribution() is not None
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
    finally:
        strategy.activate()


def test_fit_takes_a_callback_list_as_keras_does(strategy):
    import keras

    x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
    model = tiny_model(strategy)
    history = keras.callbacks.History()
    given = keras.callbacks.CallbackList([history], add_history=False, model=model)
    model.fit(x, np.arange(40) % 3, batch_size=8, epochs=2, verbose=0, callbacks=given)
    assert len(history.history["loss"]) == 2


def test_sparse_inputs_train_as_their_dense_values_do(strategy):
    """keras.Input(sparse=True) fed a scipy.sparse matrix or a tf.SparseTensor: each sparse batch
    is placed whole on every device (Keras' placement shards its values and indices by the
    batch's layout and fails with JAX's ValueError, also under its own DataParallel), so the
    numbers are those of the same values dense."""
    import keras
    import scipy.sparse
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = ((rng.random((40, 10)) > 0.7) * rng.random((40, 10))).astype("float32")
    y = rng.random((40, 1)).astype("float32")

    def trained(sparse, data):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            inputs = keras.Input((10,), sparse=sparse)
            model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
            model.compile("sgd", "mse")
        losses = model.fit(data, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history["loss"]
        return losses, model.evaluate(data, y, batch_size=16, verbose=0)

    dense = trained(False, x)
    sparse = trained(True, scipy.sparse.csr_matrix(x))
    np.testing.assert_allclose(sparse[0], dense[0], rtol=1e-5)
    np.testing.assert_allclose(sparse[1], dense[1], rtol=1e-5)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((10,), sparse=True)
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile("sgd", "mse")
    stored = np.argwhere(x != 0)
    batches = tf.data.Dataset.from_tensor_slices((tf.SparseTensor(stored, x[x != 0], x.shape), y)).batch(16)
    np.testing.assert_allclose(model.fit(batches, epochs=2, verbose=0, shuffle=False).history["loss"],
                               dense[0], rtol=1e-5)
