"""Dataset loaders: MNIST, Fashion-MNIST, CIFAR-10 and a user's folder of images.

Pure numpy + stdlib + Pillow (no keras, jax or tensorflow). Every loader returns a `Dataset` of
uint8 NHWC images (pixel values 0..255) and int32 labels, or raises `MeshfitError`: a file that is
truncated, corrupt or not in the expected format is never partly loaded.

Where `load` looks, in order: `data_dir`, `$MESHFIT_DATA`, `~/.keras/datasets`, the download
cache (`$MESHFIT_CACHE`, default `~/.cache/meshfit/datasets`); then it downloads from the canonical
address into the cache (once, under a lock file, whatever the number of processes sharing the
cache; see "downloading" below), unless `download=False` or `$MESHFIT_OFFLINE=1`. Inside each of those
root folders the layout is the one the canonical downloads unpack to:

    ROOT/mnist/{train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,
                t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz}  (or ROOT/mnist.npz, as keras)
    ROOT/fashion-mnist/  the same four names
    ROOT/cifar10/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}
                                                  (or ROOT/cifar-10-batches-py/, as keras)

A root may also be the dataset's own folder (e.g. `data_dir=".../mnist"`).

The arrays read once are kept as .npy files in `CACHE/unpacked/` and read from there while the
source files are unchanged (meshfit.data.unpacked).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from meshfit import env
from meshfit.data import FOLDER_VALIDATION_SPLIT, file_formats, folder_scan, image_files, order, unpacked
from meshfit.watch import progress
from meshfit.errors import MeshfitError

try:
    import fcntl  # POSIX: the download lock
except ImportError:
    fcntl = None

NAMES = ("mnist", "fashion_mnist", "cifar10")

CLASS_NAMES = {
    "mnist": tuple(str(i) for i in range(10)),
    "fashion_mnist": ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                      "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer",
                "dog", "frog", "horse", "ship", "truck"),
}

FOLDERS = {"mnist": "mnist", "fashion_mnist": "fashion-mnist", "cifar10": "cifar10"}

IDX_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
             "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_FILES = CIFAR_TRAIN + ("test_batch",)
CIFAR_DIR = "cifar-10-batches-py"

URLS = {
    "mnist": "https://storage.googleapis.com/cvdf-datasets/mnist/",
    # Zalando's own address is plain http; Keras' https mirror serves the same files (MD5-checked).
    "fashion_mnist": "https://storage.googleapis.com/tensorflow/tf-keras-datasets/",
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
}
CIFAR_TGZ_MD5 = "c58f30108f718f92721af3b95e74349a"

# (dataset, file name) -> (published MD5, published size in bytes)
PUBLISHED = {
    ("mnist", IDX_FILES[0]): ("f68b3c2dcbeaaa9fbdd348bbdeb94873", 9912422),
    ("mnist", IDX_FILES[1]): ("d53e105ee54ea40749a09fcbcd1e9432", 28881),
    ("mnist", IDX_FILES[2]): ("9fb629c4189551a2d022fa330f9573f3", 1648877),
    ("mnist", IDX_FILES[3]): ("ec29112dd5afa0611ce80d1b7f02629c", 4542),
    ("fashion_mnist", IDX_FILES[0]): ("8d4fb7e6c68d591d4c3dfef9ec88bf0d", 26421880),
    ("fashion_mnist", IDX_FILES[1]): ("25c81989df183df01b3e8a0aad5dffbe", 29515),
    ("fashion_mnist", IDX_FILES[2]): ("bef4ecab320f06d8554ea6380940ec79", 4422102),
    ("fashion_mnist", IDX_FILES[3]): ("bb300cfdad3c16e7a12a480ee83cd310", 5148),
}



@dataclass(frozen=True, eq=False)
class Dataset:
    """Images and labels split into train and test.

    x_*: uint8 arrays (N, H, W, C), pixel values 0..255; y_*: int32 arrays (N,) of class indices
    into `class_names`, or a regression's float32 targets (N, ...) with no class names. (eq=False:
    compared by identity, since numpy arrays have no single truth.)
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    class_names: tuple[str, ...]
    name: str

    def __post_init__(self) -> None:
        for x, y in ((self.x_train, self.y_train), (self.x_test, self.y_test)):
            labels = y.dtype == np.int32 and y.ndim == 1
            targets = y.dtype == np.float32 and not self.class_names
            if x.dtype != np.uint8 or x.ndim != 4 or not (labels or targets) or y.shape[:1] != x.shape[:1]:
                raise ValueError(f"bad Dataset arrays: x {x.dtype}{x.shape}, y {y.dtype}{y.shape}")

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(height, width, channels) of one image, in pixels."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    @property
    def num_classes(self) -> int:
        """Number of classes (labels are 0..num_classes-1)."""
        return len(self.class_names)


# ----------------------------------------------------------------------------------- public API

def check_data_dir(data_dir: str | os.PathLike | None) -> None:
    """A MeshfitError when `data_dir` (--data-dir) is given but is not a folder: a typo, named
    before any slow work (connecting, planning) instead of as a dataset not found after it."""
    if data_dir is None or os.path.isdir(data_dir):
        return
    what = "is a file, not a folder" if os.path.exists(data_dir) else "does not exist"
    raise MeshfitError(f"--data-dir {data_dir} {what}; give the folder that holds the dataset's "
                       "folder (e.g. DIR for DIR/fashion-mnist/), or leave --data-dir out to use "
                       "$MESHFIT_DATA, ~/.keras/datasets or a download", see="dataset-not-found")


def load(name: str, data_dir: str | os.PathLike | None = None, download: bool = True,
         verify: bool = True) -> Dataset:
    """Load "mnist", "fashion_mnist" (or "fashion-mnist") or "cifar10" as a `Dataset`.

    Searches data_dir, $MESHFIT_DATA, ~/.keras/datasets and the cache (see the module docstring),
    then downloads into the cache unless download=False or $MESHFIT_OFFLINE=1.

    Every file's structure is always checked (IDX magic numbers, dimensions, counts, complete
    gzip stream, label range; CIFAR shapes, dtype and counts). With verify=True an MNIST or
    Fashion-MNIST file that has its canonical name and exactly its published size must also match
    its published MD5: such a file claims to be the original, so a mismatch means corruption.
    Files of other sizes (e.g. small generated ones in tests) get the structural checks only.
    CIFAR-10 pickles are not checked by MD5 (rebuilt copies are valid but not byte-identical);
    with the full 50,000/10,000 images each class must have 5,000/1,000.
    """
    key = str(name).lower().replace("-", "_")
    if key not in NAMES:
        raise MeshfitError(f"unknown dataset {name!r}; valid names: {', '.join(NAMES)} "
                           "(or a folder of images, one sub-folder per class)")
    roots = _search_roots(data_dir)
    for _, root in roots:
        found = _find(key, root)
        if found:
            return _not_empty(_read_through_cache(key, found, verify), found)
    offline = env.is_set(env.OFFLINE)
    places = "; ".join(f"{label} ({root})" for label, root in roots)
    folder = FOLDERS[key] + ("/" + CIFAR_DIR if key == "cifar10" else "")
    hint = (f"put the files in DIR/{folder}/ (canonical layout) and pass --data-dir DIR "
            "or set MESHFIT_DATA=DIR")
    if not download or offline:
        why = "download=False" if not download else "MESHFIT_OFFLINE is set"
        raise MeshfitError(f"{key} not found in: {places}; downloads are off ({why}); {hint}",
                           see="dataset-not-found")
    try:
        found = _download_dataset(key, _cache_root())
    except (OSError, http.client.HTTPException) as e:
        raise MeshfitError(f"{key} not found in: {places}; downloading it from {URLS[key]} "
                           f"failed ({e}); {hint}", see="dataset-not-found") from e
    return _not_empty(_read_through_cache(key, found, verify), found)


def mnist(data_dir: str | os.PathLike | None = None, download: bool = True) -> Dataset:
    """MNIST digits: 60,000 train + 10,000 test 28x28x1 grey images, 10 classes."""
    return load("mnist", data_dir, download)


def fashion_mnist(data_dir: str | os.PathLike | None = None, download: bool = True) -> Dataset:
    """Fashion-MNIST: 60,000 train + 10,000 test 28x28x1 grey images of clothes, 10 classes."""
    return load("fashion_mnist", data_dir, download)


def cifar10(data_dir: str | os.PathLike | None = None, download: bool = True) -> Dataset:
    """CIFAR-10: 50,000 train + 10,000 test 32x32x3 RGB images, 10 classes."""
    return load("cifar10", data_dir, download)


def image_folder(path: str | os.PathLike, image_size: tuple[int, int],
                 validation_split: float = FOLDER_VALIDATION_SPLIT, seed: int = order.DEFAULT_SEED,
                 channels: int = 3) -> Dataset:
    """A user's images, one sub-folder per class, loaded whole into memory as a `Dataset`.

    For folders that fit in memory; `meshfit train --data` and recipes naming a folder stream them
    from disk instead. Files, conversions (RGB for channels=3, grey for 1; resized bilinear to
    image_size = (height, width) pixels) and the split are meshfit.data.folders's: unreadable files
    are skipped with a warning, and in every class round(n * validation_split) images chosen with
    `seed` go to x_test/y_test. Both splits are then shuffled with `seed`.
    """
    size = image_files.check_image_size(image_size, channels)
    if not 0.0 <= validation_split < 1.0:
        raise MeshfitError(f"validation_split must be in [0, 1), got {validation_split}")
    found = folder_scan.scan(path)
    train, held = folder_scan.split(found, validation_split, seed)
    rng = np.random.default_rng(seed)

    def arrays(folder):
        order = rng.permutation(len(folder)) if folder is not None else np.zeros(0, np.int64)
        x = np.empty((len(order), *size, channels), np.uint8)
        for row, i in enumerate(order):
            image_files.load_image(folder.files[i], size, channels, out=x[row])
        return x, (folder.labels[order] if folder is not None else np.zeros(0, np.int32))

    (x_train, y_train), (x_test, y_test) = arrays(train), arrays(held)
    return Dataset(x_train, y_train, x_test, y_test, found.class_names,
                   os.path.basename(found.root))


# ----------------------------------------------------------------------------------- finding

def _search_roots(data_dir) -> list[tuple[str, str]]:
    """(label for messages, folder) pairs in search order."""
    roots = []
    if data_dir is not None:
        roots.append(("data_dir", os.path.abspath(os.fspath(data_dir))))
    if os.environ.get(env.DATA):
        roots.append(("$MESHFIT_DATA", os.path.abspath(os.environ[env.DATA])))
    roots.append(("~/.keras/datasets", os.path.expanduser("~/.keras/datasets")))
    roots.append(("download cache", _cache_root()))
    return roots


def _cache_root() -> str:
    return os.path.abspath(os.environ.get(env.CACHE)
                           or os.path.expanduser("~/.cache/meshfit/datasets"))


def _find(key: str, root: str) -> str | None:
    """The dataset's folder (or mnist.npz) under root, or None."""
    if key == "cifar10":
        for d in (os.path.join(root, "cifar10", CIFAR_DIR), os.path.join(root, CIFAR_DIR), root):
            if all(os.path.isfile(os.path.join(d, f)) for f in CIFAR_FILES):
                return d
        return None
    candidates = [os.path.join(root, FOLDERS[key])]
    # root itself may be the dataset's folder, but not a folder named after the other IDX dataset
    # (so that data_dir=".../fashion-mnist" is not read as MNIST).
    if os.path.basename(root) not in {v for k, v in FOLDERS.items() if k != key}:
        candidates.append(root)
    for d in candidates:
        if all(os.path.isfile(os.path.join(d, f)) for f in IDX_FILES):
            return d
    if key == "mnist" and os.path.isfile(os.path.join(root, "mnist.npz")):
        return os.path.join(root, "mnist.npz")
    return None


# ----------------------------------------------------------------------------------- reading

def _not_empty(dataset: Dataset, found: str) -> Dataset:
    """`dataset`, unless its training or test split has no images."""
    for x, split in ((dataset.x_train, "training"), (dataset.x_test, "test")):
        if not len(x):
            raise MeshfitError(f"{found} has no {split} images; put the full dataset there")
    return dataset


def _sources(key: str, found: str) -> list[str]:
    """The files `_read` reads for the dataset found at `found`."""
    if found.endswith(".npz"):
        return [found]
    names = IDX_FILES if key != "cifar10" else CIFAR_FILES + ("batches.meta",)
    return [os.path.join(found, n) for n in names if os.path.isfile(os.path.join(found, n))]


def _read_through_cache(key: str, found: str, verify: bool) -> Dataset:
    """`_read(key, found, verify)`, or its arrays kept when these source files were read before
    with the same checks (meshfit.data.unpacked)."""
    checks = sorted((k, v) for k, v in PUBLISHED.items() if k[0] == key) if verify else []
    return unpacked.read_through(os.path.join(_cache_root(), "unpacked"), key, _sources(key, found),
                                 checks, read=lambda: _read(key, found, verify),
                                 make=lambda arrays, names: Dataset(*arrays, names, key))


def _read(key: str, found: str, verify: bool) -> Dataset:
    if found.endswith(".npz"):
        return _read_npz(found)
    if key == "cifar10":
        return _read_cifar(found)
    paths = [os.path.join(found, f) for f in IDX_FILES]
    x_train, y_train, x_test, y_test = (
        file_formats.read_idx(p, 3 if "images" in os.path.basename(p) else 1,
                               PUBLISHED.get((key, os.path.basename(p))), verify) for p in paths)
    for x, y, xp, yp in ((x_train, y_train, paths[0], paths[1]),
                         (x_test, y_test, paths[2], paths[3])):
        if len(x) != len(y):
            raise MeshfitError(f"{xp} has {len(x)} images but {yp} has {len(y)} labels; "
                               "delete both and download them again")
        if y.size and y.max() >= 10:
            raise file_formats.corrupt(yp, f"label {y.max()} is not a class index 0..9")
    return Dataset(x_train[..., None], y_train.astype(np.int32), x_test[..., None],
                   y_test.astype(np.int32), CLASS_NAMES[key], key)


def _read_npz(path: str) -> Dataset:
    """Read keras's mnist.npz (x_train, y_train, x_test, y_test)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = [z[k] for k in ("x_train", "y_train", "x_test", "y_test")]
    except Exception as e:  # zipfile, numpy and OS errors of many kinds
        raise file_formats.corrupt(path, f"cannot read it as mnist.npz ({e})") from e
    x_train, y_train, x_test, y_test = arrays
    for x, y in ((x_train, y_train), (x_test, y_test)):
        if x.dtype != np.uint8 or x.ndim != 3 or y.shape != x.shape[:1] or y.min(initial=0) < 0 \
                or y.max(initial=0) >= 10:
            raise file_formats.corrupt(path, f"unexpected arrays x {x.dtype}{x.shape}, y {y.dtype}{y.shape}")
    return Dataset(x_train[..., None], y_train.astype(np.int32), x_test[..., None],
                   y_test.astype(np.int32), CLASS_NAMES["mnist"], "mnist")


def _read_cifar(folder: str) -> Dataset:
    class_names = CLASS_NAMES["cifar10"]
    meta = os.path.join(folder, "batches.meta")
    if os.path.isfile(meta):
        names = file_formats.load_pickle(meta).get(b"label_names")
        if not isinstance(names, list) or not names or \
                not all(isinstance(n, bytes) for n in names):
            raise file_formats.corrupt(meta, "b'label_names' is not a list of names")
        class_names = tuple(n.decode("utf-8", "replace") for n in names)
    train = [file_formats.read_cifar_batch(os.path.join(folder, f)) for f in CIFAR_TRAIN]
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])
    x_test, y_test = file_formats.read_cifar_batch(os.path.join(folder, "test_batch"))
    k = len(class_names)
    for y, full, what in ((y_train, 50000, "data_batch_1..5"), (y_test, 10000, "test_batch")):
        if y.size and (y.min() < 0 or y.max() >= k):
            raise file_formats.corrupt(os.path.join(folder, what),
                           f"labels outside 0..{k - 1} ({k} class names)")
        counts = np.bincount(y, minlength=k)
        if len(y) == full and not (counts == full // k).all():
            raise file_formats.corrupt(os.path.join(folder, what),
                           f"class counts {counts.tolist()}, expected {full // k} each")
    return Dataset(np.ascontiguousarray(x_train), y_train.astype(np.int32),
                   np.ascontiguousarray(x_test), y_test.astype(np.int32), class_names, "cifar10")


# ----------------------------------------------------------------------------------- downloading
#
# Downloads go into the cache under a lock file (cache/.<dataset>.lock), so processes sharing a
# cache (the processes of a multi-host job on one host, or independent runs) download once: the
# first takes the lock and downloads, the others wait and then find the files. Each file is
# written to a temporary name beside its final one, checked (size cap, MD5) and renamed, so a
# killed download leaves only temporary files, which the next download removes.

DOWNLOAD_PREFIX, EXTRACT_PREFIX = ".download-", ".extract-"
MAX_DOWNLOAD_BYTES = 256 * 2**20  # a cap for files of no published size (CIFAR-10: 163 MiB)
CIFAR_TGZ_BYTES = 170498071


def _download(url: str, dest: str, md5: str, max_bytes: int = MAX_DOWNLOAD_BYTES) -> None:
    """Download url to dest via a temporary file and an atomic rename, checking size and MD5.

    max_bytes: more than this many bytes (announced or received) fails the download.
    """
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=DOWNLOAD_PREFIX)
    h, done = hashlib.md5(), 0
    try:
        with os.fdopen(fd, "wb") as f, urllib.request.urlopen(url, timeout=60) as r:
            total = int(r.headers.get("Content-Length") or 0)
            if total > max_bytes:
                raise OSError(f"it is {total} bytes, more than the {max_bytes} expected")
            print(f"downloading {url}" + (f" ({total / 1e6:.1f} MB)" if total else ""),
                  file=sys.stderr, flush=True)
            with progress.task("downloading", total=total or None, data_bytes=True) as advance:
                while chunk := r.read(1 << 20):
                    done += len(chunk)
                    if done > max_bytes:
                        raise OSError(f"it sent more than the {max_bytes} bytes expected")
                    f.write(chunk)
                    h.update(chunk)
                    advance(len(chunk))
            f.flush()
            os.fsync(f.fileno())
        if h.hexdigest() != md5:
            raise OSError(f"downloaded file has MD5 {h.hexdigest()}, expected {md5}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def _cache_lock(cache: str, key: str) -> Iterator[None]:
    """Hold cache/.<key>.lock while inside (an flock; no lock where fcntl is missing)."""
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, f".{key}.lock"), "a") as f:
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"waiting for another process downloading {key} into {cache}",
                      file=sys.stderr, flush=True)
                fcntl.flock(f, fcntl.LOCK_EX)
        yield  # the lock goes with the file's closing


def _remove_leftovers(folder: str) -> None:
    """Temporary files of downloads and extractions that were killed (call under the lock)."""
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.startswith((DOWNLOAD_PREFIX, EXTRACT_PREFIX)):
                path = os.path.join(folder, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _download_dataset(key: str, cache: str) -> str:
    """Download the dataset into cache/<folder>/ (once, under the cache's lock); return where
    _find finds it."""
    with _cache_lock(cache, key):
        found = _find(key, cache)  # another process may have downloaded it while this one waited
        if found:
            return found
        _remove_leftovers(os.path.join(cache, FOLDERS[key]))
        return _fetch(key, cache)


def _fetch(key: str, cache: str) -> str:
    if key != "cifar10":
        folder = os.path.join(cache, FOLDERS[key])
        for f in IDX_FILES:
            if not os.path.isfile(os.path.join(folder, f)):
                md5, size = PUBLISHED[(key, f)]
                _download(URLS[key] + f, os.path.join(folder, f), md5, size or MAX_DOWNLOAD_BYTES)
        return folder
    parent = os.path.join(cache, "cifar10")
    tgz = os.path.join(parent, "cifar-10-python.tar.gz")
    _download(URLS[key], tgz, CIFAR_TGZ_MD5, CIFAR_TGZ_BYTES)
    tmp = tempfile.mkdtemp(dir=parent, prefix=EXTRACT_PREFIX)
    try:
        with tarfile.open(tgz, "r:gz") as tar:
            for m in tar.getmembers():  # only plain files and folders inside the target
                if not (m.isfile() or m.isdir()) or m.name.startswith("/") \
                        or ".." in m.name.split("/"):
                    raise OSError(f"unsafe entry {m.name!r} in {tgz}")
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, **safe)
        target = os.path.join(parent, CIFAR_DIR)
        if os.path.isdir(target):  # an incomplete copy: _find did not take it
            shutil.rmtree(target)
        os.replace(os.path.join(tmp, CIFAR_DIR), target)
    except tarfile.TarError as e:
        raise OSError(f"cannot extract {tgz}: {e}") from e
    finally:
        os.remove(tgz)
        shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(parent, CIFAR_DIR)
