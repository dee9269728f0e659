"""Checkpoints and resume from plain Python: Keras' own `keras.callbacks.BackupAndRestore` under
`meshfit.connect()` on 8 simulated devices, as docs/guides/checkpoints.md tells a `model.fit`
user. A fit stopped after epoch 1 and run again resumes at epoch 2 (from the weights and
optimizer state saved then) and ends with the weights of a fit that was never stopped."""

import numpy as np
import pytest


def fit(strategy, x, y, epochs, callbacks=()):
    """A small model fitted from seed 0 with plain model.fit; its weights and History."""
    import keras

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return [np.asarray(w) for w in model.get_weights()], history


class StopAt:
    """A Keras callback that fails at the start of epoch `epoch` (0-based), as a crash would."""

    def __new__(cls, epoch):
        import keras

        class Stop(keras.callbacks.Callback):
            def on_epoch_begin(self, index, logs=None):
                if index == epoch:
                    raise RuntimeError(f"stopped at epoch {index}")

        return Stop()


def test_backup_and_restore_resumes_at_the_epoch_and_ends_as_an_unstopped_fit(strategy, tmp_path):
    import keras

    assert strategy.replicas == 8
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 6)).astype("float32")  # 4 steps of 32: 4 rows per device
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0)
    expected, _ = fit(strategy, x, y, epochs=3)

    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="stopped at epoch 2"):
        fit(strategy, x, y, epochs=3,
            callbacks=[keras.callbacks.BackupAndRestore(backup), StopAt(2)])
    resumed, history = fit(strategy, x, y, epochs=3,
                           callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert history.epoch == [2]  # only the epoch that was not done
    for got, want in zip(resumed, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
