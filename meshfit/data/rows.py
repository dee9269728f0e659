"""The rows of a batch: how many split across the replicas, how many there are, the first n.

A batch is an array or a tuple/list/dict of them (x, y, sample_weight), rows along the first axis.
meshfit.data.streams cuts a recipe's own batches with these, meshfit.fit.sources any batch Keras
reads. Keras' tree functions are imported inside: they run only once connect() chose the engine.
"""

from __future__ import annotations

from typing import Any


def splittable_rows(rows: int, replicas: int, micro_batches: int = 1) -> int:
    """Rows of a batch of `rows` that split across `replicas`: the largest multiple of them, or 0
    when fewer than `micro_batches` (slices of one sample each at least) would remain."""
    keep = rows - rows % replicas
    return keep if keep >= micro_batches else 0


def leading_rows(data: Any) -> int | None:
    """The first axis of the first array in `data` (an array or a tuple/list/dict of them)."""
    import keras

    leaves = [t for t in keras.tree.flatten(data) if t is not None]
    return int(leaves[0].shape[0]) if leaves and getattr(leaves[0], "shape", None) else None


def first_rows(data: Any, rows: int) -> Any:
    """`data` with every array cut to its first `rows` rows (None entries stay None)."""
    import keras

    return keras.tree.map_structure(lambda t: None if t is None else t[:rows], data)


def take_rows(data: Any, indices) -> Any:
    """`data` with every array cut to the rows `indices` (a numpy index array; None entries stay
    None), as numpy: dict and list inputs (a model with several inputs) as arrays."""
    import keras
    import numpy as np

    return keras.tree.map_structure(lambda t: None if t is None else np.asarray(t)[indices], data)
