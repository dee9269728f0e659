"""Image folders streamed from disk: batches decoded as they are needed, never the folder whole.

The folder's files and classes: meshfit.data.folder_scan; one image decoded: meshfit.data.image_files.

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
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from meshfit.data import arrays, order
from meshfit.data.folder_scan import Folder
from meshfit.data.image_files import check_image_size, default_workers, load_image
from meshfit.errors import MeshfitError
from meshfit.parallel import cluster
from meshfit.data.arrays import CROP_PADDING

PREFETCH_BATCHES = 2  # batches decoded ahead of the one being used
MAX_CHUNK = 32  # images per decoding task at most
MEASURED_IMAGES = 256  # images decoded on one thread before choosing the number of threads
CHEAP_IMAGE_SECONDS = 100e-6  # CPU time per image below which decoding stays on one thread


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


def _this_process() -> tuple[Sequence[Any], int] | None:
    """(devices of the job, this process's index) in a job of several processes, else None."""
    if not cluster.multi_process():
        return None
    import jax

    return jax.devices(), jax.process_index()


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
