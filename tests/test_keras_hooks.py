"""Plain Keras after meshfit.connect() (meshfit.fit.hooks): every dispatch finished on several
CPU devices (the guard against XLA:CPU's rendezvous abort), and what plain `fit` prints."""

import dataclasses

import numpy as np

from meshfit.fit.strategy import Strategy


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


def test_each_dispatch_is_finished_on_several_cpu_devices_only(strategy, monkeypatch):
    import jax

    x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
    y = np.arange(40) % 3
    waits = []
    block = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda t: waits.append(1) or block(t))
    model = tiny_model(strategy)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # 16, 16 and 8
    model.evaluate(x, y, batch_size=16, verbose=0)
    model.predict(x[:21], batch_size=16, verbose=0)  # 16 and 5, computed whole
    assert len(waits) >= 3 + 3 + 2
    one = Strategy(dataclasses.replace(strategy.info, devices=strategy.info.devices[:1], devices_per_host=1),
                   "jax", "float32")
    try:
        waits.clear()
        model = tiny_model(one)
        with one.scope():  # its metrics are built in fit: under this strategy, not the 8 devices
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            model.predict(x[:21], batch_size=16, verbose=0)
        assert not waits  # one device: dispatch stays asynchronous
    finally:
        strategy.activate()
