"""The built-in datasets' arrays kept unpacked: read once from their source files, then from .npy
files in CACHE/unpacked/ while those files are unchanged (meshfit.data.datasets reads through it).

Unpacking costs more than training's start-up can spare (Fashion-MNIST's gzip: 0.58 CPU-s,
CIFAR-10's pickles: 1.76; as .npy files: 0.01 and 0.24, measured 2026-11-27 on the 2-core EPYC).
An entry is named by the source files' paths, sizes and modification times and the checks they
passed: a changed source is read (and checked) again. On disk: MNIST and Fashion-MNIST 52 MB each,
CIFAR-10 176 MB, per set of source files still there: writing an entry removes those whose
sources are gone or changed (`remove_stale_entries`), which could never be read again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from typing import Any, Callable

import numpy as np

ARRAYS = ("x_train", "y_train", "x_test", "y_test")
# Part of each entry's name: raise it when what a dataset's read returns or an entry holds changes
# (2: entries name their sources in sources.json, so that stale ones can be found).
FORMAT = 2
STALE_WRITE_SECONDS = 3600  # a .tmp- folder this old was left by a writer that died


def read_through(folder: str, key: str, sources: list[str], checks: list, read: Callable[[], Any],
                 make: Callable[[list[np.ndarray], tuple[str, ...]], Any]) -> Any:
    """Dataset `key`: `make(arrays, class_names)` from its entry in `folder` when these source
    files (same paths, sizes and modification times) were read before with these checks; else
    `read()` (an object with the ARRAYS and class_names), kept there.

    Kept arrays were checked when written, so a hit skips the checks: a source replaced by one
    of the same size and modification time (to the nanosecond) would not be seen; any other change
    is. Entries are written to a temporary folder and renamed, so concurrent runs (the processes
    of a job on one host) never see half an entry; an entry that cannot be read is read again
    from the sources. No writable cache: the sources are read each time."""
    try:
        stats = {path: os.stat(path) for path in sources}
        stamp = [(os.path.abspath(path), st.st_size, st.st_mtime_ns) for path, st in stats.items()]
    except OSError:  # vanished since it was found: read() gives the clear error
        return read()
    digest = hashlib.sha256(repr((FORMAT, key, checks, stamp)).encode()).hexdigest()[:20]
    entry = os.path.join(folder, f"{key}-{digest}")
    try:
        with open(os.path.join(entry, "class_names.txt"), encoding="utf-8") as f:
            names = tuple(f.read().split("\n"))
        return make([np.load(os.path.join(entry, f"{a}.npy"), allow_pickle=False) for a in ARRAYS],
                    names)
    except (OSError, ValueError):  # not kept yet, or an entry cut short: read the sources
        pass
    dataset = read()
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=folder, prefix=".tmp-")
        for a in ARRAYS:
            np.save(os.path.join(tmp, f"{a}.npy"), getattr(dataset, a))
        with open(os.path.join(tmp, "class_names.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(dataset.class_names))
        with open(os.path.join(tmp, "sources.json"), "w", encoding="utf-8") as f:
            json.dump(stamp, f)
        os.rename(tmp, entry)  # fails where another run kept it first: this copy is then dropped
        remove_stale_entries(folder)
    except OSError:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return dataset


def remove_stale_entries(folder: str) -> None:
    """Removes the entries of `folder` that can never be read again: their source files gone or
    changed (a stamp no longer matches), or no sources.json (written by FORMAT 1); and folders a
    writer that died left half-written. Without this the cache grew by up to 176 MB for each copy
    of a dataset ever read (another path, a fresh download, a test's folder).

    A run reading an entry removed meanwhile loses nothing: its np.load fails and it reads the
    sources (the OSError branch of `read_through`)."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            if name.startswith(".tmp-"):
                stale = time.time() - os.stat(path).st_mtime > STALE_WRITE_SECONDS
            else:
                stale = not _sources_unchanged(path)
        except OSError:  # removed by another run meanwhile, or a source not ours to look at: kept
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)


def _sources_unchanged(entry: str) -> bool:
    """Whether the source files an entry was read from are all there, unchanged."""
    try:
        with open(os.path.join(entry, "sources.json"), encoding="utf-8") as f:
            stamp = json.load(f)
        for path, size, mtime_ns in stamp:
            st = os.stat(path)
            if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
                return False
    except (FileNotFoundError, ValueError):  # a source gone; no sources.json (format 1), or cut
        return False
    return True
