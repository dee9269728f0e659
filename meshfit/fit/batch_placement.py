"""Placing each batch of fit, evaluate and predict on the devices: Keras' JAX
`distribute_data_input`, hooked while a meshfit strategy is active (meshfit.fit.hooks).

A batch whose rows split across the devices of its layout's row axis is sharded as Keras would.
One that does not (an epoch's last batch, a validation remainder, `predict` on 3 images) is
placed whole on every device (on several hosts, every process's rows: meshfit.fit.hosts) instead
of failing with JAX's IndivisibleError, so every sample counts exactly as on one device. On
several hosts, where processes share a block of rows (a model axis across them), every process's
rows are gathered into the one batch (hosts.rows_are_own_blocks). The
layout is the current distribution's: meshfit's, or one the user set after connect() with
`keras.distribution.set_distribution` (keras.io's DataParallel guide does), whose predict on 3
rows over 4 devices failed so.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from typing import Any, Callable

import jax
from jax.experimental import sparse
from jax.sharding import NamedSharding, PartitionSpec

from meshfit.errors import MeshfitError
from meshfit.fit import hosts
from meshfit.parallel.sharding import axis_parts

fit_batches = contextvars.ContextVar("meshfit_fit_batches", default=None)  # inside fit: rows seen


def hook(place: Callable, active: Callable[[], Any]) -> Callable:
    """Keras' `distribute_data_input(batch, layout, batch_dim_name)`, placing batches that do not
    split whole on every device while `active()` (the meshfit strategy) is on JAX."""

    @functools.wraps(place)
    def distribute_data_input(per_process_batch, layout, batch_dim_name):
        strategy = active()
        shape = getattr(per_process_batch, "shape", ())
        sharding = getattr(layout, "backend_layout", layout)
        if not shape or strategy is None or strategy.engine != "jax" or \
                not isinstance(sharding, NamedSharding):
            return place(per_process_batch, layout, batch_dim_name)
        if isinstance(per_process_batch, sparse.JAXSparse):
            return _sparse_whole(per_process_batch, sharding.mesh)
        # Keras 3.16 stacks a dispatch's k batches on a new leading axis, which its layout leaves
        # whole: the rows are then the second axis.
        axis = 1 if tuple(sharding.spec)[:1] == (None,) and len(shape) > 1 else 0
        entry = tuple(sharding.spec)[axis] if axis < len(sharding.spec) else None
        parts = axis_parts(entry, dict(sharding.mesh.shape))
        if jax.process_count() > 1:
            hosts.check_rows(shape[axis])
        rows = shape[axis] * jax.process_count()  # each process passes as many rows
        splits = rows % parts == 0 and rows > 0
        note_batch(rows, splits, parts)
        whole = NamedSharding(sharding.mesh, PartitionSpec())
        if jax.process_count() > 1 and not (splits and hosts.rows_are_own_blocks(sharding, axis)):
            return hosts.gathered(per_process_batch, sharding if splits else whole, axis)
        if splits:
            return place(per_process_batch, layout, batch_dim_name)
        return jax.device_put(per_process_batch, whole)

    return distribute_data_input


def _sparse_whole(batch, mesh):
    """A sparse batch (`keras.Input(sparse=True)`: a BCOO from a tf.SparseTensor or scipy.sparse
    matrix), whole on every device. Keras shards each of its arrays by the batch's layout, but
    its stored values and indices are no rows of the batch (the values are of rank 1, which the
    layout does not fit: JAX's ValueError, also under Keras' own DataParallel); whole, every
    sample counts exactly as on one device, as for a batch that does not split."""
    if jax.process_count() > 1:  # each process holds other rows: no whole batch without a gather
        raise MeshfitError(f"a sparse input batch cannot be split over {jax.process_count()} "
                           "processes; pass it dense (e.g. x.todense(), tf.sparse.to_dense) on "
                           "several processes")
    return jax.device_put(batch, NamedSharding(mesh, PartitionSpec()))


def note_batch(rows: int, splits: bool, parts: int) -> None:
    """Inside `fit`, once: warn when a batch that cannot split is as large as any before it, so
    the batch size itself does not split (a shorter last batch is normal and needs no word)."""
    seen = fit_batches.get()
    if seen is None:
        return
    if not splits and rows >= seen.get("largest", 0) and not seen.get("warned"):
        seen["warned"] = True
        warnings.warn(f"a batch of {rows} samples does not split across {parts} devices: such "
                      f"batches are computed whole on every device (every sample counts, but they "
                      f"are not split); a batch size that is a multiple of {parts} avoids it",
                      stacklevel=2)
    seen["largest"] = max(rows, seen.get("largest", 0))
