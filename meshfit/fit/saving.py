"""Keras' own saving and reading of values from a job of several processes (meshfit launch,
SLURM, a TPU slice), as the same program calls them on every process: model.save, save_weights
and get_weights, ModelCheckpoint, BackupAndRestore, keras-hub's save_lora_weights and generate.

Two things failed there (2 processes x 2 simulated devices, a user's plain fit, 2026-11-29):
- A variable split across processes (fsdp, model parallel) cannot be read by one process: JAX
  raised "Fetching value for `jax.Array` that spans non-addressable (non process local)
  devices"; so did keras-hub's generate, whose tokens are split over the batch. Reading one
  (Keras' `Variable.__array__`, which every save and `numpy()` go through, and
  `backend.convert_to_numpy`, ops.convert_to_numpy's) now gathers its value from every process:
  a collective, which every process enters at the same read because the same saving code reads
  the same variables in the same order. A read on one process alone (a save under `if
  jax.process_index() == 0`) waited for the others until the stall guard ended it, 600 s later,
  with a line that could not say why: each read now first meets the others
  (hosts.meet_every_process), which warns after a minute and then ends the wait with a one-line
  error naming the fix.
- Every process wrote the same file, and on a file system they share two writers of one file
  failed (h5py: "Unable to synchronously create group (name already exists)"). Each process now
  writes its own temporary file beside the target and renames it over the target once complete
  (meshfit.files.atomic_path for a .keras archive; an .h5 store, opened and closed apart, renames
  its own at close), so the target is always one whole file (every process writes the same
  values), and each host gets its copy where the hosts share no disk. Likewise BackupAndRestore's
  removal of its folder at the end of fit, by every process at once: the one that finds an entry
  gone (another took it) finishes the removal instead of raising FileNotFoundError.
The wrappers here are applied by meshfit.fit.hooks (meshfit.fit.keras_internals.PATCHES, which
names what each replaces) and change nothing in a single process. An .h5 store whose save fails
before its close leaves its temporary file, `.<target>.<pid>.tmp.h5`, beside the target.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshfit.files import atomic_path
from meshfit.fit import hosts
from meshfit.parallel import cluster, stall


def whole(value: Any) -> np.ndarray | None:
    """The whole of a JAX array split across processes, gathered from every process (a
    collective: every process calls it for the same array); None for any other value, which
    this process can read itself: in a single process every array is fully addressable, so the
    wrappers below ask nothing more of the job before calling it. A read the other processes do
    not join, or of a value whose computation they do not run, is a warning line, then a one-line
    MeshfitError (hosts.meet_every_process, hosts.wait_until_computed), not a hang."""
    if getattr(value, "is_fully_addressable", True):
        return None
    if value.is_fully_replicated:  # read here, once its computation (of every process) is done
        hosts.wait_until_computed(value, f"reads a value computed on the devices of all "
                                         f"{jax.process_count()} processes")
        return None

    hosts.meet_every_process(f"reads a value split across the job's {jax.process_count()} "
                             "processes (a variable under fsdp or model parallel, or generate's "
                             "tokens)")
    with stall.watching():
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def gathered_reads(keras_array: Callable) -> Callable:
    """The wrapper of Keras' `Variable.__array__`: a variable split across processes is read
    whole (see `whole`). It takes numpy 2's `copy` too, which Keras' lacks (numpy then retried
    without it and warned, a DeprecationWarning at every np.array(variable)): copy=True returns
    an array of its own; otherwise the value may share memory, as Keras' did."""

    @functools.wraps(keras_array)
    def __array__(self, dtype=None, copy=None):
        found = whole(self.value)
        if found is None:
            value = keras_array(self, dtype)
        else:
            value = found if dtype is None else found.astype(dtype)
        return np.array(value, copy=True) if copy else value

    return __array__


def gathered_conversions(keras_convert: Callable) -> Callable:
    """The wrapper of Keras' `backend.convert_to_numpy` (ops.convert_to_numpy: keras-hub's
    generate returns its tokens through it, which are split over the batch across processes):
    an array split across processes is read whole (see `whole`)."""

    @functools.wraps(keras_convert)
    def convert_to_numpy(x, *args, **kwargs):
        found = whole(x)
        return keras_convert(x, *args, **kwargs) if found is None else found

    return convert_to_numpy


def _private_path(target: str) -> str:
    """This process's temporary file beside `target`, with the same extension (Keras checks it)."""
    folder, name = os.path.split(target)
    return os.path.join(folder, f".{name}.{os.getpid()}.tmp{os.path.splitext(name)[1]}")


def _local_file(path: Any) -> str | None:
    """`path` as a string where it names a file on a local or mounted file system (not a file
    object, nor gs://, hf:// and other remote paths, which Keras writes in one piece)."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    path = os.fspath(path)
    return None if "://" in path else path


def renamed_model_files(keras_save: Callable) -> Callable:
    """The wrapper of Keras' `saving_lib.save_model` (a .keras archive): written to a private
    file and renamed over the target in a job of several processes."""

    @functools.wraps(keras_save)
    def save_model(model, filepath, *args, **kwargs):
        target = _local_file(filepath)
        if target is None or not target.endswith(".keras") or not cluster.multi_process():
            return keras_save(model, filepath, *args, **kwargs)
        with atomic_path(target, ".keras") as temporary:
            return keras_save(model, temporary, *args, **kwargs)

    return save_model


def renamed_h5_closes(store_close: Callable) -> Callable:
    """The wrapper of Keras' `H5IOStore.close`: a store that `renamed_h5_stores` gave a private
    file renames it over its target once closed."""

    @functools.wraps(store_close)
    def close(self, *args, **kwargs):
        result = store_close(self, *args, **kwargs)
        target = getattr(self, "_meshfit_target", None)
        if target is not None:
            self._meshfit_target = None
            os.replace(os.fspath(self.path_or_io), target)
        return result

    close.renames = True
    return close


def renamed_h5_stores(store_init: Callable) -> Callable:
    """The wrapper of Keras' `H5IOStore.__init__` (a .weights.h5 file, keras-hub's .lora.h5): a
    store written to a path in a job of several processes writes a private file, renamed over
    the target at close (renamed_h5_closes). A store class with a close of its own (Keras'
    sharded store, several files) is left as it is."""

    @functools.wraps(store_init)
    def __init__(self, path_or_io, archive=None, mode="r", *args, **kwargs):
        target = _local_file(path_or_io)
        private = (mode == "w" and archive is None and target is not None
                   and getattr(type(self).close, "renames", False) and cluster.multi_process())
        self._meshfit_target = target if private else None
        store_init(self, _private_path(target) if private else path_or_io, archive, mode,
                   *args, **kwargs)

    return __init__


def exported_whole(export: Callable) -> Callable:
    """The wrapper of Keras' `Model.export`: in a job of several processes every process gathers
    the variables split across processes (TensorFlow's SavedModel reads each with tf.Variable,
    which JAX refuses for an array other processes hold part of), process 0 alone writes the
    files (each process wrote the same folder), and the processes meet once it is written. The
    variables hold their own arrays again after."""

    @functools.wraps(export)
    def export_whole(self, filepath, *args, **kwargs):
        if not cluster.multi_process():
            return export(self, filepath, *args, **kwargs)
        held = [(v, v._value) for v in self.variables]  # restored exactly after
        try:
            for variable, value in held:
                gathered = whole(value)
                if gathered is not None:
                    variable._value = gathered  # not assign: that would lay it out over the devices
            result = export(self, filepath, *args, **kwargs) if jax.process_index() == 0 else None
        finally:
            for variable, value in held:
                variable._value = value
        hosts.meet_every_process(f"exports the model to {filepath}")
        return result

    return export_whole


def met_before_removal(on_train_end: Callable) -> Callable:
    """The wrapper of Keras' `BackupAndRestore.on_train_end`, which removes the backup folder: in
    a job of several processes each first meets the others there (every process calls it), so
    none removes the folder while another still writes its last backup into it (that one's
    rename then failed, FileNotFoundError, after training had finished)."""

    @functools.wraps(on_train_end)
    def meet_first(self, logs=None):
        if cluster.multi_process():
            hosts.meet_every_process("ends BackupAndRestore, which removes its backup folder")
        return on_train_end(self, logs)

    return meet_first


def first_process_writes(on_train_begin: Callable) -> Callable:
    """The wrapper of Keras' `CSVLogger.on_train_begin`, which opens its file: in a job of several
    processes every process logs the same epochs (their metrics are the job's), so the others
    write theirs to os.devnull (with append=True each line was in the file as many times)."""

    @functools.wraps(on_train_begin)
    def begin(self, logs=None):
        if not cluster.multi_process() or jax.process_index() == 0:
            return on_train_begin(self, logs)
        filename, self.filename = self.filename, os.devnull
        try:
            return on_train_begin(self, logs)
        finally:
            self.filename = filename

    return begin


def shared_removals(keras_rmtree: Callable) -> Callable:
    """The wrapper of Keras' `file_utils.rmtree`: in a job of several processes, a folder another
    process removes at the same time is removed to the end, not an error."""

    @functools.wraps(keras_rmtree)
    def rmtree(path, *args, **kwargs):
        try:
            return keras_rmtree(path, *args, **kwargs)
        except FileNotFoundError:
            if not cluster.multi_process():
                raise
            shutil.rmtree(path, ignore_errors=True)

    return rmtree
