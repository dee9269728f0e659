"""Image folders streamed from disk: batches decoded as they are needed, never the folder whole.

A folder holds one sub-folder per class (sorted names are the classes); images may sit in nested
folders below a class folder. `scan` lists the files and checks each one's header (Pillow's
`Image.open`, no pixel decoding); `layout` finds or makes the train / validation / test split.

Bad data, decided once:
  - a file whose suffix is not in IMAGE_EXTENSIONS, or whose header Pillow cannot read (corrupt,
    truncated before its size, not an image): skipped at scan and listed in `Folder.skipped`
    with the reason; hidden files (".name") are ignored;
  - a file whose header reads but whose pixels do not decode: a one-line MeshfitError naming the
    file when its batch is decoded (the scan does not decode pixels, to stay cheap);
  - a missing folder, no class folders, a class folder left with no readable image, or a single
    class: a one-line MeshfitError saying what to do;
  - every mode is converted: grey and palette images to RGB (channels=3) or L (channels=1);
    transparency (RGBA, LA, palette with a transparent colour) composited on white; 16-bit
    images (I;16, I) scaled to 8 bits (value >> 8), not clipped; CMYK and YCbCr through Pillow;
    animated GIF / WebP: the first frame. Images are resized to image_size (bilinear, Pillow)
    unless already that size; a JPEG at least twice as large in both directions is first decoded
    at a reduced scale (libjpeg's DCT scaling, as Pillow's draft mode; slightly different from a
    full decode then resize).
JPEGs are decoded by libjpeg-turbo through simplejpeg, which needs no GIL (the same pixels as
Pillow for RGB; for channels=1 libjpeg's luma channel, which can differ from Pillow's
convert("L") of the decoded RGB by a few levels where the colour subsampling blurs, e.g. 6 on
noise). Small PNGs (at most SMALL_PNG_PIXELS, 8-bit grey or RGB, no transparency) are decoded by
libspng through pyspng: the same pixels as Pillow for an eighth of the CPU time (9 vs 72 us for a
28x28 digit, where Pillow's per-call overhead dominates). pyspng holds the GIL while it decodes,
so larger PNGs go through Pillow, which decodes in parallel threads. Every other file, CMYK JPEGs
and files these decoders refuse go through Pillow too.

Training batches follow arrays.TrainBatches exactly: epoch e visits the files in the
permutation drawn from (seed, e), `steps_per_epoch` global batches, the last partial one
dropped; flip-crop parameters come from (seed, epoch, step). So batch (epoch, step) is a pure
function of (seed, epoch, step), and equals TrainBatches' batch on the same images in memory.

Decoding runs on a pool of threads (simplejpeg and Pillow release the GIL while they decode and
resize; one thread for images too cheap to gain from more, see _Decoder), a few images per task,
with PREFETCH_BATCHES batches decoded ahead of the one being used: memory holds a few batches,
whatever the folder's size. (Measured against Grain and tf.data: BENCHMARKS.md,
"Input pipeline: image folders".) In a job of several processes each process decodes only its
own rows of every global batch (cluster.local_rows).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import io
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from meshfit.data import arrays, order
from meshfit.errors import MeshfitError
from meshfit.parallel import cluster
from meshfit.data.arrays import CROP_PADDING

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
PREFETCH_BATCHES = 2  # batches decoded ahead of the one being used
MAX_CHUNK = 32  # images per decoding task at most
MEASURED_IMAGES = 256  # images decoded on one thread before choosing the number of threads
CHEAP_IMAGE_SECONDS = 100e-6  # CPU time per image below which decoding stays on one thread
HEADER_BYTES = 65536  # bytes read at scan to check a JPEG's header
READ_BYTES = 1 << 20  # a file is read in pieces of this many bytes
SMALL_PNG_PIXELS = 64 * 64  # larger PNGs go through Pillow (pyspng holds the GIL while it decodes)
SPLIT_NAMES = {"train": ("train",), "validation": ("val", "validation"), "test": ("test",)}


@dataclass(frozen=True, eq=False)
class Folder:
    """The images of a folder of class sub-folders.

    root: absolute path scanned; class_names: sorted class folder names; files: absolute paths
    sorted by (class, path in the class folder); labels: int32 (N,) indices into class_names;
    skipped: (path, reason) of the files left out at scan (a subset keeps its parent's).
    """

    root: str
    class_names: tuple[str, ...]
    files: tuple[str, ...]
    labels: np.ndarray
    skipped: tuple[tuple[str, str], ...] = ()

    def __len__(self) -> int:
        return len(self.files)

    def subset(self, indices: Sequence[int]) -> "Folder":
        """The same classes with only the files at `indices` (in that order)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        return Folder(self.root, self.class_names, tuple(self.files[i] for i in indices),
                      self.labels[indices], self.skipped)


# ----------------------------------------------------------------------------------- scanning

def check_folder(path: str | os.PathLike) -> str:
    """`path` made absolute; a MeshfitError where it is not a folder (`--data` is checked so before
    the devices connect)."""
    root = os.path.abspath(os.fspath(path))
    if not os.path.isdir(root):
        raise MeshfitError(f"image folder {root} does not exist or is not a folder; give a folder "
                           "with one sub-folder of images per class")
    return root


def scan(path: str | os.PathLike, class_names: tuple[str, ...] | None = None) -> Folder:
    """The image files of `path`, one sub-folder per class; header-checked (see the module docstring).

    class_names: the classes this folder must have (a test/ or val/ folder next to train/).
    """
    root = check_folder(path)
    classes = tuple(sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith(".")))
    if not classes:
        raise MeshfitError(f"{root} has no class sub-folders; put each class's images in "
                           f"{root}/<class name>/")
    if class_names is not None and classes != tuple(class_names):
        raise MeshfitError(f"{root} has the class folders {', '.join(classes)} but the training "
                           f"folder has {', '.join(class_names)}; use the same class sub-folders")
    if len(classes) == 1:
        raise MeshfitError(f"{root} has a single class folder ({classes[0]}); a classifier needs "
                           f"at least two: put each class's images in its own sub-folder of {root}")
    files, labels, skipped = [], [], []
    for label, name in enumerate(classes):
        found, left_out = _class_files(os.path.join(root, name))
        if not found:
            why = f" ({len(left_out)} file(s) skipped: unreadable or not images)" if left_out else ""
            raise MeshfitError(f"class folder {os.path.join(root, name)} has no readable images{why}; "
                               f"add {', '.join(IMAGE_EXTENSIONS)} files or remove the folder")
        files += found
        labels += [label] * len(found)
        skipped += left_out
    if skipped:
        images = [(p, why) for p, why in skipped if why.startswith("unreadable")]
        path, why = (images or skipped)[0]
        warnings.warn(f"skipped {len(skipped)} file(s) of {root} that are not readable images "
                      f"({len(images)} unreadable image(s)); e.g. {path}: {why}", stacklevel=2)
    return Folder(root, classes, tuple(files), np.asarray(labels, dtype=np.int32), tuple(skipped))


def _class_files(folder: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(readable image files, skipped (path, reason)) under one class folder, sorted by path."""
    candidates, skipped = [], []
    for directory, subdirs, names in os.walk(folder, followlinks=True):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        for name in names:
            path = os.path.join(directory, name)
            if name.startswith("."):
                continue
            if name.lower().endswith(IMAGE_EXTENSIONS):
                candidates.append(path)
            else:
                skipped.append((path, "not an image file (suffix)"))
    with concurrent.futures.ThreadPoolExecutor(default_workers()) as pool:
        problems = list(pool.map(_header_problem, candidates, chunksize=64))
    found = [p for p, problem in zip(candidates, problems) if problem is None]
    skipped += [(p, problem) for p, problem in zip(candidates, problems) if problem is not None]
    return sorted(found), sorted(skipped)  # paths under one folder: sorted as their names


def _header_problem(path: str) -> str | None:
    """Why the header of `path` cannot be read as an image, or None when it can."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if head[:3] == b"\xff\xd8\xff" and _jpeg_header_size(head):
            return None
        with Image.open(path) as im:
            if im.width < 1 or im.height < 1:
                return "empty image (0 pixels)"
    except Exception as e:  # Pillow raises many kinds (UnidentifiedImageError, OSError, SyntaxError...)
        return f"unreadable image: {_reason(e)}"
    return None


def _jpeg_header_size(head: bytes) -> tuple[int, int] | None:
    """(height, width) from the start of a JPEG file via simplejpeg; None if it cannot tell."""
    try:
        import simplejpeg

        height, width, _, _ = simplejpeg.decode_jpeg_header(head)
    except (ImportError, ValueError):
        return None
    return (height, width) if height > 0 and width > 0 else None


def _reason(error: Exception) -> str:
    from PIL import UnidentifiedImageError

    if isinstance(error, UnidentifiedImageError):  # its text names an in-memory buffer, not the file
        return "not an image file: no PNG, JPEG, BMP, GIF, WebP or other format Pillow reads"
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def layout(path: str | os.PathLike, validation_split: float, seed: int) -> dict[str, Folder | None]:
    """{"train", "validation", "test"}: the folders to train, validate and test on.

    A folder with train/ and test/ and/or val/ (or validation/) sub-folders is used as given;
    without val/, validation_split then splits train/. Otherwise the folder itself is split: in
    each class round(n * validation_split) files (half up, at least one left in train), chosen
    with `seed`, go to validation, and "test" is None. validation_split 0: no validation.
    """
    if not 0.0 <= validation_split < 1.0:
        raise MeshfitError(f"validation_split must be in [0, 1), got {validation_split}")
    root = os.path.abspath(os.fspath(path))
    splits = {key: next((os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))), None)
              for key, names in SPLIT_NAMES.items()}
    if splits["train"] and (splits["validation"] or splits["test"]):
        train = scan(splits["train"])
        test = scan(splits["test"], train.class_names) if splits["test"] else None
        if splits["validation"]:
            return {"train": train, "validation": scan(splits["validation"], train.class_names),
                    "test": test}
        train, validation = split(train, validation_split, seed)
        return {"train": train, "validation": validation, "test": test}
    train, validation = split(scan(root), validation_split, seed)
    return {"train": train, "validation": validation, "test": None}


def split(folder: Folder, fraction: float, seed: int) -> tuple[Folder, Folder | None]:
    """(train, validation): per class, round(n * fraction) files chosen with `seed` to validation."""
    if fraction <= 0:
        return folder, None
    rng = np.random.default_rng(seed)
    held = []
    for label in range(len(folder.class_names)):
        members = np.flatnonzero(folder.labels == label)
        count = min(int(len(members) * fraction + 0.5), len(members) - 1)
        held += list(members[rng.permutation(len(members))[:count]])
    held = np.sort(np.asarray(held, dtype=np.int64))
    kept = np.setdiff1d(np.arange(len(folder)), held)
    return folder.subset(kept), (folder.subset(held) if len(held) else None)


# ----------------------------------------------------------------------------------- decoding

def load_image(path: str, image_size: tuple[int, int], channels: int,
               out: np.ndarray | None = None) -> np.ndarray:
    """One image as uint8 (height, width, channels), converted and resized as the module says;
    written into `out` when given (an array of that shape)."""
    height, width = image_size
    if out is None:
        out = np.empty((height, width, channels), np.uint8)
    try:
        data = _read(path)
        if data[:3] == b"\xff\xd8\xff":
            decoded = _decode_jpeg(data, out)
        else:
            decoded = data[:8] == PNG_SIGNATURE and _decode_png(data, out)
        if not decoded:
            _decode_with_pillow(data, out)
    except Exception as e:  # Pillow raises many kinds (OSError, SyntaxError, ValueError...)
        raise MeshfitError(f"cannot read image {path} ({_reason(e)}); fix or remove it") from None
    return out


def _read(path: str) -> bytes:
    """A file's bytes, with os.read: half the CPU time of open().read() for small files."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size + 1)
        if len(data) == size:  # the whole file, the usual case
            return data
        chunks = [data]  # a short read, or a file that grew: read on to its end
        while chunk := os.read(fd, READ_BYTES):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _check_pixels(width: int, height: int) -> None:
    """A ValueError for an image of more pixels than Pillow's MAX_IMAGE_PIXELS (a decompression
    bomb: a small file that would decode to gigabytes)."""
    from PIL import Image

    if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
        raise ValueError(f"{width}x{height} pixels, more than the {Image.MAX_IMAGE_PIXELS:,} "
                         "allowed (PIL.Image.MAX_IMAGE_PIXELS)")


def _decode_jpeg(data: bytes, out: np.ndarray) -> bool:
    """Decode a JPEG into `out` with libjpeg-turbo (simplejpeg, without the GIL); False where
    Pillow must do it (no simplejpeg, CMYK, or data simplejpeg refuses)."""
    try:
        import simplejpeg
    except ImportError:
        return False
    height, width, channels = out.shape
    try:
        rows, cols, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return False  # e.g. a truncated file: Pillow decodes it or names the problem
    _check_pixels(cols, rows)
    try:
        if colorspace not in ("Gray", "YCbCr", "RGB"):
            return False  # CMYK, YCCK: Pillow converts them
        space = "RGB" if channels == 3 else "GRAY"
        if (rows, cols) == (height, width):
            simplejpeg.decode_jpeg(data, space, buffer=out)
            return True
        scaled = rows >= 2 * height and cols >= 2 * width  # DCT scaling, as Pillow's draft mode
        array = simplejpeg.decode_jpeg(data, space, min_height=height if scaled else 0,
                                       min_width=width if scaled else 0)
    except ValueError:
        return False  # e.g. a truncated file: Pillow decodes it or names the problem
    _resize(array, out)
    return True


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_GREY, _PNG_RGB = 0, 2  # IHDR colour types pyspng decodes here


def _decode_png(data: bytes, out: np.ndarray) -> bool:
    """Decode an 8-bit grey or RGB PNG without transparency into `out` with libspng (pyspng);
    False where Pillow must do it (no pyspng, other colour types or depths, transparency, RGB to
    grey, or data libspng refuses)."""
    try:
        import pyspng
    except ImportError:
        return False
    if len(data) < 33 or data[12:16] != b"IHDR" or data[24] != 8 or b"tRNS" in data:
        return False
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    _check_pixels(width, height)
    if width * height > SMALL_PNG_PIXELS:
        return False  # Pillow: it decodes without the GIL, so in parallel threads
    colour = data[25]
    channels = out.shape[2]
    if colour not in (_PNG_GREY, _PNG_RGB) or (colour == _PNG_RGB and channels == 1):
        return False  # Pillow's luma for RGB to grey
    try:
        array = pyspng.load(data)
    except (RuntimeError, ValueError):
        return False  # e.g. a truncated file: Pillow decodes it or names the problem
    if array.ndim == 2:
        array = array[..., None]
    if channels == 3 and array.shape[2] == 1:
        array = np.repeat(array, 3, axis=2)
    if array.shape == out.shape:
        out[...] = array
    else:
        _resize(array, out)
    return True


def _decode_with_pillow(data: bytes, out: np.ndarray) -> None:
    from PIL import Image

    height, width, channels = out.shape
    with Image.open(io.BytesIO(data)) as im:
        _check_pixels(im.width, im.height)
        if im.format == "JPEG" and im.width >= 2 * width and im.height >= 2 * height:
            im.draft(None, (width, height))
        im = _convert(im, "RGB" if channels == 3 else "L")
        if im.size != (width, height):
            im = im.resize((width, height), Image.Resampling.BILINEAR)
        out[...] = np.asarray(im, dtype=np.uint8).reshape(out.shape)


def _resize(array: np.ndarray, out: np.ndarray) -> None:
    """`array` (h, w, c) resized bilinearly into `out` (H, W, c) with Pillow."""
    from PIL import Image

    height, width, channels = out.shape
    image = Image.fromarray(array[..., 0] if channels == 1 else array)
    out[...] = np.asarray(image.resize((width, height), Image.Resampling.BILINEAR)).reshape(out.shape)


def _convert(im, mode: str):
    """`im` in `mode` ("RGB" or "L"): 16-bit scaled to 8 bits, transparency composited on white."""
    from PIL import Image

    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        im = Image.fromarray((np.clip(np.asarray(im), 0, 65535) >> 8).astype(np.uint8), "L")
    elif im.mode == "F":
        im = Image.fromarray(np.clip(np.asarray(im), 0, 255).astype(np.uint8), "L")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = Image.alpha_composite(white, im.convert("RGBA"))
    return im if im.mode == mode else im.convert(mode)


def default_workers() -> int:
    """Decoding threads: one per core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class _Decoder:
    """Decodes lists of files into uint8 batches on a thread pool, a few images per task.

    workers: threads; by default one until MEASURED_IMAGES images are decoded, then one per core
    if an image took at least CHEAP_IMAGE_SECONDS of CPU time. Cheaper images (small PNGs, tiny
    JPEGs) stay on one thread: their time goes mostly to Python code that holds the GIL, and a
    second thread only contends for it (28x28 PNG digits on 2 cores: 38 CPU-us and 27,000
    images/s on one thread, 76 CPU-us and 16,000 images/s on two).
    """

    def __init__(self, image_size: tuple[int, int], channels: int, workers: int | None):
        self.image_size, self.channels = image_size, channels
        self.workers = max(1, int(workers)) if workers else 1
        self._adapt = not workers and default_workers() > 1
        self._costs: list[tuple[float, int]] = []  # (thread CPU seconds, images) of decoded chunks
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        """The pool, grown to one thread per core once decoding proves costly enough."""
        if self._adapt and sum(n for _, n in self._costs) >= MEASURED_IMAGES:
            self._adapt = False
            seconds = sum(t for t, _ in self._costs) / sum(n for _, n in self._costs)
            if seconds >= CHEAP_IMAGE_SECONDS:
                self.workers = default_workers()
                if self._pool is not None:
                    self._pool.shutdown(wait=False)  # its queued tasks still run
                self._pool = None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, "meshfit-decode")
        return self._pool

    def submit(self, files: Sequence[str], rows: int | None = None,
               transform: Callable[[np.ndarray, slice], np.ndarray] | None = None) -> Callable[[], np.ndarray]:
        """Start decoding `files` into an array of `rows` images (zeros after the files); returns a
        function that waits and gives the array. transform(images, rows) rewrites a decoded chunk."""
        pool = self._threads()
        out = np.zeros((rows or len(files), *self.image_size, self.channels), np.uint8)
        chunk = max(1, min(MAX_CHUNK, -(-len(files) // (2 * self.workers))))
        futures = [pool.submit(self._decode, files, slice(i, min(i + chunk, len(files))), out, transform)
                   for i in range(0, len(files), chunk)]

        def result() -> np.ndarray:
            try:
                for future in futures:
                    future.result()
            finally:
                for future in futures:
                    future.cancel()
            return out

        result.cancel = lambda: [f.cancel() for f in futures]
        return result

    def _decode(self, files, where: slice, out: np.ndarray, transform) -> None:
        started = time.thread_time()
        for i in range(where.start, where.stop):
            load_image(files[i], self.image_size, self.channels, out[i])
        if self._adapt:
            self._costs.append((time.thread_time() - started, where.stop - where.start))
        if transform is not None:
            out[where] = transform(out[where], where)


def _prefetched(jobs: Iterator[Callable[[], Any]], depth: int) -> Iterator[Any]:
    """The results of `jobs` (started functions returning their result) in order, `depth` ahead."""
    pending: collections.deque = collections.deque()
    try:
        while True:
            while len(pending) <= depth:
                job = next(jobs, None)
                if job is None:
                    break
                pending.append(job)
            if not pending:
                return
            yield pending.popleft()()
    finally:
        for job in pending:
            job.cancel()


def check_image_size(image_size, channels: int) -> tuple[int, int]:
    """(height, width) as ints; a MeshfitError unless both are positive and channels is 1 or 3."""
    if channels not in (1, 3):
        raise MeshfitError(f"channels must be 1 (grey) or 3 (RGB), got {channels}")
    size = tuple(int(s) for s in image_size)
    if len(size) != 2 or min(size) < 1:
        raise MeshfitError(f"image size must be two positive pixel counts (height width), got {image_size}")
    return size


def _this_process() -> tuple[Sequence[Any], int] | None:
    """(devices of the job, this process's index) in a job of several processes, else None."""
    if not cluster.multi_process():
        return None
    import jax

    return jax.devices(), jax.process_index()


# ----------------------------------------------------------------------------------- batches

class FolderTrainBatches:
    """Training batches of (images uint8 (B, H, W, C), labels int32 (B,)) read from a Folder.

    The same arguments and order as arrays.TrainBatches (see the module docstring), plus
    image_size (height, width) and channels (1 or 3) to decode to and `workers` decoding threads
    (default: one per core). In a job of several processes B is this process's rows of the global
    batch; in one process, the whole global batch. A file that fails to decode raises a one-line
    MeshfitError, also kept in `failure`: Keras on TensorFlow hands a generator's error on wrapped
    in a TensorFlow error, so a caller can raise `failure` instead.
    """

    def __init__(self, folder: Folder, image_size: tuple[int, int], channels: int, global_batch: int,
                 seed: int = order.DEFAULT_SEED, steps_per_epoch: int | None = None, augment: str = "none",
                 crop_padding: int = CROP_PADDING, flips: str = "random", workers: int | None = None):
        self.image_size = check_image_size(image_size, channels)
        self.steps_per_epoch = arrays.check_train_batches(
            len(folder), self.image_size, global_batch, steps_per_epoch, augment, crop_padding, flips)
        self.folder, self.channels = folder, channels
        self.global_batch, self.seed, self.num_samples = global_batch, int(seed), len(folder)
        self.augment, self.crop_padding, self.flips = augment, int(crop_padding), flips
        job = _this_process()
        # positions in each global batch that this process reads (None: all of them)
        self.rows = None if job is None else _local_positions(global_batch, *job)
        self._decoder = _Decoder(self.image_size, channels, workers)
        self._orders: dict[int, np.ndarray] = {}
        self.failure: MeshfitError | None = None  # the last file that failed to decode

    @property
    def workers(self) -> int:
        """Decoding threads."""
        return self._decoder.workers

    def __len__(self) -> int:
        return self.steps_per_epoch

    def batch(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch `step` of epoch `epoch` (this process's rows of it in a multi-process job)."""
        return self._start(epoch, step)()

    def iterate(self, epoch: int = 0, step: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Batches from step `step` of epoch `epoch` on, endless, PREFETCH_BATCHES decoded ahead.

        One process: a generator (what Keras' fit takes). Several: an iterator marked
        `process_local = True` (it yields this process's rows; hosts.fit_arguments keeps them).
        """
        stream = _prefetched(self._jobs(epoch, step), PREFETCH_BATCHES)
        return stream if self.rows is None else ProcessLocal(stream)

    def _jobs(self, epoch: int, step: int) -> Iterator[Callable[[], tuple[np.ndarray, np.ndarray]]]:
        while True:
            for s in range(step, self.steps_per_epoch):
                yield self._start(epoch, s)
            epoch, step = epoch + 1, 0

    def _start(self, epoch: int, step: int) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """Begin decoding batch (epoch, step); returns a function that waits and gives it."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} is outside 0..{self.steps_per_epoch - 1}")
        start = step * self.global_batch
        indices = self._order(epoch)[start:start + self.global_batch]
        transform = None
        if self.augment == "flip-crop":
            parameters = _jitted_parameters(self.crop_padding, self.flips)(self.seed, epoch, step, indices)
            rows, cols, flips = (np.asarray(a) for a in parameters)
            if self.rows is not None:
                rows, cols, flips = rows[self.rows], cols[self.rows], flips[self.rows]
            transform = functools.partial(_flip_crop_chunk, rows, cols, flips, self.crop_padding)
        if self.rows is not None:
            indices = indices[self.rows]
        decoding = self._decoder.submit([self.folder.files[i] for i in indices], transform=transform)
        labels = self.folder.labels[indices]

        def result():
            try:
                return decoding(), labels
            except MeshfitError as error:
                self.failure = error
                raise

        result.cancel = decoding.cancel
        return result

    def _order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s permutation of the files (the last two epochs' kept)."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = np.asarray(_jitted_permutation(self.num_samples)(self.seed, epoch))
        return self._orders[epoch]


def _flip_crop_chunk(rows, cols, flips, padding: int, images: np.ndarray, where: slice) -> np.ndarray:
    """flip-crop of the decoded images at positions `where` of a batch, with the batch's parameters."""
    return arrays.flip_crop_numpy(images, rows[where], cols[where], flips[where], padding)


class ProcessLocal:
    """An iterator of batches that already hold only this process's rows (`process_local = True`)."""

    process_local = True

    def __init__(self, batches: Iterator[Any]):
        self._batches = batches

    def __iter__(self) -> "ProcessLocal":
        return self

    def __next__(self) -> Any:
        return next(self._batches)

    def close(self) -> None:
        self._batches.close()


def _local_positions(global_batch: int, devices: Sequence[Any], process_index: int) -> np.ndarray:
    """Positions in a global batch that this process feeds (its devices' slices, in mesh order)."""
    return cluster.local_rows(global_batch, global_batch, devices, process_index)


@functools.cache
def _jitted_permutation(n: int):
    """jit of order.permutation(seed, epoch, n) taking (seed, epoch): one compilation per n."""
    import jax

    return jax.jit(lambda seed, epoch: order.permutation(seed, epoch, n))


@functools.cache
def _jitted_parameters(padding: int, flips: str):
    """jit of order.flip_crop_parameters taking (seed, epoch, step, indices)."""
    import jax

    return jax.jit(functools.partial(order.flip_crop_parameters, padding=padding, flips=flips))


class FolderEvalBatches:
    """Evaluation batches covering every file of a Folder once, the last batch zero-padded.

    The contract of arrays.EvalBatches: iterating yields `(images,)` of `global_batch` images (mirrored
    left-right with flip=True), decoded PREFETCH_BATCHES ahead; `trim(outputs)` keeps the first N
    rows; `labels` are all N labels. Every process decodes whole batches (multi-host predict
    gathers from the same global batch on every process).
    """

    def __init__(self, folder: Folder, image_size: tuple[int, int], channels: int,
                 global_batch: int, workers: int | None = None):
        self.image_size = check_image_size(image_size, channels)
        if global_batch < 1:
            raise MeshfitError(f"evaluation batch must be at least 1, got {global_batch}")
        self.folder, self.channels, self.global_batch = folder, channels, global_batch
        self.num_samples = len(folder)
        self.num_batches = -(-len(folder) // global_batch)
        self.labels = folder.labels
        self._decoder = _Decoder(self.image_size, channels, workers)

    def __len__(self) -> int:
        return self.num_batches

    def iterate(self, flip: bool = False) -> Iterator[tuple[np.ndarray]]:
        """`(images,)` for every batch in order; mirrored left-right when flip=True."""
        mirror = (lambda images, where: np.ascontiguousarray(images[:, :, ::-1])) if flip else None
        jobs = (self._decoder.submit(self.folder.files[i:i + self.global_batch], self.global_batch, mirror)
                for i in range(0, self.num_samples, self.global_batch))
        for images in _prefetched(jobs, PREFETCH_BATCHES):
            yield (images,)

    def trim(self, outputs: np.ndarray) -> np.ndarray:
        """The first N rows of outputs computed on the padded batches."""
        return outputs[:self.num_samples]
