"""A recipe's own Keras callbacks (EarlyStopping, ReduceLROnPlateau, ModelCheckpoint...), with their
state carried through checkpoints, so that a resumed run decides exactly as an uninterrupted one.

Keras callbacks reset their counters in `on_train_begin`, which every `fit` call runs; a resumed
run (and the two fit calls of a run cut mid-epoch) would start counting again. `RecipeCallbacks`
holds the callbacks, forwards every hook to them, and puts their saved state back right after
`on_train_begin`. The state is each callback's plain attributes (numbers, strings, booleans, None)
other than its constructor's arguments, which the recipe sets again (and some callbacks derive,
e.g. EarlyStopping flips min_delta's sign once it knows the mode): EarlyStopping's wait, best and
stopped epoch, ReduceLROnPlateau's wait, cooldown and best, ModelCheckpoint's best. Arrays such as
EarlyStopping's `best_weights` are not carried.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any

import keras

_SKIPPED = ("params", "_model", "model")


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, str, numbers.Number))


def state_of(callback) -> dict[str, Any]:
    """The callback's attributes that are plain values (numpy numbers as Python numbers) and not
    constructor arguments."""
    arguments = inspect.signature(type(callback).__init__).parameters
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in vars(callback).items()
            if k not in _SKIPPED and k not in arguments and _plain(v)}


class RecipeCallbacks(keras.callbacks.Callback):
    """The recipe's callbacks as one Keras callback whose state() can be checkpointed."""

    def __init__(self, callbacks: list, state: list[dict[str, Any]] | None = None):
        super().__init__()
        self.callbacks = list(callbacks)
        if state is not None and len(state) != len(self.callbacks):
            from meshfit.errors import MeshfitError

            raise MeshfitError(f"the checkpoint holds the state of {len(state)} recipe callbacks but "
                               f"the recipe has {len(self.callbacks)}; resume with the same recipe")
        self._saved = state

    def set_model(self, model) -> None:
        super().set_model(model)
        for callback in self.callbacks:
            callback.set_model(model)

    def set_params(self, params) -> None:
        super().set_params(params)
        for callback in self.callbacks:
            callback.set_params(params)

    def state(self) -> list[dict[str, Any]]:
        """Every callback's state (see state_of), in order."""
        return [state_of(c) for c in self.callbacks]

    def on_train_begin(self, logs=None) -> None:
        self._each("on_train_begin", logs)
        for callback, saved in zip(self.callbacks, self._saved or []):
            vars(callback).update(saved)

    def on_train_end(self, logs=None) -> None:
        self._saved = self.state()  # a second fit call (the rest of a cut epoch first) goes on from here
        self._each("on_train_end", logs)

    def _each(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._each("on_epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch, logs=None) -> None:
        self._each("on_epoch_end", epoch, logs)

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self._each("on_train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None) -> None:
        self._each("on_train_batch_end", batch, logs)

    def on_test_begin(self, logs=None) -> None:
        self._each("on_test_begin", logs)

    def on_test_end(self, logs=None) -> None:
        self._each("on_test_end", logs)
