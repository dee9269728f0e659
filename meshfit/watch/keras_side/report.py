"""The per-epoch report: loss and metrics, epoch time, ms/step, samples/s and MFU.

MFU = FLOPs of one train step (XLA's cost analysis of the compiled step) / (step time x peak
FLOP/s of the devices in use: a data sheet's, or on CPUs a measured one, see meshfit.watch.peak).
Compilation (the first step's extra time) is reported apart from training time, and validation
time is not counted as training. An epoch whose input wait (meshfit.watch.goodput's ledger)
exceeds 10% of its step time prints the input-bound line once per fit.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import sys
from typing import Any

import jax
import keras

from meshfit.parallel import modes
from meshfit.parallel.sharding import format_bytes
from meshfit.watch import goodput, kept, peak
from meshfit.watch.keras_side.epoch_clock import EpochClock, wait_for_device  # noqa: F401 (theirs)


def train_step_flops(model, global_batch: int) -> float | None:
    """FLOPs of one training step on a global batch (`count_train_step_flops`), counted once
    per model, batch and versions (`flops_key`) and then kept (watch.kept's flops.json): the
    count traces the whole step, 0.6-0.7 CPU-s of the main job's set-up (2-core EPYC, 2026-11-27)."""
    key = flops_key(model, global_batch)
    known = kept.read("flops").get(key) if key else None
    if isinstance(known, (int, float)) and known > 0:
        return float(known)
    flops = count_train_step_flops(model, global_batch)
    if key and flops:
        kept.keep("flops", key, flops)
    return flops


def flops_key(model, global_batch: int) -> str | None:
    """What a train step's FLOP count depends on, hashed: the model's layers and dtype policy
    (its JSON), its compile settings (optimizer, loss, metrics), the batch, the engine, the
    versions of Keras and the engine's library, and, by size and modification time, the files
    that define the model's own (non-Keras) classes, so edited layer code is counted anew.
    None where the model cannot be described so (counted in every run then). Keras' JSON of a
    model asks whether TensorFlow is installed (serialization_lib's `tf.available`), which on the
    JAX engine counts it only once loaded (keras_internals.tensorflow_counted_once_loaded), so
    describing the model loads no TensorFlow there (tests/test_engine.py checks that the JAX
    engine never loads it). Why a key on JAX too: counting lowers the whole step, twice on a GPU
    (whose lowered step has no cost analysis), in every run without one."""
    try:
        engine = keras.backend.backend()
        library = sys.modules.get("tensorflow" if engine == "tensorflow" else engine)
        classes, stack = set(), [model]
        while stack:
            layer = stack.pop()
            classes.add(type(layer))
            stack.extend(getattr(layer, "layers", None) or [])
        files = sorted({inspect.getfile(c) for c in classes if not c.__module__.startswith("keras")})
        described = [model.to_json(), model.get_compile_config(), global_batch, engine,
                     keras.__version__, getattr(library, "__version__", None),
                     [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]]
        text = json.dumps(described, sort_keys=True, default=repr)
    except Exception:  # a model, config or class file that cannot be described: no key
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def count_train_step_flops(model, global_batch: int) -> float | None:
    """FLOPs of one training step on a global batch, from XLA's cost analysis; None if unknown.

    Lowers the model's own stateless `train_step` for the whole (unsharded) batch, so the count
    covers forward, backward and optimizer update of all replicas together. On TensorFlow, the
    traced train step's graph is counted by TensorFlow's profiler instead.
    """
    if not getattr(model, "optimizer", None):
        return None
    if keras.backend.backend() == "tensorflow":
        return _tensorflow_step_flops(model, global_batch)
    if keras.backend.backend() != "jax":
        return None
    try:
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)

        def spec(tensor, batch=False):
            shape = tuple(tensor.shape)
            return jax.ShapeDtypeStruct(((global_batch,) + shape[1:]) if batch else shape, tensor.dtype)

        state = tuple([spec(v) for v in group] for group in (
            model.trainable_variables, model.non_trainable_variables,
            model.optimizer.variables, model.metrics_variables))
        x = [spec(t, batch=True) for t in model.inputs]
        x = x[0] if len(x) == 1 else x
    except Exception:  # a model whose step cannot be lowered this way simply gets "n/a"
        return None
    # The class's step, not meshfit's micro-batched one (jax_microbatch sets it on the instance):
    # XLA's cost analysis counts a loop's body once (a K-slice step counted 1/K of the FLOPs).
    whole_step = functools.partial(type(model).train_step, model)
    for one_hot in (False, True):  # sparse labels first, then labels shaped like the outputs (mse)
        y = [spec(o, batch=True) if one_hot else
             jax.ShapeDtypeStruct((global_batch,) + tuple(o.shape[1:-1]), "int32") for o in model.outputs]
        try:
            # The lowered (not compiled) step's cost analysis: the same count without a second
            # compile. GPUs give none before compiling (seen on an H100, JAX 0.11.2), so the step
            # is then lowered with the CPU as default device, whose analysis counts the same.
            for device in (None, jax.devices("cpu")[0]):
                with jax.default_device(device):
                    cost = lower_train_step(model, state, (x, y[0] if len(y) == 1 else y),
                                            step=whole_step).cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                flops = float((cost or {}).get("flops", 0.0))
                if flops > 0:
                    return flops
            return None
        except Exception:  # labels of the other shape, or a step that cannot be lowered: "n/a"
            continue
    return None


def lower_train_step(model, *arguments, step=None, **jit_options):
    """`jax.jit(step or model.train_step, **jit_options).lower(*arguments)`, leaving the model as
    it was when the trace fails.

    Keras' JAX `compute_loss_and_updates` puts the traced `add_loss` terms in
    `model._losses_override` and empties it only when the trace gets through the loss. A trace
    that fails there (labels of a shape the loss rejects) leaves its tracers in it, and the next
    trace of the model's step returns that list as the forward pass' losses and empties it: the
    `add_loss` terms are silently dropped from the next fit or evaluate
    (docs/reference/keras-losses-override.md)."""
    try:
        return jax.jit(step or model.train_step, **jit_options).lower(*arguments)
    finally:
        if getattr(model, "_losses_override", None):  # only a failed trace leaves it non-empty
            model._losses_override = []


def _tensorflow_step_flops(model, global_batch: int) -> float | None:
    """FLOPs of one train step on TensorFlow: its traced graph's operations with a FLOP count
    (matmuls, convolutions and their gradients: TensorFlow's profiler), None if unknown."""
    try:
        import tensorflow as tf  # the TensorFlow engine: Keras imported it already
        from tensorflow.python.profiler import model_analyzer, option_builder
        from tensorflow.python.util import deprecation

        x = [tf.TensorSpec((global_batch,) + tuple(t.shape[1:]), t.dtype) for t in model.inputs]
        y = [tf.TensorSpec((global_batch,) + tuple(o.shape[1:-1]), tf.int32) for o in model.outputs]
        x, y = (x[0] if len(x) == 1 else x), (y[0] if len(y) == 1 else y)
        # The class's step, not meshfit's micro-batched one (tf_microbatch sets it on the
        # instance): the same FLOPs, without a loop the profiler would count once.
        step = type(model).train_step
        graph = tf.function(lambda a, b: step(model, (a, b))).get_concrete_function(x, y).graph
        builder = option_builder.ProfileOptionBuilder
        options = builder(builder.float_operation()).with_empty_output().build()
        with deprecation.silence():
            flops = model_analyzer.profile(graph, options=options).total_float_ops
        return float(flops) if flops > 0 else None
    except Exception:  # a model whose step cannot be traced this way simply gets "n/a"
        return None


def discovery_text(d: dict[str, Any]) -> str:
    """The discovery report (Strategy.describe()'s dict) as text, like the tutorials' TPU log."""
    sim = " (simulated on the CPU)" if d["simulated"] else ""
    mixed = ", float32 variables" if d["precision"] != "float32" else ""
    peak = (f"{d['peak_flops'] / 1e12:.1f} TFLOP/s" if d["peak_flops"] else
            "measured by a matmul probe at the first fit (cached)" if d["platform"] == "cpu" else "n/a")
    rows = [
        ("platform", f"{d['platform']}{sim}"),
        ("device kind", d["device_kind"]),
        ("hosts", f"{d['hosts']} (this is process {d['process_index']})"),
        ("devices per host", d["devices_per_host"]),
        ("replicas", d["replicas"] if d.get("model_parallel", 1) == 1 else
         f"{d['replicas']}, each on {d['model_parallel']} devices (mesh batch {d['replicas']} x model "
         f"{d['model_parallel']}: every kernel split over model)"),
        ("engine", f"keras on {d['engine']}"),
        ("precision", f"{d['precision']} ({d['keras_policy']}{mixed})"),
        ("per-core batch", f"multiple of {d['per_core_batch_multiple']}"),
        ("peak", peak),
    ]
    if "sharding" in d:
        rows.append(("sharding", sharding_text(d)))
    return "meshfit connected\n" + "\n".join(f"  {k:<17}{v}" for k, v in rows)


def sharding_text(d: dict[str, Any]) -> str:
    """The discovery report's sharding row: the mode and why (see meshfit.parallel.modes)."""
    memory = d.get("device_memory")
    known = f"{format_bytes(memory)} per device" if memory else "device memory unknown"
    asked, mode = modes.sharding_named(d["sharding_asked"]), modes.mode_named(d["sharding"])
    if asked is modes.AUTO and d["replicas"] > 1 and d["engine"] == "jax":
        why = (f"planned per model when training: {modes.AUTO.fallback} if the replicated step "
               "does not fit (variables past a quarter of a device are created sharded)"
               if memory else "data-parallel (set --device-memory to plan)")
        if memory and d.get("model_parallel_asked", 1) is None:
            why += ("; if neither fits, the smallest model parallelism K that does (meshfit train "
                    "uses it; a plain fit names the model_parallel=K to connect with)")
        return f"auto ({known}): {why}"
    why = "asked" if asked is mode else "one replica"
    if mode.splits_state:
        why += f"; variables of at least {format_bytes(d['fsdp_min_bytes'])} over {d['replicas']} devices"
    return f"{mode} ({mode.description}; {why}; {known})"


def format_epoch_line(epoch: int, epochs: int, logs: dict[str, Any], stats: dict[str, Any]) -> str:
    """One line per epoch: metrics, then the training steps' time, ms/step, samples/s, MFU, and
    apart the epoch's compile time, input wait, and for an epoch resumed in its middle, the part
    trained in this sitting."""
    metrics = " ".join(f"{k} {v:.4f}" for k, v in logs.items() if isinstance(v, (int, float)))
    mfu = f"{stats['mfu'] * 100:.1f}%" if stats.get("mfu") is not None else "n/a"
    sps = f"{stats['samples_per_second']:,.0f}" if stats.get("samples_per_second") else "n/a"
    line = (f"epoch {epoch + 1}/{epochs}  {metrics}  |  {stats['train_seconds']:.2f} s  "
            f"{stats['ms_per_step']:.1f} ms/step  {sps} samples/s  MFU {mfu}")
    if stats.get("compile_seconds", 0.0) >= 0.005:
        line += f"  (+{stats['compile_seconds']:.2f} s compile)"
    if stats.get("input_wait_seconds", 0.0) >= 0.005:
        line += f"  (+{stats['input_wait_seconds']:.2f} s input wait)"
    sitting = stats.get("sitting")
    if sitting:
        line += (f"  (resumed: {sitting['steps']} of its {stats['steps']} steps in this sitting, "
                 f"{sitting['train_seconds']:.2f} s)")
    return line


class EpochReport(keras.callbacks.Callback):
    """Prints the per-epoch line and keeps the figures in `self.epochs` (a list of dicts).

    Every time figure is read from the goodput ledger over the epoch's training window (see
    meshfit.watch.keras_side.epoch_clock): `train_seconds` is the ledger's train part in it (the
    training steps, less compilation, input wait and mid-epoch saves, which are shown or counted
    apart), so the epochs add up to the goodput block's train. The same window's compile, input
    wait and checkpoint seconds are kept beside it.

    global_batch: samples per step over all replicas, for samples/s and MFU (None: samples/s is
    "n/a"); the older keyword `batch_size` is still accepted.
    strategy: the meshfit Strategy in use, for the devices' peak FLOP/s.
    earlier: for a run resumed in the middle of an epoch, `earlier(epoch) -> (steps, seconds,
    input wait seconds)` the earlier sittings trained of that epoch: its figures then cover the
    whole epoch, and its line says what this sitting trained.
    """

    def __init__(self, global_batch: int | None = None, strategy=None, stream=None, *,
                 batch_size: int | None = None, earlier=None):
        super().__init__()
        self.global_batch = global_batch if batch_size is None else batch_size
        self.strategy = strategy
        self.stream = stream or sys.stdout
        self.earlier = earlier
        self.epochs: list[dict[str, Any]] = []
        self.flops_per_step: float | None = None
        self.clock: EpochClock | None = None  # fit's (meshfit.fit.hooks), else one of its own
        self._own_clock = False
        self._first_call: float | None = None
        self._compile_counted = False
        self.input_source: str | None = None  # the kind of data source (goodput.input_fix)
        self.peak: dict[str, Any] | None = None  # peak.peak_of(strategy), found at the first epoch end
        self.input_bound: str | None = None  # the input-bound line, once printed
        self._probed_again = False

    def use_clock(self, clock: EpochClock) -> None:
        """Read the windows of `clock`, which fit calls before this report (meshfit.fit.hooks)."""
        self.clock, self._own_clock = clock, False

    def set_model(self, model):
        super().set_model(model)
        if self.clock is None:  # no meshfit hook put one first among the callbacks: keep our own
            self.clock, self._own_clock = EpochClock(), True
        if self._own_clock:
            self.clock.set_model(model)

    def on_train_begin(self, logs=None):
        self._first_call = None
        self._compile_counted = False
        self.input_bound = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._own_clock:
            self.clock.on_epoch_begin(epoch)
        self._steps = 0
        self._skipped = 0
        self._moved = 0.0  # of this epoch's train, moved to compile so far (the estimate below)

    def _estimates_compile(self) -> bool:
        """True where no compile events reach the ledger (TensorFlow; JAX with accounting off):
        the first call's extra time is then taken for its compilation (_compile_estimate)."""
        return not goodput.compile_events and not self._compile_counted

    def on_train_batch_begin(self, batch, logs=None):
        # `batch` is the index of the call's first step, so the steps done so far (k per call with
        # steps_per_execution). No on_train_batch_end: defining it makes Keras sync every step.
        self._steps = batch
        if self._first_call is None and batch >= 1 and self._estimates_compile():
            wait_for_device(self.model)  # the first call (1 step, or k) holds the compilation
            self._first_call = self.clock.spent()["train"] + self._moved
            self._skipped = batch

    def _settle_compile(self, train: float, steps: int) -> float:
        """Charge the first call's compilation, as estimated now, to the ledger's compile (the
        epoch's train so far: `train` seconds, before any such move, over `steps` steps) and
        return it. The estimate: the first call's time beyond its `_skipped` ordinary steps,
        each taken at the mean of the later ones. Settled again at each look (a mid-epoch
        checkpoint's, the epoch end's), so the ledger and the figures always hold the same one."""
        estimate = 0.0
        if self._first_call is not None and self._skipped and self._estimates_compile():
            later = max(train - self._first_call, 0.0) / max(steps - self._skipped, 1)
            estimate = min(max(self._first_call - self._skipped * later, 0.0), self._first_call)
        ledger, change = goodput.ledger(), estimate - self._moved
        if change > 0:
            ledger.move(change, "compile", source="train")
        else:
            ledger.move(-change, "train", source="compile")
        self._moved = estimate
        return estimate

    def so_far(self) -> dict[str, Any]:
        """This sitting's part of the epoch in progress, as its epoch end would count it: steps,
        train and input wait seconds ({} before the first step and once its training has ended).
        A checkpoint in mid-epoch keeps them (meshfit.run.keras_side.fit_and_score)."""
        if self.clock is None or not self.clock.training() or not self._steps:
            return {}
        wait_for_device(self.model)
        self._settle_compile(self.clock.spent()["train"] + self._moved, self._steps)
        spent = self.clock.spent()
        return {"steps": self._steps, "train_seconds": spent["train"],
                "input_wait_seconds": spent["input_wait"]}

    def on_test_begin(self, logs=None):
        """The epoch's training ends (meshfit's own validation calls this before it begins)."""
        if self.clock is not None:
            self.clock.end_training()

    def on_epoch_end(self, epoch, logs=None):
        self.clock.end_training()  # done already where the clock comes first among the callbacks
        ledger = goodput.ledger()
        steps = self.params.get("steps") or self._steps + 1
        spent = self.clock.spent()  # at the window's end, with the compile moved by then
        before = self._moved
        # TensorFlow reports no compilation: the first call's extra time is its compile, charged
        # to compile on the ledger too, so that the line and the goodput block keep agreeing.
        change = self._settle_compile(spent["train"] + before, steps) - before
        if self._first_call is not None:
            self._compile_counted = True
        train, compile_seconds = spent["train"] - change, spent["compile"] + change
        waited = spent["input_wait"]
        sitting = {"steps": steps, "train_seconds": train, "input_wait_seconds": waited}
        earlier_steps, earlier_seconds, earlier_wait = self.earlier(epoch) if self.earlier else (0, 0.0, 0.0)
        steps, train, waited = steps + earlier_steps, train + earlier_seconds, waited + earlier_wait
        step_seconds = train / max(steps, 1)
        with ledger.part("setup"):  # once per fit; a CPU's peak kept per machine (meshfit.watch.peak)
            if self.flops_per_step is None and self.global_batch:
                self.flops_per_step = train_step_flops(self.model, self.global_batch) or 0.0
            if self.peak is None and self.strategy is not None:
                self.peak = peak.peak_of(self.strategy)
        peak_flops = (self.peak or {}).get("flops")
        if (peak_flops and self.flops_per_step and step_seconds
                and self.flops_per_step / step_seconds > peak_flops
                and "probe" in self.peak["source"] and not self._probed_again):
            # Above 100%: the cached probe ran while other work shared the cores; probe again.
            self._probed_again = True
            with ledger.part("setup"):
                self.peak = peak.peak_of(self.strategy, again=True)
            peak_flops = self.peak["flops"]
        stats = {
            "epoch": epoch + 1,
            "steps": steps,
            "train_seconds": train,
            "ms_per_step": 1000 * step_seconds,
            "samples_per_second": (self.global_batch / step_seconds)
                                  if self.global_batch and step_seconds else None,
            "flops_per_step": self.flops_per_step or None,
            "mfu": (self.flops_per_step / step_seconds / peak_flops)
                   if (peak_flops and self.flops_per_step and step_seconds) else None,
            "compile_seconds": compile_seconds,
            "input_wait_seconds": waited,
            "checkpoint_seconds": spent["checkpoint"],
            "sitting": sitting if earlier_steps else None,
            "goodput": ledger.totals(),
        }
        self.epochs.append(stats)
        print(format_epoch_line(epoch, self.params.get("epochs", epoch + 1), logs or {}, stats),
              file=self.stream, flush=True)
        line = goodput.input_bound_line(waited, train + waited, self.input_source,
                                        getattr(self.model, "steps_per_execution", 1) or 1,
                                        self.strategy.platform if self.strategy else "cpu")
        if line and self.input_bound is None:
            self.input_bound = line
            print(line, file=self.stream, flush=True)

    def run_mfu(self) -> float | None:
        """MFU over every epoch this report timed: FLOPs of all timed steps / their seconds /
        the peak FLOP/s (None where the FLOPs or the peak are unknown)."""
        peak_flops = (self.peak or {}).get("flops")
        seconds = sum(e["train_seconds"] for e in self.epochs)
        steps = sum(e["steps"] for e in self.epochs)
        if not (peak_flops and self.flops_per_step and seconds):
            return None
        return self.flops_per_step * steps / seconds / peak_flops
