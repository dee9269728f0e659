"""Files written whole: a reader (a resumed run, a concurrent `meshfit predict`, another process
of the job) sees the old file or the new one, never half of one. Below every package (it needs
only meshfit.errors), so that run/, fit/ and watch/ write their files the same way."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator

from meshfit.errors import MeshfitError


@contextlib.contextmanager
def atomic_path(out: str, suffix: str = "", make_folder: bool = True) -> Iterator[str]:
    """A temporary path beside `out` (ending in `suffix`: Keras checks a file's extension) that
    replaces `out` only when the block succeeds; removed when it fails. Each caller, and each
    process of a job writing the same `out`, gets a path of its own. make_folder: create `out`'s
    folder where missing. A file that cannot be written is a one-line MeshfitError."""
    folder = os.path.dirname(os.path.abspath(out))
    try:
        if make_folder:
            os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".tmp-{os.path.basename(out)}-", suffix=suffix)
    except OSError as e:
        raise MeshfitError(f"cannot write {out} ({e}); choose a writable directory") from e
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        yield tmp
        try:
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; give it a normal file's mode
            os.replace(tmp, out)
        except OSError as e:
            raise MeshfitError(f"cannot write {out} ({e.strerror or e}); choose a writable "
                               "directory") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
