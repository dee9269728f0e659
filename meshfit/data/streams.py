"""A recipe's streamed data: the train, validation and test sources its `dataset(seed)` returns.

A recipe's dataset callable may return, instead of arrays, a dict
    {"train": SOURCE, "validation": SOURCE or None, "test": SOURCE or None, "class_names": [...]}
(validation and test optional) whose sources yield `(x, y)` or `(x, y, sample_weight)` batches:
  - index-based: a `keras.utils.PyDataset` or a `grain.MapDataset` of batches: len() batches,
    batch i = source[i] (a PyDataset's `workers` threads read ahead);
  - re-iterable: a `tf.data.Dataset`, a `grain.IterDataset`, any iterable that is not an iterator:
    one pass per epoch;
  - a function returning such an iterable, called once per pass, with the epoch number when it
    takes an argument (0 for validation and test): a generator function, or a function returning
    a tf.data.Dataset shuffled with seed + epoch.
A generator object can be read only once and is refused (pass its function).

Training: the global batch is the first train batch's size; each epoch is `steps_per_epoch` batches
(the recipe's, else len() of an index-based source, else counted by reading one pass of the source
when training starts). An index-based source is read in a batch order drawn from (seed, epoch), as
Keras shuffles a PyDataset's batches. A batch that does not split across the replicas is cut to
the largest multiple of them (one warning), a batch smaller than the replicas is left out and is
not a step (meshfit.fit.sources explains why cut and not pad).

Resume: batch (epoch, step) of an index-based source is source[order(seed, epoch)[step]], so
`--resume` is exact. Other sources are resumed by starting the epoch's pass again and reading and
skipping the batches already trained on: exact when that pass yields the same batches as before,
i.e. when the source is deterministic for its seed and epoch (a tf.data.Dataset given directly is
read afresh each epoch: with `shuffle(reshuffle_each_iteration=True)` its passes differ, so return
a function of the epoch instead). Resuming such a source warns once.

Validation and test sources are read once when loaded (their labels and sample count) and again at
each evaluation, re-batched into fixed-size batches (the last zero-padded); they must yield the same
samples in the same order on every pass (do not shuffle them), which meshfit checks.
"""

from __future__ import annotations

import collections
import inspect
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import numpy as np

from meshfit.data.rows import first_rows, leading_rows, splittable_rows
from meshfit.errors import MeshfitError

KEYS = ("train", "validation", "test", "class_names")
FORMS = ("a keras.utils.PyDataset, a tf.data.Dataset, a grain.MapDataset or IterDataset, or a "
         "generator function")


def is_streams(result: Any) -> bool:
    """True when a recipe's dataset callable returned streamed sources (a dict)."""
    return isinstance(result, dict)


def _is_index_based(source: Any) -> bool:
    import keras

    if isinstance(source, keras.utils.PyDataset):
        return True
    grain = sys.modules.get("grain")  # a grain dataset means grain is imported already
    return grain is not None and isinstance(source, getattr(grain, "MapDataset", ()))


def kind(source: Any, name: str) -> str:
    """"index", "iterable" or "function": how `source` (the `name` source of a recipe) is read."""
    if _is_index_based(source):
        return "index"
    if hasattr(source, "__next__") and iter(source) is source:
        raise MeshfitError(f"the recipe's {name} source is a {type(source).__name__}, which can be "
                           "read only once; return the generator function itself (meshfit calls it "
                           "for every epoch)")
    if hasattr(source, "__iter__"):
        return "iterable"
    if callable(source):
        return "function"
    raise MeshfitError(f"the recipe's {name} source is a {type(source).__name__}; give {FORMS}")


def _batch(batch: Any, name: str) -> tuple:
    """A source's batch as a tuple (x, y[, sample_weight]) of numpy arrays."""
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise MeshfitError(f"the recipe's {name} source yielded a {type(batch).__name__}; yield "
                           "(x, y) or (x, y, sample_weight) batches")
    import keras

    return tuple(keras.tree.map_structure(np.asarray, part) if part is not None else None
                 for part in batch)


def _rows(batch: tuple) -> int:
    return leading_rows(batch[0]) or 0


class Source:
    """One source of a recipe's streamed data, with its first batch (read once) at hand."""

    def __init__(self, source: Any, name: str):
        self.source, self.name = source, name
        self.kind = kind(source, name)
        self._first: tuple | None = None

    def __len__(self) -> int:
        """Batches of an index-based source."""
        try:
            return int(len(self.source))
        except TypeError:
            raise MeshfitError(f"the recipe's {self.name} source ({type(self.source).__name__}) has "
                               "no length; give it __len__ (batches per epoch)") from None

    def get(self, index: int) -> tuple:
        """Batch `index` of an index-based source."""
        return _batch(self.source[index], self.name)

    def batches(self, epoch: int = 0) -> Iterator[tuple]:
        """One pass over the source, in its own order (for epoch `epoch`)."""
        if self.kind == "index":
            yield from _read_ahead(self.get, range(len(self)), getattr(self.source, "workers", 1))
            return
        source = self.source
        if self.kind == "function":
            source = source(epoch) if inspect.signature(source).parameters else source()
            if not hasattr(source, "__iter__"):
                raise MeshfitError(f"the recipe's {self.name} function returned a "
                                   f"{type(source).__name__}; return an iterable of batches (yield "
                                   "them, or return a tf.data.Dataset)")
        if hasattr(source, "as_numpy_iterator"):  # tf.data: numpy without an eager tensor per leaf
            source = source.as_numpy_iterator()
        for batch in source:
            yield _batch(batch, self.name)

    def first(self) -> tuple:
        """The first batch of the first pass."""
        if self._first is None:
            if self.kind == "index":
                self._first = self.get(0) if len(self) > 0 else None
            else:
                self._first = next(iter(self.batches(0)), None)
            if self._first is None:
                raise MeshfitError(f"the recipe's {self.name} source yielded no batches")
        return self._first


def _read_ahead(get: Callable[[int], Any], indices, workers: int, depth: int | None = None):
    """get(i) for each of `indices`, in order; with workers > 1, that many threads read ahead."""
    if workers <= 1:
        yield from map(get, indices)
        return
    depth = depth or 2 * workers
    pool, pending = ThreadPoolExecutor(workers), collections.deque()
    try:
        for i in indices:
            pending.append(pool.submit(get, i))
            if len(pending) > depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=False)


class TrainStream:
    """Training batches from a train Source by (epoch, step), each cut to split across `replicas`.

    The contract of arrays.TrainBatches: `steps_per_epoch`, `global_batch` and
    `iterate(epoch, step)`, endless, from batch `step` of epoch `epoch` on (see the module
    docstring for the order and for how exact a resume is). `smallest_batch`: the fewest rows a
    step has (after the cut; None when not counted). `micro_batches`: slices per batch, set before
    training: a batch needs at least that many rows, else it is left out. `failure`: the error of
    the last failed pass (Keras on TensorFlow hands a generator's error on wrapped in its own).
    """

    def __init__(self, source: Source, seed: int, replicas: int, steps_per_epoch: int | None = None):
        self.source, self.seed, self.replicas = source, int(seed), replicas
        self.micro_batches = 1
        self.failure: MeshfitError | None = None
        self._warned_resume = False
        first = _rows(source.first())
        self.global_batch = splittable_rows(first, replicas)
        if not self.global_batch:
            raise MeshfitError(f"the recipe's train source yields batches of {first} samples, fewer "
                               f"than the {replicas} replicas; batch it by {replicas} or more")
        if source.kind == "index":
            count = len(source)
            last = _rows(source.get(count - 1)) if count > 1 else first
            self._kept = np.arange(count if splittable_rows(last, replicas) else count - 1)
            self._warn_cut(last)
            rows = [self.global_batch, splittable_rows(last, replicas) or self.global_batch]
            self.smallest_batch = min(rows)
            available = len(self._kept)
        elif steps_per_epoch:
            available, self.smallest_batch = steps_per_epoch, None
        else:  # read one pass to count its batches
            rows = [_rows(b) for b in source.batches(0)]
            kept = [splittable_rows(r, replicas) for r in rows]
            cut = [r for r, k in zip(rows, kept) if k != r]
            if cut:
                self._warn_cut(cut[0])
            available = sum(1 for k in kept if k)
            self.smallest_batch = min(k for k in kept if k)
        self.steps_per_epoch = min(steps_per_epoch or available, available)
        if steps_per_epoch and steps_per_epoch > available:
            raise MeshfitError(f"steps_per_epoch {steps_per_epoch} is more than the {available} "
                               "batches of the recipe's train source; use at most that many")

    def _warn_cut(self, rows: int) -> None:
        keep = splittable_rows(rows, self.replicas)
        if keep != rows:
            warnings.warn(f"a batch of {rows} samples does not split across {self.replicas} "
                          f"replicas: using {keep} of them (each epoch)", stacklevel=3)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def order(self, epoch: int) -> np.ndarray:
        """An index-based source's batch indices for epoch `epoch`, in training order."""
        permutation = np.random.default_rng([self.seed, epoch]).permutation(len(self._kept))
        return self._kept[permutation[:self.steps_per_epoch]]

    def iterate(self, epoch: int = 0, step: int = 0) -> Iterator[tuple]:
        """Batches from step `step` of epoch `epoch` on, running into the following epochs."""
        if (epoch, step) != (0, 0) and self.source.kind != "index" and not self._warned_resume:
            self._warned_resume = True
            skipping = f" and skipping its first {step} batches" if step else ""
            source = self.source.source
            what = (f"function {source.__qualname__}" if self.source.kind == "function"
                    else type(source).__name__)
            warnings.warn(f"resuming the recipe's train source ({what}) "
                          f"by reading epoch {epoch + 1} from its start{skipping}: exact only if it "
                          "yields the same batches for that epoch as before (deterministic for its "
                          "seed and epoch; PyDataset and grain.MapDataset resume exactly)",
                          stacklevel=2)
        while True:
            yield from self._epoch(epoch, step)
            epoch, step = epoch + 1, 0

    def _cut(self, batch: tuple) -> tuple | None:
        rows = _rows(batch)
        keep = splittable_rows(rows, self.replicas, self.micro_batches)
        if keep == rows:
            return batch
        return first_rows(batch, keep) if keep else None

    def _epoch(self, epoch: int, start: int) -> Iterator[tuple]:
        if self.source.kind == "index":
            indices = self.order(epoch)[start:]
            workers = getattr(self.source.source, "workers", 1)
            for i, batch in zip(indices, _read_ahead(self.source.get, indices, workers)):
                cut = self._cut(batch)
                if cut is None:
                    raise self._fail(f"batch {i} of the recipe's train source has {_rows(batch)} "
                                     f"samples, too few to split; only its last batch may be short")
                yield cut
            return
        taken = 0
        for batch in self.source.batches(epoch):
            cut = self._cut(batch)
            if cut is None:
                continue
            if taken >= start:
                yield cut
            taken += 1
            if taken == self.steps_per_epoch:
                return
        raise self._fail(f"the recipe's train source yielded {taken} batches in epoch {epoch + 1}, "
                         f"fewer than the {self.steps_per_epoch} steps per epoch; every pass must "
                         "yield as many batches as the first")

    def _fail(self, message: str) -> MeshfitError:
        self.failure = MeshfitError(message)
        return self.failure


class EvalSource:
    """A validation or test Source, read once for its labels and sample count.

    labels: int32 of every label, in order: (N,), or N x L for a label per position (a language
    model's next tokens), flattened; len(): N, the samples (rows). Counted apart: the labels'
    count once stood for the rows, so a language model's test set was read as L times its
    batches (Keras warned "Your input ran out of data") and a last batch's padding was kept.
    """

    def __init__(self, source: Any, name: str, num_classes: int):
        self.source = Source(source, name)
        self.name = name
        labels, self.rows = [], 0
        for batch in self.source.batches(0):
            labels.append(np.asarray(batch[1]).reshape(-1))
            self.rows += _rows(batch)
        self.labels = np.concatenate(labels).astype(np.int32) if labels else np.zeros(0, np.int32)
        if not len(self.labels):
            raise MeshfitError(f"the recipe's {name} source yielded no samples")
        if self.labels.min() < 0 or self.labels.max() >= num_classes:
            raise MeshfitError(f"the recipe's {name} source has labels {self.labels.min()} to "
                               f"{self.labels.max()} but {num_classes} class names; use 0.."
                               f"{num_classes - 1}")

    def __len__(self) -> int:
        return self.rows


class EvalStream:
    """Evaluation batches of an EvalSource: the contract of arrays.EvalBatches (iterate yields
    `(images,)` of `global_batch` rows, the last zero-padded; trim keeps the first N rows of outputs).
    trim also checks that the pass yielded the labels of the first one (the source must not shuffle)."""

    def __init__(self, source: EvalSource, global_batch: int):
        self.source, self.global_batch = source, global_batch
        self.num_samples = len(source)
        self.num_batches = -(-self.num_samples // global_batch)
        self._seen: list[np.ndarray] = []

    def __len__(self) -> int:
        return self.num_batches

    def iterate(self, flip: bool = False) -> Iterator[tuple[np.ndarray]]:
        """`(x,)` for every batch in order; images mirrored left-right when flip=True."""
        self._seen = []
        held: list[np.ndarray] = []
        for batch in self.source.source.batches(0):
            self._seen.append(np.asarray(batch[1]).reshape(-1))
            held.append(batch[0])
            while held and sum(len(h) for h in held) >= self.global_batch:
                joined = np.concatenate(held) if len(held) > 1 else held[0]
                held = [joined[self.global_batch:]] if len(joined) > self.global_batch else []
                yield (self._mirror(joined[:self.global_batch], flip),)
        if held:
            rest = np.concatenate(held)
            padded = np.zeros((self.global_batch,) + rest.shape[1:], rest.dtype)
            padded[:len(rest)] = rest
            yield (self._mirror(padded, flip),)

    @staticmethod
    def _mirror(x: np.ndarray, flip: bool) -> np.ndarray:
        return np.ascontiguousarray(x[:, :, ::-1]) if flip else x

    def trim(self, outputs: np.ndarray) -> np.ndarray:
        """The first N rows of outputs computed on the padded batches."""
        seen = np.concatenate(self._seen) if self._seen else np.zeros(0, np.int32)
        if len(seen) != len(self.source.labels) or not np.array_equal(seen, self.source.labels):
            raise MeshfitError(f"the recipe's {self.source.name} source yielded other samples on a "
                               "second pass; it must yield the same samples in the same order every "
                               "time (do not shuffle it)")
        return outputs[:self.num_samples]
