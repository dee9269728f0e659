"""The canonical files of the built-in datasets, read and written: gzipped IDX (MNIST,
Fashion-MNIST) and CIFAR-10's Python pickles. Readers check every file's structure and raise
MeshfitError (`corrupt`) for one that is truncated, corrupt or not in the format: nothing is ever
partly loaded. Pickles are loaded by an unpickler that builds numpy arrays and nothing else.
Pure numpy and the standard library.
"""

from __future__ import annotations

import gzip
import hashlib
import math
import os
import pickle
import struct
import zlib

import numpy as np

from meshfit.errors import MeshfitError

MAX_IDX_BYTES = 1 << 30  # an IDX file larger than this (20x MNIST's 47 MB) is refused, unpacked or not


def corrupt(path: str, what: str) -> MeshfitError:
    return MeshfitError(f"{path} is corrupt or truncated: {what}; delete it so that it is "
                        "downloaded again (or copy a good one there)")


def read_idx(path: str, ndim: int, published: tuple[str, int] | None, verify: bool) -> np.ndarray:
    """Read a gzipped IDX file of uint8 values with ndim dimensions, checking its structure;
    published: the file's published (MD5, size), checked where verify and the size is that one."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_IDX_BYTES + 1)
    except OSError as e:
        raise MeshfitError(f"cannot read {path} ({e.strerror}); make it readable or use "
                           "--data-dir with a copy you can read") from None
    if len(raw) > MAX_IDX_BYTES:
        raise corrupt(path, f"larger than {MAX_IDX_BYTES >> 20} MB")
    md5, size = published or (None, None)
    if verify and len(raw) == size and hashlib.md5(raw).hexdigest() != md5:
        raise corrupt(path, f"MD5 {hashlib.md5(raw).hexdigest()} is not the published {md5}")
    data = gunzip_idx(path, raw, ndim)
    offset = 4 + 4 * ndim
    dims = struct.unpack(f">{ndim}I", data[4:offset])
    if ndim == 3 and dims[1:] != (28, 28):
        raise corrupt(path, f"images are {dims[1]}x{dims[2]}, not 28x28")
    return np.frombuffer(data, np.uint8, offset=offset).reshape(dims).copy()


def gunzip_idx(path: str, raw: bytes, ndim: int) -> bytes:
    """The IDX bytes of a gzip file, unpacked no further than its header's dimensions say (so a
    small file that unpacks to gigabytes is refused early); the magic number and size checked."""
    unpack = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    offset = 4 + 4 * ndim
    try:
        header = unpack.decompress(raw, offset)
        magic = bytes([0, 0, 0x08, ndim])
        if header[:4] != magic:
            raise corrupt(path, f"wrong magic number {header[:4].hex()} (expected {magic.hex()})")
        if len(header) < offset:
            raise corrupt(path, "header is cut short")
        size = math.prod(struct.unpack(f">{ndim}I", header[4:offset]))  # Python ints: no overflow
        if size > MAX_IDX_BYTES:
            raise corrupt(path, f"its header claims {size:,} bytes of data, more than "
                                 f"{MAX_IDX_BYTES >> 20} MB")
        body = unpack.decompress(unpack.unconsumed_tail, size + 1)
        body += unpack.decompress(unpack.unconsumed_tail, 1) if len(body) <= size else b""
    except zlib.error as e:
        raise corrupt(path, f"not a complete gzip file ({e})") from None
    dims = struct.unpack(f">{ndim}I", header[4:offset])
    if len(body) != size:
        got = "more than" if len(body) > size else f"{len(body)}, not"
        raise corrupt(path, f"{got} {size} data bytes for dimensions {dims}")
    if not unpack.eof or unpack.unused_data.strip(b"\0"):
        raise corrupt(path, "not a complete gzip file (its end is missing or followed by data)")
    return header + body


class NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that builds numpy arrays but refuses any other object (no code execution)."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def load_pickle(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            d = NumpyOnlyUnpickler(f, encoding="bytes").load()
    except Exception as e:  # pickle raises many kinds (UnpicklingError, EOFError, ValueError...)
        raise corrupt(path, f"cannot unpickle it ({type(e).__name__}: {e})") from e
    if not isinstance(d, dict):
        raise corrupt(path, "the pickle is not a dict")
    return d


def read_cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    d = load_pickle(path)
    data, labels = d.get(b"data"), d.get(b"labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3072:
        what = f"{data.dtype}{data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise corrupt(path, f"b'data' is {what}, expected uint8 (N, 3072)")
    try:
        y = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise corrupt(path, "b'labels' is not a list of integers of 64 bits") from e
    if y.shape != (len(data),):
        raise corrupt(path, f"{len(data)} images but b'labels' has shape {y.shape}")
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), y


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (gzip-compressed when path ends in .gz)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    data = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data += array.tobytes()
    with open(path, "wb") as f:
        f.write(gzip.compress(data) if os.fspath(path).endswith(".gz") else data)


def write_cifar_batch(path: str | os.PathLike, x: np.ndarray, y, label_names=None) -> None:
    """Write images x (N, 32, 32, 3) uint8 and labels y as a CIFAR-10 Python batch pickle.

    With label_names, also write batches.meta in the same folder.
    """
    x = np.asarray(x, dtype=np.uint8)
    batch = {b"batch_label": b"generated batch", b"labels": [int(v) for v in y],
             b"data": x.transpose(0, 3, 1, 2).reshape(len(x), -1),
             b"filenames": [f"{i}.png".encode() for i in range(len(x))]}
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)
    if label_names is not None:
        meta = {b"label_names": [n.encode() for n in label_names],
                b"num_cases_per_batch": len(x), b"num_vis": 3072}
        with open(os.path.join(os.path.dirname(os.fspath(path)), "batches.meta"), "wb") as f:
            pickle.dump(meta, f, protocol=2)
