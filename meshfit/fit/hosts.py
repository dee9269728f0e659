"""Multi-host work once the engine runs: every process of a job passes the same global data or
batches, and these helpers give each its share or gather the results.

`fit_arguments()` (used by `Strategy.fit`) cuts fit's data to this process's rows of every global
batch (the rows of meshfit.parallel.cluster.local_rows); `predict_across_hosts()` gathers outputs
that Keras' predict cannot; `agree_on_seed()` starts every process from the same weights; `Vote`
lets the processes agree on a number (e.g. "stop, on this signal") without a host sync;
`meet_every_process()` makes a call that every process must make (fit, evaluate, predict, a read
of a split value) a warning, then an error, when one process makes it alone. A
user's own plain `fit/evaluate/predict`, where each process passes its own rows, gets
`gathered`, `process_rows` and `one_batch_per_dispatch` (through meshfit.fit.hooks).
On the TensorFlow engine (one process, one device) nothing here runs.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import hashlib
import itertools
import sys
import time
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshfit.data import rows
from meshfit.errors import MeshfitError
from meshfit.fit import keras_internals
from meshfit.fit.sources import SplitBatches
from meshfit.parallel import cluster, heartbeat, jax_internals, stall


# A call that runs on every process (fit, evaluate, predict; a read of a value split across
# processes in Keras' saving) first meets the other processes at a barrier of JAX's coordination
# service: made on process 0 alone (under `if jax.process_index() == 0`) it otherwise waited in a
# collective until the stall guard ended it, 600 s later, with a line that could not say why.
# The wait has two stages. After MEET_WARN_SECONDS (half the wait, where shorter) one line names
# the likely cause and the wait goes on, since a process may be late for a reason (work of its
# own before a call every process makes). It ends with an error at 90% of the stall timeout, the
# user's bound on a pause, so that this line comes before the stall guard's and meshfit launch's
# verdicts; without the guard (MESHFIT_STALL_TIMEOUT=0), after a day. A barrier that timed out
# fails at once for the processes that come after (JAX 0.10.2 and 0.12.0.1): they go on to the
# second stage too.
MEET_WARN_SECONDS = 60
UNGUARDED_MEET_SECONDS = 86400
_meetings = itertools.count()  # the barriers' names: every process makes the same calls in order
EVERY_PROCESS = ("in a job of several processes fit, evaluate, predict, keras-hub's generate and "
                 "Keras' saving of variables split across processes run on every process, so call "
                 "them on every process, not under `if jax.process_index() == 0` (each process "
                 "writes the same file)")


def meet_waits() -> tuple[float, float]:
    """(seconds before the warning, seconds before the error) of meet_every_process."""
    stall_seconds = stall.timeout_seconds()
    limit = 0.9 * stall_seconds if stall_seconds else UNGUARDED_MEET_SECONDS
    return min(MEET_WARN_SECONDS, limit / 2), limit


def meet_every_process(doing: str, why: str = EVERY_PROCESS,
                       late: str = "a call that only this process makes never ends") -> None:
    """Wait until every process of the job comes to this call (see MEET_WARN_SECONDS); `doing`
    says what this process does, for the warning and the error ('calls predict'), `late` the
    likely reason the others do not come, and `why` the rule and its fix."""
    barrier, (warn, limit) = f"meshfit-meet-{next(_meetings)}", meet_waits()
    begun = time.monotonic()
    if jax_internals.every_process_reaches(barrier, warn):
        return
    waited = time.monotonic() - begun
    where = f"process {jax.process_index()} {doing}"
    if waited >= 0.9 * warn:  # this process waited the first stage through: others are late
        _still_waiting(where, waited, f"for the others to come to it too ({late})", limit, why)
    if not jax_internals.every_process_reaches(barrier + "-late", max(1.0, limit - waited)):
        raise MeshfitError(f"{where} and the others did not come to it within {limit:g} s: "
                           f"{why}", see="a-job-hangs")


_tellings = itertools.count()  # keys of every_process_tells: every process makes the same calls in order
first_batch = contextvars.ContextVar("meshfit_first_batch", default=None)  # {"rows": last checked}


def check_rows(rows: int) -> None:
    """At the first batch of a fit, evaluate or predict (first_batch set by meshfit.fit.hooks),
    and at each batch of another size than the one before (an epoch's last): a one-line
    MeshfitError, on every process, where the processes pass batches of other sizes (another
    batch_size on one, or np.array_split's last batches: each took its own rows for its share of
    a batch of its own size, and they trained other numbers, silently). One round trip to the
    coordinator per call, and per change of size."""
    state = first_batch.get()
    if state is None or state.get("rows") == rows:
        return
    state["rows"] = rows
    told = jax_internals.every_process_tells(f"meshfit-rows-{next(_tellings)}", str(rows),
                                             jax.process_count(), jax.process_index(), meet_waits()[1])
    if told is not None and len(set(told)) > 1:
        sizes = ", ".join(f"process {i}: {r}" for i, r in enumerate(told))
        raise MeshfitError(f"the processes pass batches of other sizes ({sizes} rows): "
                           f"{cluster.AS_MANY_BATCHES}")


# After each fit, evaluate and predict the processes meet again: one whose data ran out first
# (its own rows were fewer) went on, or exited, while the others waited in the step it never ran,
# and the stall guard ended them with a line blaming a hung process.
def meet_after(name: str, steps: int | None) -> None:
    """After this process's fit (`steps` training steps), evaluate or predict: wait for the
    others to finish theirs (meet_every_process)."""
    after = f" after {steps} training step(s)" if steps is not None else ""
    meet_every_process(f"finished {name}{after}", cluster.AS_MANY_BATCHES,
                       "another still runs a step with rows this process did not pass, or was not "
                       "stopped?")


def agree_on_weights(model) -> None:
    """At a model's first fit on several processes: where its weights differ across the processes
    (each process built it from its own random seed: `keras.utils.set_random_seed(base +
    jax.process_index())` before the build), every process takes process 0's, with one warning.

    Each process places its own copy of a replicated weight (sources.agreed_placement skips
    JAX's check that the copies agree, 1.9 s of a job's start): copies that differ were one array
    holding other values on each process's devices, and the processes trained other models, for
    good, with nothing said. The check costs one compiled reduction of every weight and one
    all-gather of a number per weight."""
    if getattr(model, "_meshfit_weights_agreed", False):
        return
    _check_same_model(model)
    variables = [v for v in model.variables
                 if isinstance(v.value, jax.Array) and not v.value.is_fully_addressable]
    if variables:
        # A replicated input is reduced on each device alone: each process reads its copy's sum.
        sums = jax.jit(lambda values: jnp.stack([jnp.sum(x.astype(jnp.float32)) for x in values]))(
            [v.value for v in variables])
        everyone = np.asarray(multihost_utils.process_allgather(np.asarray(sums.addressable_data(0))))
        differ = [v for v, column in zip(variables, everyone.T)
                  if not np.array_equal(column, np.full_like(column, column[0]), equal_nan=True)]
        if differ:
            _take_process_0s(differ)
    model._meshfit_weights_agreed = True


def _check_same_model(model) -> None:
    """A one-line MeshfitError, on every process, where the processes fit other models (other
    variables, shapes or dtypes: a model chosen by process index): their steps' collectives did
    not match, and gloo ended the processes with SIGABRT. One round trip to the coordinator."""
    layout = "\n".join(f"{v.path} {tuple(v.shape)} {v.dtype}" for v in model.variables)
    told = jax_internals.every_process_tells(
        f"meshfit-model-{next(_tellings)}", hashlib.sha256(layout.encode()).hexdigest(),
        jax.process_count(), jax.process_index(), meet_waits()[1])
    if told is not None and len(set(told)) > 1:
        others = [i for i, digest in enumerate(told) if digest != told[0]]
        raise MeshfitError(f"process(es) {', '.join(map(str, others))} fit another model than "
                           f"process 0 (other variables, shapes or dtypes; this one has "
                           f"{len(model.variables)} variables): in a job of several processes every "
                           "process builds and fits the same model")


def _take_process_0s(variables: list) -> None:
    """Every process's `variables` (replicated ones) set to process 0's values, with one warning."""
    if not all(v.value.sharding.is_fully_replicated for v in variables):
        raise MeshfitError(f"the model's weights differ across the {jax.process_count()} processes "
                           f"({variables[0].path}, ...): build it from the same random seed on "
                           "every process (meshfit.connect() seeds them alike)")
    values = multihost_utils.broadcast_one_to_all([np.asarray(v.value.addressable_data(0))
                                                   for v in variables])
    for variable, value in zip(variables, values):
        value = np.asarray(value)
        variable.assign(jax.make_array_from_callback(value.shape, variable.value.sharding,
                                                     value.__getitem__))
    if jax.process_index() == 0:
        print(f"meshfit: warning: {len(variables)} of the model's weights differed across the "
              f"{jax.process_count()} processes (built from another random seed on each?); every "
              "process now trains from process 0's", file=sys.stderr, flush=True)


def wait_until_computed(value: jax.Array, doing: str) -> None:
    """Wait until `value`, an array on the devices of several processes, is computed; `doing` says
    what this process does ('reads a value computed on ...'). Its computation ends only when every
    process runs it: one that only this process runs (keras-hub's generate under `if
    jax.process_index() == 0`) waited for ever. So the wait warns and ends as
    meet_every_process's does. No barrier: a value the others computed with this process, which
    only this one reads, is read as soon as it is ready."""
    if value.is_ready():
        return
    warn, limit = meet_waits()
    begun, pause, warned = time.monotonic(), 0.001, False
    where = f"process {jax.process_index()} {doing}"
    while not value.is_ready():
        waited = time.monotonic() - begun
        if waited >= limit:
            raise MeshfitError(f"{where} and its computation did not end within {limit:g} s (it "
                               f"ends when every process runs it): {EVERY_PROCESS}", see="a-job-hangs")
        if waited >= warn and not warned:
            _still_waiting(where, waited, "for its computation, which ends when every process "
                           "runs it (one that only this process runs never does)", limit)
            warned = True
        time.sleep(pause)
        pause = min(0.05, 2 * pause)  # a value that is nearly ready is read at once


def _still_waiting(where: str, waited: float, what: str, limit: float, why: str = EVERY_PROCESS) -> None:
    """The warning of meet_every_process and wait_until_computed, once their first stage is over."""
    print(f"meshfit: warning: {where} and has waited {waited:.0f} s {what}: {why}. "
          f"Waiting up to {limit:g} s", file=sys.stderr, flush=True)


class Vote:
    """The processes agree on a number without waiting for each other at every call.

    Every process calls `cast(value)` at the same points of the program (like any collective);
    each call starts a max-reduction of the values over all processes on the devices and returns,
    without waiting, the result of the call `lag` calls before (0 for the first ones), which is
    the same on every process. `settle()` waits for the reductions under way. Used to stop every
    process of a job at the same step when only one was signalled
    (meshfit.run.keras_side.checkpoints).
    """

    def __init__(self, lag: int = 1):
        devices = jax.devices()
        mesh = Mesh(np.array(devices), ("all",))
        self._sharding = NamedSharding(mesh, PartitionSpec("all"))
        self._shape = (len(devices),)
        self._local = np.ones(jax.local_device_count(), np.int32)
        self._max = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))
        self._pending: collections.deque = collections.deque()
        self.lag = lag

    def cast(self, value: int) -> int:
        """Start the vote on `value`; the maximum of the vote `lag` calls ago, or 0."""
        votes = jax.make_array_from_process_local_data(self._sharding, self._local * value, self._shape)
        self._pending.append(self._max(votes))
        return _read_int(self._pending.popleft()) if len(self._pending) > self.lag else 0

    def settle(self) -> int:
        """Wait for the votes under way; the largest of their maxima (0 when none)."""
        result = 0
        while self._pending:
            result = max(result, _read_int(self._pending.popleft()))
        return result


def _read_int(array) -> int:
    """A replicated scalar jax.Array as an int (this process's copy)."""
    return int(np.asarray(array.addressable_data(0)))


def agree_on_seed() -> int:
    """Give Keras the same random seed on every process (process 0's), so weights start equal.

    Keeps a seed already set on process 0; otherwise process 0 draws one. Call after `join()`.
    """
    seed = keras_internals.get_random_seed()  # Keras has no public getter for the global seed
    if seed is None:
        seed = int(np.random.default_rng().integers(0, 2**31 - 1))
    seed = int(multihost_utils.broadcast_one_to_all(np.int32(seed)))
    keras.utils.set_random_seed(seed)
    return seed


def local_batch(batch: Any, devices: Sequence[Any], process_index: int) -> Any:
    """This process's part of one global batch (a pytree of arrays): what Keras' multi-process input takes.

    A cross-host jax.Array (e.g. made on the devices by meshfit.data.arrays) becomes its host-local
    part without a copy, or where its row blocks are shared with other processes (a model axis
    across processes), the rows of this process's devices out of it; a host array (the same on
    every process) is cut to this process's rows.
    """
    def part(array):
        if isinstance(array, jax.Array) and not array.is_fully_addressable:
            sharding = array.sharding
            if rows_are_own_blocks(sharding, 0):
                return multihost_utils.global_array_to_host_local_array(array, sharding.mesh,
                                                                        sharding.spec)
            return _addressable_rows(array, cluster.local_rows(len(array), len(array), devices,
                                                               process_index))
        array = np.asarray(array)
        return array[cluster.local_rows(len(array), len(array), devices, process_index)]

    return jax.tree.map(part, batch)


def fit_arguments(strategy, x, y, global_batch: int | None, kwargs: dict[str, Any]):
    """`Strategy.fit`'s (x, y, global batch, kwargs) cut to this process's share of every global
    batch; the batch returned is Keras' batch_size for this process.

    Arrays with a global batch: each process keeps its rows of every batch and fits with its
    per-process batch. A stream of global batches (a meshfit.fit.sources.SplitBatches, as
    Strategy.fit wraps tf.data, PyDataset, generators, ...; or a plain iterator, with
    steps_per_epoch): each batch is cut as it comes, unless the source has `process_local = True`
    (it yields this process's rows already). validation_data is cut like x and y.
    """
    devices, index = strategy.info.devices, strategy.info.process_index
    kwargs = dict(kwargs)
    if getattr(x, "process_local", False):  # a source that already reads only this process's rows
        return (batch for batch in x), y, global_batch, kwargs  # Keras takes Python generators only
    cut = functools.partial(local_batch, devices=devices, process_index=index)
    validation = kwargs.get("validation_data")
    if isinstance(validation, SplitBatches):
        validation.per_process = cut
    elif validation is not None:
        validation_batch = kwargs.get("validation_batch_size") or global_batch
        if validation_batch is None:
            raise MeshfitError("on several hosts validation arrays need a global batch: pass "
                               "validation_batch_size, or validation_data of the same kind as x")
        validation, local_validation = share(list(validation), validation_batch, devices, index)
        kwargs["validation_data"] = tuple(validation)
        if kwargs.get("validation_batch_size"):
            kwargs["validation_batch_size"] = local_validation
    if isinstance(x, SplitBatches):
        x.per_process = cut
        return x, y, None, kwargs  # Keras takes no batch_size with a source of batches
    if global_batch is None:
        if y is not None or hasattr(x, "shape"):
            raise MeshfitError("on several hosts Strategy.fit takes arrays with batch_size (the global "
                               "batch), or an iterator of global batches with steps_per_epoch")
        return (cut(b) for b in x), None, None, kwargs
    (x, y, weights), local = share([x, y, kwargs.get("sample_weight")], global_batch, devices, index)
    if weights is not None:
        kwargs["sample_weight"] = weights
    return x, y, local, kwargs


def share(arrays: Sequence[Any], global_batch: int, devices: Sequence[Any], process_index: int):
    """(this process's rows of each entry, per-process batch size): each an array, a dict or list
    of arrays (a model of several inputs), or None."""
    samples = rows.leading_rows([a for a in arrays if a is not None])
    mine = cluster.local_rows(samples, global_batch, devices, process_index)
    per_process = global_batch // len(devices) * sum(d.process_index == process_index for d in devices)
    return [rows.take_rows(a, mine) for a in arrays], per_process


def predict_across_hosts(model, batches: Iterable[Any]):
    """Model outputs for every global batch of `batches`, gathered on every process (numpy).

    Keras' `model.predict` cannot collect outputs that live on several hosts, so this runs the
    model's inference call jitted on each global batch (a cross-host jax.Array, or a host array
    that is the same on every process; `(x,)` tuples are unwrapped) and gathers each result.
    """
    if hasattr(model, "jax_state_sync"):
        model.jax_state_sync()  # variables hold the newest values (fit keeps them apart)
    distribution = keras.distribution.distribution()

    def to_global(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x
        x = np.asarray(x)
        layout = distribution.get_data_layout(x.shape).backend_layout
        return jax.make_array_from_callback(x.shape, layout, lambda index: x[index])

    call = jax.jit(lambda trainable, other, x: model.stateless_call(trainable, other, x)[0])
    trainable = [v.value for v in model.trainable_variables]
    other = [v.value for v in model.non_trainable_variables]
    outputs = []
    for batch in batches:
        heartbeat.advance()  # progress for meshfit launch's watchdog, before the batch may wait
        x = batch[0] if isinstance(batch, tuple) and len(batch) == 1 else batch
        result = call(trainable, other, jax.tree.map(to_global, x))
        outputs.append(multihost_utils.process_allgather(result, tiled=True))
    return jax.tree.map(lambda *parts: np.concatenate(parts), *outputs)


def _addressable_rows(array: jax.Array, indices: np.ndarray) -> np.ndarray:
    """The rows `indices` (global, each held by a device of this process) of a cross-host array,
    as numpy, read from this process's shards (gathered first where it is split on other axes)."""
    if any(axis is not None for axis in tuple(array.sharding.spec)[1:]):
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))[indices]
    blocks = {}  # first row -> the block of rows a shard holds (shards of one block are copies)
    for shard in array.addressable_shards:
        blocks.setdefault(shard.index[0].start or 0, shard)
    held = np.concatenate([np.asarray(blocks[start].data) for start in sorted(blocks)])
    positions = np.concatenate([np.arange(len(array))[blocks[start].index[0]] for start in sorted(blocks)])
    return held[np.searchsorted(positions, indices)]


# ------------------------------------------- plain Keras fit, evaluate and predict on several hosts
# In a user's own `model.fit/evaluate/predict` on several hosts each process passes its own rows
# (the global batch is every process's rows together; Strategy.fit and meshfit's readers pass the
# rows cluster.local_rows gives). Keras' placement (jax.make_array_from_process_local_data) takes
# each process's rows as its devices' block of the batch: wrong where processes share a block.
# The cases Keras cannot take, mended by meshfit.fit.hooks with these helpers:

@functools.lru_cache(maxsize=64)
def rows_are_own_blocks(sharding: NamedSharding, axis: int) -> bool:
    """Whether every block of rows (axis `axis`) that `sharding` gives a device is held by the
    devices of one process only, so that each process's own rows can be its devices' blocks.
    Not so where a mesh axis across processes leaves the rows whole or shared (model_parallel
    spanning processes: 2 x 2 devices, K = 4): Keras' placement then took each process's rows
    for the whole batch, silently training other numbers on each process."""
    mesh, spec = sharding.mesh, tuple(sharding.spec)
    entry = spec[axis] if axis < len(spec) else None
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    holders = collections.defaultdict(set)  # block of rows -> processes whose devices hold it
    for coordinates, device in np.ndenumerate(mesh.devices):
        block = tuple(coordinates[mesh.axis_names.index(name)] for name in names)
        holders[block].add(device.process_index)
    return all(len(processes) == 1 for processes in holders.values())


def gathered(per_process_batch: Any, sharding: NamedSharding, axis: int = 0) -> jax.Array:
    """Every process's rows (on axis `axis`), in process order, as one batch laid out by
    `sharding`: for a batch whose rows do not split across the devices (an epoch's last batch,
    `predict` on 7 samples; laid out whole, where Keras' placement fails with JAX's
    IndivisibleError) or whose row blocks processes share (rows_are_own_blocks). A collective:
    every process places its part of the same batch, as for any batch, with as many rows."""
    mine = np.asarray(per_process_batch)
    everyone = np.asarray(multihost_utils.process_allgather(mine))  # (processes, *mine.shape)
    everyone = np.concatenate(list(everyone), axis=axis)
    return jax.make_array_from_callback(everyone.shape, sharding, lambda index: everyone[index])


def process_rows(output: Any) -> Any:
    """This process's rows of a model output that spans the hosts, as numpy: the outputs of the
    rows it passed, in order (Keras' predict fetches whole outputs, which it cannot on several
    hosts: "Fetching value for `jax.Array` that spans non-addressable ... devices is not
    possible"). Split on its rows in blocks of one process each: its host-local part, as
    local_batch takes it. Otherwise (a batch placed by `gathered`, or an output split on other
    axes too) gathered whole: the process's block of its process-ordered rows."""
    if not isinstance(output, jax.Array) or output.is_fully_addressable or not output.ndim:
        return output
    sharding = output.sharding
    spec = tuple(getattr(sharding, "spec", None) or ())
    if spec[:1] not in ((), (None,)) and all(axis is None for axis in spec[1:]) and \
            rows_are_own_blocks(sharding, 0):
        return np.asarray(multihost_utils.global_array_to_host_local_array(output, sharding.mesh,
                                                                           sharding.spec))
    if sharding.is_fully_replicated:
        whole = np.asarray(output.addressable_data(0))
    else:
        whole = np.asarray(multihost_utils.process_allgather(output, tiled=True))
    rows, count = len(whole), jax.process_count()
    if rows % count:
        raise MeshfitError(f"a model output of {rows} rows over {count} processes cannot be given "
                           "back to each process by its rows; pass every process as many samples")
    mine = rows // count
    return whole[jax.process_index() * mine:(jax.process_index() + 1) * mine]


def returning_process_rows(function):
    """A predict function `(state, iterator) -> (outputs, state)` whose outputs are this
    process's rows as numpy (process_rows): on several hosts, `predict(x)` on each process
    returns the outputs of its own x, as Keras' predict does on one."""

    def predict(state, iterator):
        outputs, state = function(state, iterator)
        return jax.tree.map(process_rows, outputs), state

    predict._meshfit_counted = True  # as the function it wraps (meshfit.fit.hooks)
    return predict


@contextlib.contextmanager
def one_batch_per_dispatch(model, several_hosts: bool):
    """For predict on several hosts: one batch per dispatch, whatever the model's
    steps_per_execution. Keras joins a dispatch's outputs on the devices, which interleaves the
    processes' rows batch by batch; process_rows gives each process its rows of one batch."""
    steps = model.steps_per_execution
    if steps == 1 or not several_hosts:
        yield
        return
    model.steps_per_execution, model.predict_function = 1, None  # made again, of one step
    try:
        yield
    finally:
        model.steps_per_execution, model.predict_function = steps, None
