"""Restoring a checkpoint into a compiled model: every file checked before any variable changes,
the model's and optimizer's arrays laid out for the devices there are now (another device count,
one process or several, fsdp or data-parallel). Which checkpoint a `--resume` takes, and the
fallback past a damaged one: meshfit.run.keras_side.fitting.

This module imports Keras at the top: import it after `meshfit.connect()`.
"""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np

from meshfit.errors import MeshfitError
from meshfit.run import sharded_arrays
from meshfit.run.checkpoint_format import (EXTRA, FORMAT, GROUPS, STATE_JSON, damaged, read_npz,
                                           read_sharded, read_state, verify)
from meshfit.run.keras_side.checkpoint_save import variable_groups


def check_fits(path: str, group: str, saved: list, variables: list) -> None:
    """A one-line MeshfitError unless the saved variables have the shapes of `variables`."""
    hint = "resume with the recipe and settings that wrote it, or start a new run"
    if len(saved) != len(variables):
        raise MeshfitError(f"checkpoint {path} does not fit this model: it has {len(saved)} {group} "
                           f"variables, the model has {len(variables)}; {hint}")
    for (name, shape, _), v in zip(saved, variables):
        if tuple(shape) != tuple(v.shape):
            raise MeshfitError(f"checkpoint {path} does not fit this model: {group} variable {name} "
                               f"has shape {tuple(shape)} there but {v.path} has {tuple(v.shape)} "
                               f"here; {hint}")


def _check_arrays(path: str, state: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """A CheckpointDamaged unless the arrays are the ones state.json lists, of its shapes."""
    for group in GROUPS:
        for i, entry in enumerate(state["variables"][group]):
            key = f"{group}/{i:05d}"
            if key not in arrays:
                raise damaged(path, f"array {key} is missing")
            try:
                shape = tuple(int(d) for d in entry[1])
            except (TypeError, ValueError, IndexError):
                raise damaged(path, f"{STATE_JSON} lists {group} variable {i} wrongly") from None
            if arrays[key].shape != shape:
                raise damaged(path, f"array {key} has shape {arrays[key].shape}, {STATE_JSON} "
                                     f"says {shape}")


def _assign(values: list, arrays: dict[str, np.ndarray], group: str) -> None:
    for i, v in enumerate(values):
        v.assign(arrays[f"{group}/{i:05d}"])


def restore(model, path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint's model and optimizer variables into a compiled `model`.

    Every file is checked (manifest, fields, arrays) before any variable changes: a damaged
    checkpoint raises CheckpointDamaged and leaves the model as it was.
    Returns the checkpoint's state (state.json) with the metrics' arrays under "metrics_values":
    metrics variables exist only once fit has started, so `Checkpointer(resume_state=...)` puts
    them back at the start of the resumed epoch; and the extra arrays under "extra_arrays".
    """
    path = os.fspath(path)
    verify(path)
    state, arrays = read_state(path), read_npz(path)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:  # its variables exist only once built
        optimizer.build(model.trainable_variables)
    groups = variable_groups(model)
    sharded = state["format"] == FORMAT
    if sharded:  # every saved variable is listed: check the model first, then read for its layout
        for group in ("model", "optimizer"):
            check_fits(path, group, state["variables"][group], groups[group])
        arrays.update(read_sharded(path, state, {group: [_target(v) for v in groups[group]]
                                                  for group in ("model", "optimizer")}))
    _check_arrays(path, state, arrays)
    for group in ("model", "optimizer"):
        check_fits(path, group, state["variables"][group], groups[group])
    # Every check came first: a checkpoint that fails one leaves the model as it was.
    for group in ("model", "optimizer"):
        _assign(groups[group], arrays, group)
    count = len(state["variables"]["metrics"])
    state["metrics_values"] = [arrays[f"metrics/{i:05d}"] for i in range(count)]
    state["extra_arrays"] = {k[len(EXTRA) + 1:]: v for k, v in arrays.items() if k.startswith(EXTRA + "/")}
    return state


def _target(variable) -> Any:
    """How to read a saved array into `variable`: with its sharding on JAX (laid out for the
    devices there are now), else as numpy."""
    if keras.backend.backend() == "jax":
        value = variable.value
        return sharded_arrays.target_of(tuple(value.shape), str(np.dtype(value.dtype)), value.sharding)
    return sharded_arrays.target_of(tuple(variable.shape), str(np.dtype(variable.dtype)))
