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


class Batches:
    """A keras.utils.PyDataset of (x, y)'s batches of `size` (made when Keras is imported)."""

    def __new__(cls, x, y, size):
        import keras

        class Source(keras.utils.PyDataset):
            def __len__(self):
                return -(-len(x) // size)

            def __getitem__(self, i):
                return x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]

        return Source()


@pytest.mark.parametrize("source", ["arrays", "pydataset"])
def test_k_steps_per_dispatch_train_as_single_steps_from_any_source(strategy, source):
    """5 batches an epoch with 2 per dispatch: 2 dispatches of 2, then 1 step. On Keras 3.16 its
    iterator stacks each dispatch's batches (keras_internals.stacks_dispatch_batches), which the
    loop and meshfit's sources take as they come."""
    x, y = data(5 * 16)
    trained = []
    for steps in (1, 2):
        model = small_model(strategy, steps)
        fed = dict(x=x, y=y, batch_size=16) if source == "arrays" else dict(x=Batches(x, y, 16))
        strategy.fit(model, epochs=2, shuffle=False, report=False, **fed)
        assert int(np.asarray(model.optimizer.iterations)) == 10
        trained.append(weights(model))
    for a, b in zip(*trained):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_batches_stacked_per_dispatch_train_as_one_by_one(strategy, monkeypatch):
    """As Keras 3.16 hands them: each dispatch's k batches stacked on a new leading axis, an
    epoch's last few as a list; placed with the rows (second axis) split across the devices."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from meshfit.fit import keras_internals

    x, y = data(6 * 16)
    batches = [(x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16]) for i in range(6)]
    monkeypatch.setattr(keras_internals, "stacks_dispatch_batches", lambda: False)  # as Keras 3.15
    one_by_one = small_model(strategy, 4)
    jax_loop.install(one_by_one, 4)
    state = jax_loop.training_state(one_by_one, batches[0])
    logs, state = one_by_one.train_function(state, iter(batches[:4]))  # 4 steps in one dispatch
    logs, state = one_by_one.train_function(state, iter(batches[4:]))  # then 2 single steps
    monkeypatch.setattr(keras_internals, "stacks_dispatch_batches", lambda: True)  # as Keras 3.16
    model = small_model(strategy, 4)
    jax_loop.install(model, 4)
    stacked = jax.tree.map(lambda *parts: np.stack(parts), *batches[:4])
    fed = iter([stacked, list(batches[4:])])
    stacked_state = jax_loop.training_state(model, batches[0])
    logs, stacked_state = model.train_function(stacked_state, fed)
    logs, stacked_state = model.train_function(stacked_state, fed)
    for a, b in zip(jax.tree.leaves(state[:2]), jax.tree.leaves(stacked_state[:2])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    import keras

    with strategy.scope():
        mesh = keras.distribution.distribution().device_mesh.backend_mesh
        place = keras_internals._jax_distribution_lib().distribute_data_input  # meshfit's hook
        placed = place(stacked[0], NamedSharding(mesh, PartitionSpec(None, "batch")), "batch")
    assert tuple(placed.sharding.spec)[:2] == (None, "batch")  # rows split, not held whole on each device
