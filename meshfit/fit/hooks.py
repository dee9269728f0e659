"""What meshfit adds to Keras' own `fit`, `evaluate` and `predict` while a Strategy is active.

After `meshfit.connect()` a user's unchanged Keras code runs on every device; these hooks make
plain `model.fit`/`evaluate`/`predict` (and `*_on_batch`) as solid as `Strategy.fit`:

- Placement (JAX, several devices): a batch whose rows split across the devices is sharded
  along its first axis, as Keras' `DataParallel` does. One that does not (an epoch's last batch,
  a validation remainder, `predict` on 3 images) is placed whole on every device (on several
  hosts, every process's rows: meshfit.fit.hosts, whose predict returns each its own rows)
  instead of failing with JAX's IndivisibleError (meshfit.fit.batch_placement; also under a
  distribution the user set). Every sample counts exactly as on one device (no cut, no padding:
  see meshfit.fit.sources for why padding is not exact); the price is one more compilation for
  that shape and that batch computed on every device rather than split.
- Weights in their shards (JAX, several devices): a variable whose layout splits it is drawn
  straight into its shards, never whole on one device first (meshfit.fit.sharded_init).
- Progress and the stall guard (JAX): every train, test and predict dispatch is counted
  (meshfit.parallel.heartbeat), and fit, evaluate and predict run under meshfit.parallel.stall's
  guard, so a computation that never finishes ends the process with one line after
  MESHFIT_STALL_TIMEOUT seconds instead of XLA's SIGABRT or a hang. Dispatch stays asynchronous:
  the deadlock of several CPU devices that once made meshfit finish each dispatch before the next
  is prevented at its cause, XLA:CPU's thread pool (meshfit.parallel.devices, THREADS_PER_DEVICE),
  for every computation, Keras' or not.
- Goodput (meshfit.watch.goodput): each epoch's training window is charged to the ledger of the
  process as train (an EpochClock first among fit's callbacks, which the epoch report reads too),
  compilations (JAX's compile events) apart, and the time spent fetching a batch while the
  devices had nothing left to run as input wait (see `_TimedBatches`; on TensorFlow
  `_tensorflow_timed`); evaluate is charged as eval. $MESHFIT_GOODPUT=0 turns the timing off.
  After fit, the History returned carries `history.goodput` (the parts, MFU and its peak) and,
  where fit printed its report, the goodput block is printed once.
- Compiled steps (JAX): a model that Keras would run op by op only because one of its own layers
  (RandomRotation, RandomZoom, ...) declines XLA is compiled anyway, op by op again where a layer
  does not trace, with a warning (meshfit.fit.declined_jit).
- `fit`: the per-epoch report (unless `verbose=0` or an EpochReport is given; in a Jupyter
  kernel with verbose left at "auto", meshfit's live bar and Keras' one line per epoch) and, on JAX,
  meshfit's on-device k-step loop (`meshfit.fit.jax_loop`), as `Strategy.fit` has them.

`Strategy.activate` installs the hooks once per process, through the table of patches in
meshfit.fit.keras_internals (what each changes and why). They do nothing unless a meshfit
strategy is active (for placement, with its distribution Keras' current one), so Keras behaves as
usual otherwise. Imports Keras: reached only after connect().
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
import os
import threading
import time
from typing import Any, Callable

import jax
import keras

from meshfit import env
from meshfit.fit import (batch_placement, declined_jit, hosts, jax_loop, keras_internals, library_logs,
                         memory_plan, out_of_memory, saving, sharded_init, sources)
from meshfit.parallel import cluster, heartbeat, stall
from meshfit.watch import goodput
from meshfit.watch.keras_side import progress_bar
from meshfit.watch.keras_side.epoch_clock import EpochClock
from meshfit.watch.keras_side.report import EpochReport

_active = None  # the Strategy activated last, or None
_report_off = contextvars.ContextVar("meshfit_report_off", default=False)
_FUNCTIONS = ("train_function", "test_function", "predict_function")  # each made by make_<name>


def set_active(strategy) -> None:
    """Make `strategy` (a meshfit Strategy, or None) the one the hooks serve; install them once."""
    global _active
    _active = strategy
    if strategy is not None:
        _install()
        ledger = goodput.ledger()
        if ledger.base == "startup":  # connect() has found the devices: start-up is over
            ledger.switch("setup")


def active():
    """The active meshfit Strategy, or None."""
    return _active


@contextlib.contextmanager
def report_off():
    """No per-epoch report added to `fit` inside the block (Strategy.fit(report=False))."""
    token = _report_off.set(True)
    try:
        yield
    finally:
        _report_off.reset(token)


def _distributed(strategy) -> bool:
    """True when `strategy` runs JAX on several devices and its distribution is Keras' current one."""
    return (strategy is not None and strategy.engine == "jax" and strategy.distribution is not None
            and keras.distribution.distribution() is strategy.distribution)


@functools.cache
def _install() -> None:
    """Wrap Keras' trainer and its JAX placement and variables (keras_internals.PATCHES)."""
    library_logs.drop()
    if keras.backend.backend() == "jax" and accounting():
        jax.monitoring.register_event_time_span_listener(_on_compile_span)
        goodput.compile_events = True
    keras_internals.apply_patches({
        "fit: report and loop": _fit_hook,
        "compile: jit_compile asked": declined_jit.recording_compile,
        "make_train_function: timed (TensorFlow)": _tensorflow_timed if accounting() else None,
        "distribute_data_input": functools.partial(batch_placement.hook, active=lambda: _active),
        "distribute_tensor": functools.partial(sources.divisible_placement, active=active),
        "JaxVariable._initialize_with_initializer": sharded_init.initializer_hook(
            lambda: _distributed(_active), sources.divisible_sharding),
        **{f"make_{name}": functools.partial(_make_function_hook, attribute=name) for name in _FUNCTIONS},
        **{f"{name}: stall guard": _guarded for name in ("fit", "evaluate", "predict", "train_on_batch",
                                                         "test_on_batch", "predict_on_batch")},
        "Variable.__array__": saving.gathered_reads,
        "backend.convert_to_numpy": saving.gathered_conversions,
        "saving_lib.save_model": saving.renamed_model_files,
        "H5IOStore.__init__": saving.renamed_h5_stores,
        "H5IOStore.close": saving.renamed_h5_closes,
        "BackupAndRestore.on_train_end": saving.met_before_removal,
        "Model.export": saving.exported_whole,
        "CSVLogger.on_train_begin": saving.first_process_writes,
        "file_utils.rmtree": saving.shared_removals,
        **dict.fromkeys(("keras.backend.clear_session", "keras.utils.clear_session"), _settings_kept),
    })


def _settings_kept(clear_session: Callable) -> Callable:
    """Keras' clear_session, after which the active Strategy's distribution and dtype policy are
    Keras' again (clear_session drops every global setting; a Strategy's scope or connect() set
    them, and a model built next would be on one device, in float32)."""

    @functools.wraps(clear_session)
    def clear(*args, **kwargs):
        policy = keras.config.dtype_policy()
        clear_session(*args, **kwargs)
        if _active is not None:
            keras.config.set_dtype_policy(policy)  # the user's stays theirs (Strategy.users_precision)
            _active.activate()

    return clear


def _guarded(method: Callable) -> Callable:
    """Keras' fit, evaluate or predict under the stall guard while a meshfit strategy is active,
    an out-of-memory error noted (meshfit.fit.out_of_memory). fit returns once its last step has
    run: dispatch is asynchronous, so without the wait a step that never finishes would be waited
    for after fit, unguarded (evaluate and predict return computed values already)."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if _active is None:
            return method(self, *args, **kwargs)
        name = method.__name__
        several = cluster.multi_process() and name in ("fit", "evaluate", "predict")
        steps = heartbeat.counts()[0]
        if several:
            # Made on one process alone it would wait in a collective. Not each *_on_batch: one
            # barrier a step (a custom loop's) would cost the job a round trip to the
            # coordination service every step; the stall guard ends theirs.
            hosts.meet_every_process(f"calls {name}, which runs on the devices of all "
                                     f"{jax.process_count()} processes")
            if name == "fit":
                hosts.agree_on_weights(self)
        token = hosts.first_batch.set({} if several else None)
        try:
            with stall.watching(), out_of_memory.noted(), goodput.ledger().part("eval") if (
                    name == "evaluate") else hosts.one_batch_per_dispatch(
                        self, name == "predict" and _active.hosts > 1):
                result = method(self, *args, **kwargs)
                if name == "fit":
                    jax.block_until_ready([v.value for v in self.variables])
        finally:
            hosts.first_batch.reset(token)
        if several:
            hosts.meet_after(name, heartbeat.counts()[0] - steps if name == "fit" else None)
        return result

    return guarded


def _make_function_hook(make: Callable, attribute: str) -> Callable:
    """`Trainer.make_*_function`, whose function reports each call as progress (heartbeat), compiled
    where only one of Keras' layers would keep it op by op (meshfit.fit.declined_jit)."""
    steps = attribute == "train_function"

    @functools.wraps(make)
    def make_function(self, force=False):
        layers = declined_jit.declining_layers(self) if _active is not None else []
        if layers and (force or getattr(self, attribute) is None):
            declined_jit.make(make, self, force, attribute, layers)
        else:
            make(self, force)
        function = getattr(self, attribute)
        if function is not None and not getattr(function, "_meshfit_counted", False):
            function = _counted(function, self.steps_per_execution if steps else 0)
            if attribute == "predict_function" and _active is not None and _active.hosts > 1:
                function = hosts.returning_process_rows(function)
            setattr(self, attribute, function)
        if (steps and function is not None and not getattr(function, "_meshfit_timed", False)
                and accounting()):
            setattr(self, attribute, _timed(function))
        return getattr(self, attribute)

    return make_function


def _counted(function: Callable, steps: int) -> Callable:
    """`function(state, iterator) -> (outputs, state)`, reporting `steps` training steps (0: a
    test or predict dispatch) before each call."""

    def step(state, iterator):
        heartbeat.advance(steps)
        return function(state, iterator)

    step._meshfit_counted = True
    return step


# --------------------------------------------------------------------------------- goodput

def accounting() -> bool:
    """False when $MESHFIT_GOODPUT is 0: no timing of the train loop (its overhead measured)."""
    return os.environ.get(env.GOODPUT, "1").strip() != "0"


# JAX's events for the three stages of making a program; a jit traced inside another's trace
# reports a span inside the outer one, so only the time not yet covered is counted.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_spans: list[tuple[float, float]] = []  # recent compile spans, disjoint, sorted
_compile_lock = threading.Lock()
compiled_seconds = 0.0  # compile time of this process so far


def _on_compile_span(event: str, start: float, end: float, **_) -> None:
    """JAX's listener: charge the part of a compile span not yet counted to the ledger's compile."""
    global compiled_seconds, _compile_spans
    if event not in _COMPILE_EVENTS or end <= start:
        return
    with _compile_lock:
        covered = sum(max(0.0, min(end, e) - max(start, s)) for s, e in _compile_spans)
        merged, low, high = [], start, end
        for s, e in _compile_spans:
            if e < low or s > high:
                merged.append((s, e))
            else:
                low, high = min(low, s), max(high, e)
        _compile_spans = sorted(merged + [(low, high)])[-32:]
        new = max(end - start - covered, 0.0)
        compiled_seconds += new
    goodput.ledger().move(new, "compile")


class _InputClock:
    """What the input-wait accounting knows of the dispatches: a leaf of the last dispatch's
    outputs (ready once the device has run it), the device's time per dispatch (measured now and
    then: see _TimedBatches) and when the devices run out of the dispatches queued so far."""

    PROBE_EVERY = 64  # dispatches between two measurements of the device's time per dispatch

    def __init__(self):
        self.last = None
        self.device_seconds: float | None = None
        self.dispatches = 0
        self.ambiguous = False
        self.busy_until = 0.0  # perf_counter time the devices finish the queued dispatches
        self.waited = 0.0  # input wait counted so far (seconds)


_clock = _InputClock()


class _TimedBatches:
    """The iterator a train function reads its batches from, timing each fetch.

    A fetch counts as input wait as far as the devices had no step left to run meanwhile:
    all of it when the last dispatch had finished when the fetch began (checked without
    waiting: `is_ready`), none of it when that dispatch is still running when the fetch ends,
    and otherwise the part after the devices ran out of queued dispatches (`busy_until`).
    Python runs several dispatches ahead of the devices, so that moment is not one dispatch's
    time after the last one: the devices run the dispatches in order, one at a time, each taking
    the device's time per dispatch (measured by waiting for one dispatch every PROBE_EVERY once
    such fetches occur), so they finish the queue at max(finish of the one before, its
    dispatch) + that time, bounded by what `is_ready` saw (busy at the fetch's start, done at
    its end). This is sufficient: only a fetch whose start and end disagree is estimated, and
    then within those bounds. No device sync otherwise: dispatch stays async.
    """

    def __init__(self, iterator, clock: _InputClock):
        self.iterator, self.clock = iterator, clock
        self.count = 0
        self.fetched_at = 0.0
        self.device_idle = False  # the last dispatch had finished by the end of the last fetch

    def __iter__(self):
        return self

    def __next__(self):
        clock, last = self.clock, self.clock.last
        idle = last is None or last.is_ready()
        start = time.perf_counter()
        batch = next(self.iterator)
        end = self.fetched_at = time.perf_counter()
        self.count += 1
        if idle:
            wait = end - start
        elif not last.is_ready():
            wait, clock.busy_until = 0.0, max(clock.busy_until, end)
        else:
            clock.ambiguous = idle = True
            clock.busy_until = min(max(clock.busy_until, start), end)
            wait = end - clock.busy_until
        self.device_idle = idle
        if wait > 0:
            clock.waited += wait
            goodput.ledger().move(wait, "input_wait")
        return batch


def _timed(function: Callable) -> Callable:
    """A train function `(state, iterator) -> (logs, state)` charging its time to the ledger's
    train part, with its fetches timed (_TimedBatches) and the steps it dispatched counted."""

    def train(state, iterator):
        ledger, clock = goodput.ledger(), _clock
        if ledger.base != "train":
            ledger.switch("train")
        batches = _TimedBatches(iterator, clock)
        compiled = compiled_seconds
        try:
            logs, state = function(state, batches)
        finally:
            ledger.steps += batches.count
        clock.last = _a_leaf(logs)
        clock.dispatches += 1
        clock.busy_until = max(clock.busy_until, batches.fetched_at) + (clock.device_seconds or 0.0)
        if (clock.ambiguous and clock.last is not None and batches.device_idle
                and compiled == compiled_seconds
                and (clock.device_seconds is None or clock.dispatches % clock.PROBE_EVERY == 0)):
            # The queue was empty when this dispatch went out: its time to ready is the device's.
            clock.last.block_until_ready()
            clock.busy_until = time.perf_counter()
            clock.device_seconds = clock.busy_until - batches.fetched_at
        ledger.tick()
        return logs, state

    train._meshfit_timed = True
    train._meshfit_counted = True
    train.__wrapped__ = function  # the train function itself (e.g. jax_loop's), as functools does
    return train


def _a_leaf(logs):
    """One array of a dispatch's outputs (ready once the device has run it), or None."""
    first = next(iter(logs.values()), None) if isinstance(logs, dict) else None
    if hasattr(first, "is_ready"):
        return first  # Keras' logs: a dict of arrays, no tree walk on every dispatch
    leaves = [leaf for leaf in jax.tree.leaves(logs) if hasattr(leaf, "is_ready")]
    return leaves[0] if leaves else None


def _tensorflow_timed(make: Callable) -> Callable:
    """TensorFlow's `make_train_function`, whose function reads each batch in Python, timed.

    Keras' TensorFlow train function reads the next batch inside its compiled step when handed a
    tf.data iterator, where no wait can be timed; handed any other iterator it reads the batch
    in Python and runs the same compiled one-step function on it (keras/src/backend/tensorflow/
    trainer.py, `_make_function`). A TensorFlow step on the CPU has finished when it returns, so
    the whole fetch is input wait. One step per call only: k steps per dispatch stay in-graph."""

    @functools.wraps(make)
    def make_train_function(self, force=False):
        make(self, force)
        function = self.train_function  # (Keras returns it only when it was made before)
        if (_active is None or self.steps_per_execution != 1 or self.run_eagerly or function is None
                or getattr(function, "_meshfit_timed", False)):
            return function

        def train(iterator):
            batches = _TimedBatches(iterator, _InputClock())  # no dispatch in flight: all wait
            first = next(batches)  # the end of the data raises StopIteration, as Keras expects
            logs = function(itertools.chain([first], batches))  # read in Python: no tf.data
            ledger = goodput.ledger()
            ledger.steps += batches.count  # as on JAX: a resume counts the steps run again
            ledger.tick()
            return logs

        train._meshfit_timed = True
        train.__wrapped__ = function
        self.train_function = train
        return train

    return make_train_function


def goodput_of(report: EpochReport | None) -> dict[str, Any]:
    """{"goodput": the ledger's parts so far, "mfu", "peak"} (MFU over every timed epoch of
    `report`, with its peak and where that comes from)."""
    result = {"goodput": goodput.ledger().totals(), "mfu": None, "peak": None}
    if report is not None:
        result["mfu"], result["peak"] = report.run_mfu(), report.peak
    return result


def _fit_hook(fit: Callable) -> Callable:
    """`Trainer.fit` with the per-epoch report and the on-device loop while a Strategy is active."""
    signature = inspect.signature(fit)

    @functools.wraps(fit)
    def hooked_fit(self, *args, **kwargs):
        strategy = _active
        if strategy is None:
            return fit(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        sources.check_fit_ends(arguments)
        callbacks = arguments.get("callbacks")
        if callbacks is None or isinstance(callbacks, (list, tuple)):  # a CallbackList stays as given
            callbacks, verbose = list(callbacks or []), arguments.get("verbose", "auto")
            chief = strategy.info.process_index == 0
            if verbose == "auto" and chief and env.notebook():
                # A notebook: meshfit's bar redrawn in place, and Keras' one line per epoch, rather
                # than Keras' bar, whose carriage returns pile up in the saved output.
                callbacks.insert(0, progress_bar.ProgressBar(_global_batch(arguments)))
                verbose = arguments["verbose"] = 2
            if (verbose != 0 and not _report_off.get() and chief
                    and not any(isinstance(c, EpochReport) for c in callbacks)):
                callbacks.append(EpochReport(global_batch=_global_batch(arguments), strategy=strategy))
            _progress_bar_first(callbacks, verbose)
            arguments["callbacks"] = callbacks
        memory_plan.plan_at_first_fit(strategy, self, arguments)  # sharding="auto": laid out to fit
        if (strategy.engine == "jax" and self.train_function is None and self.jit_compile
                and not self.run_eagerly):
            jax_loop.install(self, self.steps_per_execution)
        token = batch_placement.fit_batches.set({})
        _clock.last = None
        given = arguments.get("callbacks") or []
        given = given.callbacks if isinstance(given, keras.callbacks.CallbackList) else given
        report = next((c for c in given if isinstance(c, EpochReport)), None)
        if report is not None and report.input_source is None:
            report.input_source = sources.kind(arguments.get("x"), self)
        _with_epoch_clock(arguments, report)
        ledger = goodput.ledger()
        try:
            history = fit(*bound.args, **bound.kwargs)
        finally:
            batch_placement.fit_batches.reset(token)
            if ledger.base == "train":
                ledger.switch("other")
        if history is not None and ledger.owner is None:  # a plain fit: the process so far
            history.goodput = goodput_of(report)
            if report is not None and report.epochs and report.stream is not None:
                print(goodput.format_block(history.goodput["goodput"], history.goodput["mfu"],
                                           history.goodput["peak"]), file=report.stream, flush=True)
        return history

    return hooked_fit


def _with_epoch_clock(arguments: dict[str, Any], report: EpochReport | None) -> None:
    """An EpochClock first among fit's callbacks (unless the caller gave a CallbackList), read by
    `report`: the ledger charges each epoch's training window to train, nothing else of fit
    (meshfit.watch.keras_side.epoch_clock); first, so the window ends before any epoch end runs."""
    callbacks = arguments.get("callbacks")
    if callbacks is None or isinstance(callbacks, list):
        clock = EpochClock()
        arguments["callbacks"] = [clock, *(callbacks or [])]
        if report is not None:
            report.use_clock(clock)


def _progress_bar_first(callbacks: list, verbose) -> None:
    """Put Keras' progress bar (verbose != 0) before the first EpochReport in `callbacks`. Keras
    appends its bar after the given callbacks, so at an epoch's end the report would print its
    line into the middle of the bar's unfinished one; a ProgbarLogger among the callbacks is the
    one Keras uses, so placed first it ends its line first."""
    first = next((i for i, c in enumerate(callbacks) if isinstance(c, EpochReport)), None)
    if first is not None and verbose != 0 and not any(
            isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks):
        callbacks.insert(first, keras.callbacks.ProgbarLogger())


def _global_batch(arguments: dict[str, Any]) -> int | None:
    """The global batch of a `fit` call, where it is known (arrays: batch_size, else Keras' 32)."""
    if arguments.get("batch_size"):
        return arguments["batch_size"]
    x, y = arguments.get("x"), arguments.get("y")
    return sources.KERAS_BATCH if x is not None and sources.is_arrays(x, y) else None
