"""A run resumed in the middle of an epoch: what its callbacks see and what its history records."""

import numpy as np


class Batches:
    """`steps_per_epoch` batches of 16 rows per epoch; iterate(epoch, step) yields from step
    `step` of epoch `epoch` on, as the run's batches do."""

    steps_per_epoch = 4

    def iterate(self, epoch, step=0):
        rng = np.random.default_rng(epoch)
        for _ in range((10 - epoch) * self.steps_per_epoch - step):
            yield rng.normal(size=(16, 3)).astype("float32"), rng.integers(0, 2, 16)


class NoCheckpoints:
    """What fitting.fit's stop_on_signals needs of a checkpointer, saving nothing."""

    stop_signal, saving, interrupted = None, False, False

    def request_stop(self, signum):
        self.stop_signal = signum

    def wait(self):
        return None


def test_a_cut_epochs_callbacks_see_the_runs_epochs(strategy):
    """Resumed at step 2 of epoch 1 of 3, the bar and the epoch line say 1/3 (they said 1/1:
    the cut epoch is a fit of its own, of one epoch)."""
    import keras

    from meshfit.run import fitting

    seen = []

    class Seen(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append((epoch + 1, self.params["epochs"]))

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    fitting.fit(strategy, model, Batches(), [Seen()], NoCheckpoints(), (0, 2), 3)
    assert seen == [(1, 3), (2, 3), (3, 3)]
