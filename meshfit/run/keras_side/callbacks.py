"""A recipe's own Keras callbacks (EarlyStopping, ReduceLROnPlateau, ModelCheckpoint...), with their
state carried through checkpoints, so that a resumed run decides exactly as an uninterrupted one.

Keras callbacks reset their counters in `on_train_begin`, which every `fit` call runs; a resumed
run (and the two fit calls of a run cut mid-epoch) would start counting again. `RecipeCallbacks`
holds the callbacks, forwards every hook to them, and puts their saved state back right after
`on_train_begin`. The state is each callback's attributes other than its constructor's arguments,
which the recipe sets again (and some callbacks derive, e.g. EarlyStopping flips min_delta's sign
once it knows the mode): plain values (numbers, strings, booleans, None), saved in the
checkpoint's state.json (EarlyStopping's wait, best and best epoch, ReduceLROnPlateau's wait,
cooldown and best, ModelCheckpoint's best), and numpy arrays or lists of them, saved beside the
model's variables in its arrays.npz (EarlyStopping's `best_weights`, with
restore_best_weights=True), so a resumed run restores the same best weights.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any

import keras
import numpy as np

from meshfit.errors import MeshfitError

_SKIPPED = ("params", "_model", "model")


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, str, numbers.Number))


def _arrays(value: Any) -> bool:
    """True for a numpy array or a non-empty list/tuple of them (e.g. model.get_weights())."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(isinstance(v, np.ndarray) for v in value)
    return isinstance(value, np.ndarray)


def _own(callback) -> dict[str, Any]:
    """The callback's attributes that are not constructor arguments or its model and params."""
    arguments = inspect.signature(type(callback).__init__).parameters
    return {k: v for k, v in vars(callback).items() if k not in _SKIPPED and k not in arguments}


def state_of(callback) -> dict[str, Any]:
    """The callback's attributes that are plain values (numpy numbers as Python numbers) and not
    constructor arguments."""
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in _own(callback).items()
            if _plain(v)}


def arrays_of(callback) -> dict[str, np.ndarray | list[np.ndarray]]:
    """The callback's attributes that are numpy arrays or lists of them, not constructor arguments."""
    return {k: v for k, v in _own(callback).items() if _arrays(v)}


class RecipeCallbacks(keras.callbacks.Callback):
    """The recipe's callbacks as one Keras callback whose state() and arrays() can be checkpointed.

    state, arrays: what state() and arrays() returned when the checkpoint was taken (resuming).
    epochs: the run's epochs. A run resumed mid-epoch fits the rest of that epoch first, in a fit
    call of its own; its on_train_end is not passed on (EarlyStopping would restore its best
    weights there), only that of the fit that ends training (last epoch, or a callback stopped it).
    """

    def __init__(self, callbacks: list, state: list[dict[str, Any]] | None = None,
                 arrays: dict[str, np.ndarray] | None = None, epochs: int | None = None):
        super().__init__()
        self.callbacks = list(callbacks)
        if state is not None and len(state) != len(self.callbacks):
            raise MeshfitError(f"the checkpoint holds the state of {len(state)} recipe callbacks but "
                               f"the recipe has {len(self.callbacks)}; resume with the same recipe")
        self._saved = state
        self._saved_arrays = arrays or {}
        self.epochs, self._epoch = epochs, -1
        self.stopped = False  # a callback stopped training at the last epoch's end (EarlyStopping)

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

    def arrays(self) -> dict[str, np.ndarray]:
        """Every callback's array state (see arrays_of), flat: "I/NAME" for an array, "I/NAME/J"
        for item J of a list, I the callback's position."""
        flat = {}
        for i, callback in enumerate(self.callbacks):
            for name, value in arrays_of(callback).items():
                if isinstance(value, np.ndarray):
                    flat[f"{i}/{name}"] = value
                else:
                    flat.update({f"{i}/{name}/{j:05d}": v for j, v in enumerate(value)})
        return flat

    def _put_arrays(self, flat: dict[str, np.ndarray]) -> None:
        """Set the callbacks' array attributes from arrays() output."""
        values: dict[tuple[int, str], Any] = {}
        for key in sorted(flat):
            i, name, *item = key.split("/")
            if item:
                values.setdefault((int(i), name), []).append(flat[key])
            else:
                values[int(i), name] = flat[key]
        for (i, name), value in values.items():
            setattr(self.callbacks[i], name, value)

    def on_train_begin(self, logs=None) -> None:
        self._each("on_train_begin", logs)
        for callback, saved in zip(self.callbacks, self._saved or []):
            vars(callback).update(saved)
        self._put_arrays(self._saved_arrays)

    def end_as_stopped(self, model) -> None:
        """What the end of the fit that a recipe callback stopped did, for a run resumed from the
        save at that stop (no epoch is left to fit): the callbacks' saved state, then their
        on_train_end (EarlyStopping's restore_best_weights puts the best weights back)."""
        self.set_model(model)
        self.on_train_begin()
        model.stop_training = True
        self.on_train_end()

    def on_train_end(self, logs=None) -> None:
        # a second fit call (the rest of a cut epoch first) goes on from here
        self._saved, self._saved_arrays = self.state(), self.arrays()
        if self.epochs is None or self._epoch + 1 >= self.epochs or self.model.stop_training:
            self._each("on_train_end", logs)

    def _each(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._each("on_epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch, logs=None) -> None:
        self._epoch = epoch
        self._each("on_epoch_end", epoch, logs)
        self.stopped = bool(self.model.stop_training)

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self._each("on_train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None) -> None:
        self._each("on_train_batch_end", batch, logs)

    def on_test_begin(self, logs=None) -> None:
        self._each("on_test_begin", logs)

    def on_test_end(self, logs=None) -> None:
        self._each("on_test_end", logs)
