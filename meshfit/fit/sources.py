"""Data sources for `Strategy.fit`: arrays, tf.data, PyDataset, generators, Grain, each batch cut
where it must be.

On one host no cut is needed: a batch that does not split across the replicas is computed whole
on every device (meshfit.fit.hooks). Two cases still need cutting. On several hosts each
process feeds its own rows of every global batch, so a short batch must split across all
devices. On TensorFlow, micro-batches need at least one sample per slice. Arrays are cut before
`fit` (`trim_last_batch`). Every other source Keras reads (`tf.data.Dataset`,
`keras.utils.PyDataset`, generators and other iterators, `grain.MapDataset`, `grain.IterDataset`,
`grain.DataLoader`) goes through `SplitBatches`: Keras' own adapter for that source, with each
batch cut as it comes. So a stream of 1,003 samples in batches of 64 trains 960 + 40 samples per
epoch on 2 hosts of 4 devices; the 3 left out are named in one warning. On several hosts each
cut batch is then cut again to this process's rows. `SplitBatches` also turns Keras' errors for
sources it cannot read into one line.

Why cut and not pad the short batch with zero-weight samples (which would keep one compiled
shape and every sample): padding is exact only for the gradient. Keras counts padded rows in
metrics that take no sample weight (`accuracy`), weights each batch's loss by its row count in
the reported mean, and layers that mix samples (batch normalization) and custom `train_step`s
that ignore weights would see them. Cutting keeps every figure exact. Its cost is one more
compilation of the step for the short shape, once per `fit` (measured in BENCHMARKS.md). A
batch smaller than the replicas (or than the micro-batches) is left out whole.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from typing import Any, Callable, Sequence

import jax
import keras  # this module is imported by Strategy.fit, after meshfit.connect() chose the backend
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshfit.data.rows import first_rows, leading_rows, splittable_rows
from meshfit.errors import MeshfitError
from meshfit.fit import keras_internals  # Keras' data adapters have no public API
from meshfit.parallel import sharding

KERAS_BATCH = 32  # the batch Keras cuts arrays into when given no batch size
SOURCE_KINDS = ("numpy arrays", "a tf.data.Dataset", "a keras.utils.PyDataset", "a generator",
                "a grain.MapDataset or grain.IterDataset")


def trim_last_batch(arrays: Sequence[Any], global_batch: int, replicas: int,
                    micro_batches: int = 1) -> list:
    """Arrays (x, y, sample_weight: each an array, a dict/list of arrays, or None) shortened so
    their last partial batch splits across `replicas` (and has at least `micro_batches`
    samples), with a warning saying how many samples were dropped."""
    n = next((leading_rows(a) for a in arrays if a is not None), None)
    rest = n % global_batch if n else 0
    keep = n - rest + splittable_rows(rest, replicas, micro_batches) if n else n
    if keep == n:
        return list(arrays)
    into = f"{micro_batches} micro-batches" if rest < micro_batches else f"{replicas} replicas"
    warnings.warn(f"dropping the last {n - keep} of {n} samples so the last batch splits into "
                  f"{into}", stacklevel=4)  # the caller of Strategy.fit
    return [None if a is None else first_rows(a, keep) for a in arrays]


def is_arrays(x: Any, y: Any = None, sample_weight: Any = None) -> bool:
    """True when Keras reads (x, y, sample_weight) as arrays sliced into batches by batch_size."""
    return keras_internals.can_convert_arrays((x, y, sample_weight))


def is_one_shot(source: Any) -> bool:
    """True for a source that can be read only once (a generator or other iterator)."""
    return isinstance(source, types.GeneratorType) or (hasattr(source, "__next__")
                                                       and iter(source) is source)


def without_autotune(dataset):
    """`dataset` without tf.data's autotuning, whose model thread made the end of every
    TensorFlow fit wait up to a minute.

    Measured (py-spy and gdb on `meshfit train fashion-mnist-cnn --engine tensorflow --epochs 5`,
    2-vCPU VM loaded by parallel work, 2026-11-28): when Keras' fit returns, its iterator over
    this dataset is destroyed, and the iterator's destructor (RootDataset::Iterator, in
    UnboundedThreadPool::LogicalThreadWrapper) waits for its autotuning thread
    (Model::OptimizeLoop), which sleeps out its optimization period before it sees the
    cancellation: that period doubles as the iterator lives, up to 60 s, so fit's end waited
    9-58 s in 8 of 14 such runs (38.9 s and 39.7 s in two of four here), counted as goodput's
    "other". Nothing here needs tuning: meshfit reads every batch in Python (TensorFlow's timed
    train function, meshfit.fit.hooks), so the pipeline is the generator and one prefetch
    buffer, which keeps its own (legacy) autotuning of its size."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


class SplitBatches(keras_internals.DataAdapter):
    """Keras' adapter for `source`, every batch it yields cut to split across `replicas`.

    micro_batches: slices per batch (TensorFlow engine); a batch needs at least that many rows.
    per_process: on several hosts, a function cutting a global batch to this process's rows
    (see meshfit.fit.hosts.fit_arguments); None on one host.
    shuffle, class_weight, steps_per_epoch: as for `model.fit`, given to Keras' adapter.
    """

    def __init__(self, source: Any, replicas: int, micro_batches: int = 1, *, shuffle: bool = False,
                 class_weight: dict | None = None, steps_per_epoch: int | None = None):
        if is_one_shot(source) and not isinstance(source, types.GeneratorType):
            source = (batch for batch in source)  # Keras takes generators, not other iterators
        try:
            self.inner = keras_internals.get_data_adapter(source, shuffle=shuffle, class_weight=class_weight,
                                                          steps_per_epoch=steps_per_epoch)
        except ValueError as e:
            message = " ".join(str(e).split())
            if message.startswith("Unrecognized data type"):
                message = (f"Strategy.fit cannot read a {type(source).__name__}; pass "
                           f"{', '.join(SOURCE_KINDS[:-1])} or {SOURCE_KINDS[-1]}")
            raise MeshfitError(message) from None
        self.replicas, self.micro_batches = replicas, micro_batches
        self.per_process: Callable[[Any], Any] | None = None
        self.left_out = 0  # samples of the last cut batch that were left out (0: none so far)

    def split(self, batch: Any) -> Any | None:
        """`batch` cut to split across the replicas (then to this process's rows); None to skip it."""
        rows = leading_rows(batch)
        keep = rows if rows is None else splittable_rows(rows, self.replicas, self.micro_batches)
        if keep != rows:
            if not self.left_out:  # once per fit, not at every epoch's short batch
                into = f"{self.replicas} replicas" if rows % self.replicas else f"{self.micro_batches} micro-batches"
                warnings.warn(f"a batch of {rows} samples does not split across {into}: using "
                              f"{keep} of them (each epoch)", stacklevel=2)
            self.left_out = rows - keep
            if not keep:  # fewer rows than replicas (or slices): the whole batch is left out
                return None
            batch = first_rows(batch, keep)
        return self.per_process(batch) if self.per_process else batch

    def _split_all(self, batches):
        for batch in batches:
            batch = self.split(batch)
            if batch is not None:
                yield batch

    def get_numpy_iterator(self):
        return self._split_all(self.inner.get_numpy_iterator())

    def get_jax_iterator(self, super_batch: int | None = None):
        """The cut batches; super_batch: k, where Keras 3.16 asks for every k stacked (its
        steps_per_execution), stacked after the cut as Keras' own adapters stack theirs."""
        batches = self._split_all(self.inner.get_jax_iterator())
        return keras_internals.super_batch_iterator(batches, super_batch) if super_batch else batches

    def get_tf_dataset(self):
        """Keras' dataset: TensorFlow runs one replica, so only micro-batches need a cut, which
        goes through `split` on the host (numpy) to warn like the other engines. A pipeline made
        here (over a generator, a PyDataset, Grain; not the user's own tf.data.Dataset, whose
        options are kept) runs without tf.data's autotuning (see `without_autotune`)."""
        import tensorflow as tf

        dataset = self.inner.get_tf_dataset()
        if self.micro_batches > 1:  # one replica on TensorFlow: else every batch splits as it is
            spec = tf.nest.map_structure(lambda s: tf.TensorSpec((None, *s.shape[1:]), s.dtype),
                                         dataset.element_spec)
            return without_autotune(tf.data.Dataset.from_generator(self.get_numpy_iterator,
                                                                   output_signature=spec))
        return dataset if type(self.inner).__name__ == "TFDatasetAdapter" else without_autotune(dataset)

    def get_torch_dataloader(self):
        return self.inner.get_torch_dataloader()

    num_batches = property(lambda self: self.inner.num_batches)
    batch_size = property(lambda self: self.inner.batch_size)
    has_partial_batch = property(lambda self: self.inner.has_partial_batch)
    partial_batch_size = property(lambda self: self.inner.partial_batch_size)

    def on_epoch_begin(self):
        self.inner.on_epoch_begin()

    def on_epoch_end(self):
        self.inner.on_epoch_end()


def prepare(x: Any, y: Any, global_batch: int | None, replicas: int, micro_batches: int,
            epochs: int, kwargs: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """`Strategy.fit`'s (x, y, kwargs) with every batch splittable across `replicas`.

    Arrays (with a global batch) lose the samples their last batch cannot split; any other source is
    wrapped in SplitBatches, which cuts its batches as they come. validation_data likewise.
    A generator, read only once, needs steps_per_epoch to train more than one epoch.
    """
    kwargs = dict(kwargs)
    check_fit_ends({"x": x, **kwargs})  # before a wrapper hides the dataset
    if kwargs.get("validation_split") and kwargs.get("validation_data") is None and is_arrays(
            x, y, kwargs.get("sample_weight")):
        # Split first, as Keras' fit does, so that only the training part is cut.
        (x, y, weights), kwargs["validation_data"] = keras_internals.train_validation_split(
            (x, y, kwargs.get("sample_weight")), validation_split=kwargs.pop("validation_split"))
        if weights is not None:
            kwargs["sample_weight"] = weights
    validation = kwargs.get("validation_data")
    if is_arrays(x, y, kwargs.get("sample_weight")):
        if global_batch is not None:
            x, y, weights = trim_last_batch([x, y, kwargs.get("sample_weight")], global_batch,
                                            replicas, micro_batches)
            if weights is not None:
                kwargs["sample_weight"] = weights
    elif x is not None:
        _check_rereadable(x, "steps_per_epoch", kwargs.get("steps_per_epoch"), epochs, kwargs)
        if y is not None or kwargs.get("sample_weight") is not None:
            raise MeshfitError(f"a {type(x).__name__} carries its own targets and weights: yield "
                               f"(x, y) or (x, y, sample_weight) batches and pass no y or sample_weight")
        shuffle = kwargs.pop("shuffle", True)  # Keras shuffles only a PyDataset's batch order
        x = SplitBatches(x, replicas, micro_batches, class_weight=kwargs.pop("class_weight", None),
                         shuffle=shuffle and isinstance(x, keras.utils.PyDataset),
                         steps_per_epoch=kwargs.get("steps_per_epoch"))
    if isinstance(validation, (tuple, list)) and is_arrays(*validation):
        validation_batch = kwargs.get("validation_batch_size") or global_batch or KERAS_BATCH
        kwargs["validation_data"] = tuple(trim_last_batch(list(validation), validation_batch, replicas))
    elif validation is not None:
        _check_rereadable(validation, "validation_steps", kwargs.get("validation_steps"), epochs, kwargs)
        kwargs["validation_data"] = SplitBatches(validation, replicas)
    return x, y, kwargs


def check_ends(source: Any, steps_name: str, steps: int | None) -> None:
    """A tf.data.Dataset that never ends (`.repeat()`) needs a step count: without one Keras reads
    its first epoch (or validation) for ever, with no word (TensorFlow's Keras 2 refused it)."""
    if steps or type(source).__module__.split(".")[0] != "tensorflow" or not hasattr(source, "cardinality"):
        return
    import tensorflow as tf  # only reached with a tf.data.Dataset, so TensorFlow is imported already

    if int(source.cardinality()) == tf.data.INFINITE_CARDINALITY:
        raise MeshfitError(f"this tf.data.Dataset repeats for ever, so its epoch never ends: pass "
                           f"{steps_name} (batches per epoch), or drop its .repeat()")


def check_fit_ends(arguments: dict[str, Any]) -> None:
    """check_ends for the training and validation data of fit's `arguments` (by name)."""
    check_ends(arguments.get("x"), "steps_per_epoch", arguments.get("steps_per_epoch"))
    check_ends(arguments.get("validation_data"), "validation_steps", arguments.get("validation_steps"))


def _check_rereadable(source: Any, steps_name: str, steps: int | None, epochs: int,
                      kwargs: dict[str, Any]) -> None:
    """A one-shot source without a step count must not be asked for a second epoch."""
    if is_one_shot(source) and not steps and epochs - kwargs.get("initial_epoch", 0) > 1:
        raise MeshfitError(f"a {type(source).__name__} can be read only once, so Keras cannot find "
                           f"its epochs' ends: pass {steps_name} (with a generator that yields that "
                           f"many batches per epoch), use epochs=1, or use a keras.utils.PyDataset")


def divisible_placement(distribute_tensor: Callable, active: Callable[[], Any]) -> Callable:
    """Keras' JAX `distribute_tensor(tensor, layout)` (what keras-hub's `generate`, its samplers
    and user code place data with, and Keras variables and layer outputs) with every dimension
    the layout's mesh axes do not divide held whole instead (`sharding.divisible_spec`), while a
    meshfit strategy is active (`active()` returns it): `generate` on 3 prompts over 8 devices
    then computes them whole on every device, as `predict` does, instead of JAX's
    IndivisibleError. A host value placed across processes is placed without JAX's check that
    every process holds it (`agreed_placement`)."""
    @functools.wraps(distribute_tensor)
    def placed(tensor, layout):
        backend = getattr(layout, "backend_layout", layout) if active() is not None else None
        shape = getattr(tensor, "shape", None)
        if isinstance(backend, NamedSharding) and shape:
            layout = backend = divisible_sharding(tuple(shape), backend)
        if isinstance(backend, jax.sharding.Sharding) and not backend.is_fully_addressable \
                and is_host_value(tensor):
            return agreed_placement(tensor, backend)
        return distribute_tensor(tensor, layout)

    return placed


def is_host_value(tensor: Any) -> bool:
    """A value every process could hold whole: NumPy's, a Python number, or a JAX array on one
    device of this process (Keras' initial values); not a traced value or a cross-host array."""
    if isinstance(tensor, (np.ndarray, np.generic, int, float, bool)):
        return True
    return (isinstance(tensor, jax.Array) and not isinstance(tensor, jax.core.Tracer)
            and tensor.is_fully_addressable and len(tensor.sharding.device_set) == 1)


def agreed_placement(tensor: Any, layout: jax.sharding.Sharding) -> jax.Array:
    """`tensor`, the same on every process, as one array laid out by `layout` across processes:
    each process places its own devices' parts of its copy.

    Why not jax.device_put: given host data and a layout spanning processes, it first checks
    that every process holds the same value (multihost_utils.assert_equal: one all-gather
    compiled and run per variable), 1.9 s of the 6.6 s a 2 x 4 device job took from its start
    to its first step (42 variables of the tutorial CNN, 2-core machine, cProfile, 2026-11-28),
    paid again by every generation of an elastic job. Under a meshfit strategy the values agree
    by construction: every process builds the model from process 0's seed
    (meshfit.fit.hosts.agree_on_seed), and restores read the same checkpoint or local copy."""
    value = np.asarray(tensor)
    return jax.make_array_from_callback(value.shape, layout, value.__getitem__)


def divisible_sharding(shape: tuple, layout: NamedSharding) -> NamedSharding:
    """`layout` for an array of `shape`, every dimension its mesh axes do not divide held whole
    (`sharding.divisible_spec`); `layout` itself where it already divides."""
    spec = sharding.divisible_spec(shape, tuple(layout.spec), dict(layout.mesh.shape))
    if spec == list(layout.spec) + [None] * (len(shape) - len(layout.spec)):
        return layout
    return NamedSharding(layout.mesh, PartitionSpec(*spec))


def kind(x, model=None) -> str:
    """The kind of a fit's data source, for the input-bound line's advice (goodput.input_fix):
    a grain dataset given to the fit of a model with a preprocessor is the pipeline a keras-hub
    task built from the user's strings or arrays ('preprocessor'), which the user does not hold."""
    if x is None:
        return "arrays"
    name = f"{type(x).__module__}.{type(x).__name__}".lower()
    if inspect.isgenerator(x) or isinstance(x, (map, filter, zip)) or name.endswith("iterator"):
        return "generator"
    if isinstance(x, keras.utils.PyDataset):
        return "pydataset"
    if "tensorflow" in name:
        return "tf.data"
    if "grain" in name:
        return "preprocessor" if getattr(model, "preprocessor", None) is not None else "grain"
    if "folders" in name:
        return "folder"
    return "arrays" if is_arrays(x, None) else "generator"
