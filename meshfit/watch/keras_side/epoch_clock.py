"""Each epoch's training window on the goodput ledger: the one clock behind every time figure.

The epoch line, history.json, metrics.json's `train_seconds` and the goodput block all read the
goodput ledger (meshfit.watch.goodput) of the process: `EpochClock`, first among fit's callbacks
(meshfit.fit.hooks puts it there), makes the ledger charge the time from an epoch's begin to the
end of its training steps (its validation, or its end) to train, and the time outside those
windows to other (fit's own set-up and tear-down, the callbacks between epochs), eval while Keras
validates inside fit. It keeps the ledger's parts at both ends of the window; the epoch report's
figures are their differences: train (the epoch's training steps), compile, input wait and
checkpoint. So the epochs' train seconds add up to the ledger's train part exactly (one sitting,
one fit or several), whatever the process did between them, and no second stopwatch can drift
from it.

The cause this replaces (issue 50): on TensorFlow the whole of Keras' `fit` was charged to train
while the epoch line timed its epochs with a stopwatch of its own; what fit does outside its
epochs (building the tf.data pipeline over the batches, the callbacks between epochs:
TensorBoard's flush with its fsync, the progress bar's terminal writes, and above all the
tear-down when fit returns, where that pipeline is destroyed) was training in the goodput block
and in no epoch line. The tear-down took 9-58 s in 8 of 14 runs of `meshfit train
fashion-mnist-cnn` (5 epochs) on a 2-vCPU VM loaded by parallel work, under 2 s in the others
(2026-11-28): the lines summed to 40.9 s against the block's 71.0 s in one. It now counts as
other, and its cause, tf.data's autotuning thread, is off (meshfit.fit.sources.without_autotune).
On JAX the time between epochs was train too.

Why this is sufficient: the ledger charges one part at a time, and train only inside a window:
the clock switches the base part to train at an epoch's begin and away from it when its training
ends, and takes the window's edge from the switch itself (goodput.Ledger.switch: read apart, the
time between the two, a thread switch of up to 5 ms under load, was train in no window: host 0's
ledger held 0.5 ms more train than the epochs' sum in one elastic run in CI); the timed JAX dispatches run inside windows; a checkpoint's wait for the dispatched steps is
charged to train only inside one (fit_and_score.charged_to_checkpoint); a stop switches away at
the save (checkpoints.Checkpointer._stop). So the epochs' train seconds are the ledger's train,
whatever runs between them and however long load makes it.
"""

from __future__ import annotations

from typing import Any

import jax
import keras

from meshfit.watch import goodput


def wait_for_device(model) -> None:
    """Wait until the dispatched steps have finished, so clocks read real time."""
    if keras.backend.backend() != "jax":
        keras.ops.convert_to_numpy(model.trainable_variables[0])  # TensorFlow runs each step to the end
        return
    state = getattr(model, "_jax_state", None)
    # Keras keeps fit's state in a TrackedDict of TrackedLists, which JAX's tree functions take
    # for leaves (only exact dicts and lists are its nodes): block_until_ready(state) would wait
    # for nothing, so its arrays are taken out here.
    leaves = ([v for group in state.values() for v in group] if state
              else [v.value for v in model.trainable_variables[:1]])
    jax.block_until_ready(leaves)


class EpochClock(keras.callbacks.Callback):
    """The training window of each epoch on this process's goodput ledger (see the module).

    begin: the ledger's parts (goodput.Ledger.charged) when the epoch began; end: when its
    training ended (None while it trains). `spent()` is their difference per part.
    """

    def __init__(self):
        super().__init__()
        self.begin: dict[str, float] | None = None
        self.end: dict[str, float] | None = None

    def on_epoch_begin(self, epoch, logs=None):
        self.begin, self.end = goodput.ledger().switch("train"), None

    def training(self) -> bool:
        """True between an epoch's begin and the end of its training steps."""
        return self.begin is not None and self.end is None

    def end_training(self) -> None:
        """The epoch's training steps end now: wait for those dispatched (device time, so train),
        then charge what follows to other."""
        if not self.training():
            return
        wait_for_device(self.model)
        self.end = goodput.ledger().switch("other")

    def on_test_begin(self, logs=None):  # Keras' own validation inside fit (validation_data)
        if self.training():
            self.end_training()
            goodput.ledger().switch("eval")

    def on_test_end(self, logs=None):
        if goodput.ledger().base == "eval":
            goodput.ledger().switch("other")

    def on_epoch_end(self, epoch, logs=None):
        self.end_training()

    def spent(self) -> dict[str, Any]:
        """Each part's seconds in the epoch's window: up to its end, or up to now while it trains
        (all zero before the first epoch)."""
        if self.begin is None:
            return dict.fromkeys(goodput.PARTS, 0.0)
        now = self.end if self.end is not None else goodput.ledger().charged()
        return {part: now[part] - self.begin[part] for part in goodput.PARTS}
