"""The on-device multi-step loop (meshfit.fit.jax_loop): k steps in one dispatch, trained like Keras."""

import dataclasses
import io

import numpy as np
import pytest

import meshfit
from meshfit.fit import jax_loop
from meshfit.parallel import planning
from meshfit.fit.strategy import Strategy


def small_model(strategy, steps_per_execution=1):
    """A tiny CNN with BatchNorm (non-trainable updates) and Dropout (random state)."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8, 8, 1)), layers.Rescaling(1 / 255), layers.Conv2D(4, 3, activation="relu"),
            layers.BatchNormalization(), layers.Dropout(0.3), layers.Flatten(), layers.Dense(10),
            layers.Activation("softmax", dtype="float32")])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=steps_per_execution)
    return model


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 8, 8, 1)).astype("uint8"), rng.integers(0, 10, n).astype("int32")


def weights(model):
    return [np.asarray(w) for w in model.get_weights()]


def test_k_steps_in_one_dispatch_equal_k_keras_steps(strategy):
    import jax

    x, y = data(4 * 16)
    keras_model = small_model(strategy)
    keras_model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)

    model = small_model(strategy)
    batches = [(x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16]) for i in range(4)]
    state = jax_loop.training_state(model, batches[0])
    run = jax_loop.make_multi_step(model, 4, jax.tree.map(lambda a: a.sharding, state))
    logs, state = run(state, batches)
    jax_loop.set_training_state(model, state)
    assert state[0][0].sharding.is_fully_replicated and len(state[0][0].sharding.device_set) == 8
    assert float(logs["loss"]) > 0
    moved = [np.abs(a - b).max() for a, b in zip(weights(keras_model), weights(small_model(strategy)))]
    assert max(moved) > 1e-3  # the 4 steps changed the weights, so the comparison below means something
    for a, b in zip(weights(keras_model), weights(model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_installed_loop_trains_like_keras_fit_and_the_report_counts_steps(strategy):
    from meshfit.watch.keras_side.report import EpochReport

    x, y = data(6 * 16)  # 6 steps per epoch with 4 per dispatch: one dispatch of 4, then 2 single steps
    plain = small_model(strategy)
    plain_history = plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    model = small_model(strategy)
    jax_loop.install(model, 4)
    report = EpochReport(strategy=strategy, stream=io.StringIO())  # no batch size: no FLOP count to compile
    history = strategy.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, callbacks=[report]).history
    assert isinstance(model.train_function.__wrapped__, jax_loop._TrainFunction)  # goodput's timing around it
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history[key], plain_history[key], rtol=1e-5)
    for a, b in zip(weights(plain), weights(model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    second = report.epochs[1]
    assert second["train_seconds"] / (second["ms_per_step"] / 1000) == pytest.approx(6)  # steps, not calls


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_strategy_fit_runs_the_compiled_steps_per_execution_on_device_compiling_once(strategy, steps_per_execution):
    one = Strategy(dataclasses.replace(strategy.info, devices=strategy.info.devices[:1], devices_per_host=1),
                   "jax", "float32")
    try:
        model = small_model(one, steps_per_execution)
        x, y = data(32)
        one.fit(model, x, y, batch_size=16, epochs=2, report=False)  # 2 steps per epoch
        function = model.train_function.__wrapped__  # inside goodput's timing (fit.hooks)
        assert isinstance(function, jax_loop._TrainFunction) and function.steps == steps_per_execution
        compiled = function._single if steps_per_execution == 1 else function._multi
        assert compiled._cache_size() == 1  # Keras' own step compiles 2-3 times here (1 device)
    finally:
        strategy.activate()


def test_steps_per_dispatch_are_checked_and_fitted_to_the_epoch():
    assert planning.dividing_steps(60, 8) == 6
    assert planning.dividing_steps(64, 8) == 8
    assert planning.dividing_steps(7, 8) == 7
    assert planning.dividing_steps(13, 8) == 1
    with pytest.raises(meshfit.MeshfitError, match="at least 1"):
        planning.dividing_steps(60, 0)
