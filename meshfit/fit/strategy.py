"""`Strategy`: one model on every device, each taking 1/N of a batch; `meshfit.connect()` returns
one once the engine is chosen (`connected`).

On JAX this is Keras' own `keras.distribution.DataParallel` over a `jax.sharding` mesh: variables
are replicated, every global batch is split along its first axis, and XLA inserts the gradient
all-reduce. With sharding="fsdp" the large variables are sharded over the same devices instead
(`MeshParallel`, by the mode's rule: meshfit.parallel.modes), each drawn straight into its shards
(meshfit.fit.sharded_init). Nothing here writes a collective by hand.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from typing import Any, Iterator

import keras

from meshfit.errors import MeshfitError
from meshfit.fit import hooks, hosts, jax_microbatch, memory_plan, sources, tf_bias_gradient, tf_microbatch
from meshfit.parallel import devices as devices_lib
from meshfit.parallel import engine as engine_lib
from meshfit.parallel import modes, planning
from meshfit.parallel import sharding as sharding_lib
from meshfit.watch.keras_side.report import EpochReport, discovery_text


class MeshLayout(keras.distribution.TensorLayout):
    """Keras' TensorLayout, whose entries may also name several mesh axes (('batch', 'model'):
    one dimension split over both), as jax.sharding.PartitionSpec allows and
    a mode's partition rule (meshfit.parallel.modes) lays out; Keras' own check takes single names only."""

    def _validate_axes(self):
        names = {n for a in self.axes for n in (a if isinstance(a, tuple) else (a,))} - {None}
        if self.device_mesh and names - set(self.device_mesh.axis_names):
            raise ValueError(f"layout axes {sorted(names)} are not all axes of the mesh "
                             f"{self.device_mesh.axis_names}")


class MeshParallel(keras.distribution.ModelParallel):
    """Keras' `ModelParallel` on a mesh (N/K) x K with axes 'batch' and 'model', whose variables
    are laid out by their sharding mode's rule from their shapes (meshfit.parallel.modes): 'data'
    (whole on 'batch'), 'fsdp' (large variables sharded over 'batch'), and with model_parallel
    K > 1 every kernel split over 'model' too. With K = 1 and 'data' this is Keras' `DataParallel`.

    sharding: a ShardingMode (or its name); changing it changes the layout of variables created afterwards
    (see Strategy.relayout for those that exist). fsdp_min_bytes: variables smaller stay whole on
    'batch'. layout_map: a `keras.distribution.LayoutMap` (or a function of the mesh returning
    one, e.g. keras-hub's `Backbone.get_layout_map`) whose entries win over the rule; see
    `use_layout_map`. auto_shard_dataset is off: on several hosts each process feeds its own
    rows (see Strategy.fit), and that must be the only per-process cut. Keras shards data across
    processes only where it is on: tf.data in 3.15 (which then refuses arrays and PyDatasets),
    also arrays, PyDatasets and torch DataLoaders from 3.16 (keras-team/keras#23044, #23046);
    with it off every Keras passes each process's rows through as they are (tests/test_launch.py
    counts the samples a 2-process job trains on).

    spill_after: bytes (under 'auto' with the device memory known: a quarter of it), else None.
    While the mode is auto's first ('data'), variables are then laid out so until the live ones
    so laid out would pass it, and by auto's fallback ('fsdp') beyond, so that a model too large
    to hold replicated can be built before its first fit plans it (Strategy.relayout then lays
    out every one as chosen).
    A quarter because a replicated step holds each weight it trains at least four times (the
    weight, its gradient and Adam's two moments): past it, such a step cannot fit, and the
    device keeps three quarters for the shares of what follows. Where it still fits (frozen
    weights, as under LoRA), the first fit gathers them.
    """

    def __init__(self, *, devices, sharding: modes.ShardingMode | str, fsdp_min_bytes: int,
                 model_parallel: int = 1, layout_map=None):
        mesh = keras.distribution.DeviceMesh((len(devices) // model_parallel, model_parallel),
                                             ("batch", "model"), list(devices))
        super().__init__(layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch",
                         auto_shard_dataset=False)
        self.sharding = modes.mode_named(sharding)
        self.fsdp_min_bytes, self.model_parallel = fsdp_min_bytes, model_parallel
        self.spill_after: int | None = None
        self.replicated_bytes = 0  # of the live variables laid out by auto's first while spill_after is set
        if layout_map is not None:
            self.use_layout_map(layout_map)

    @property
    def axis_sizes(self) -> dict[str, int]:
        """The mesh's axis sizes by name: {'batch': N/K, 'model': K}."""
        return dict(zip(self.device_mesh.axis_names, self.device_mesh.shape))

    def use_layout_map(self, layout_map) -> None:
        """Take the entries of `layout_map` (a LayoutMap on any mesh whose axis names this mesh
        has, e.g. one keras-hub made for a mesh of its own; or a function of this mesh returning
        one) onto this mesh; they win over the rule for variables created afterwards. Entries
        naming an axis this mesh lacks are left out with one warning."""
        if callable(layout_map) and not isinstance(layout_map, keras.distribution.LayoutMap):
            layout_map = layout_map(self.device_mesh)
        if not isinstance(layout_map, keras.distribution.LayoutMap):
            raise MeshfitError(f"layout_map must be a keras.distribution.LayoutMap (or a function "
                               f"of the mesh returning one), got a {type(layout_map).__name__}")
        ignored = []
        for key, layout in layout_map.items():
            axes = tuple(getattr(layout, "axes", layout))
            if all(a is None or a in self.device_mesh.axis_names for a in axes):
                self._layout_map[key] = keras.distribution.TensorLayout(axes, self.device_mesh)
            else:
                ignored.append(key)
        if ignored:
            warnings.warn(f"layout_map: {len(ignored)} entr{'y' if len(ignored) == 1 else 'ies'} "
                          f"({', '.join(ignored[:3])}{', ...' if len(ignored) > 3 else ''}) name an "
                          f"axis this mesh lacks (it has {', '.join(self.device_mesh.axis_names)}): "
                          "ignored; those variables follow meshfit's rule", stacklevel=3)

    def spec(self, shape, dtype, sharding: modes.ShardingMode | str | None = None) -> list:
        """A variable's partition spec by the rule of `sharding` (a mode or its name; default:
        this one's)."""
        sizes = self.axis_sizes
        mode = self.sharding if sharding is None else modes.mode_named(sharding)
        return mode.partition(shape, dtype, sizes["batch"], self.fsdp_min_bytes, "batch", sizes["model"])

    def _forget(self, whole: int) -> None:
        self.replicated_bytes -= whole

    def axes_under(self, shape, dtype, axes, sharding: modes.ShardingMode | str) -> list:
        """The axes a variable laid out as `axes` takes under `sharding`: the rule's where `axes`
        are some registered mode's, else `axes` (a layout_map entry's, or its optimizer slot's,
        kept under every mode); padded to the variable's rank."""
        axes = (list(axes) + [None] * len(shape))[:len(shape)]
        follows = any(axes == self.spec(shape, dtype, mode) for mode in modes.MODES.values())
        return self.spec(shape, dtype, sharding) if follows else axes

    def get_variable_layout(self, variable):
        # Keras gives an optimizer slot its weight's layout (add_variable_from_reference): keep it,
        # so that Adam's moments are sharded like their weights.
        if getattr(variable, "_layout", None) is not None:
            return variable._layout
        layout = self._layout_map[variable.path]
        if layout is not None:
            return layout
        mode = self.sharding
        if self.spill_after is not None and mode is modes.AUTO.first:
            whole = sharding_lib.bytes_per_device(tuple(variable.shape), variable.dtype, [], 1)
            if self.replicated_bytes + whole > self.spill_after:
                mode = modes.AUTO.fallback
            else:  # counted while it lives: a model built again, or dropped, frees its bytes
                self.replicated_bytes += whole
                weakref.finalize(variable, self._forget, whole)
        return MeshLayout(self.spec(variable.shape, variable.dtype, mode), self.device_mesh)


def keras_distribution(devices: list, sharding: modes.ShardingMode | str, fsdp_min_bytes: int,
                       layout_map=None, model_parallel: int = 1) -> MeshParallel:
    """The Keras distribution for `sharding` (a mode or its name) over `devices`, as a mesh
    (devices/model_parallel) x model_parallel with axes 'batch' and 'model'."""
    return MeshParallel(devices=devices, sharding=sharding, fsdp_min_bytes=fsdp_min_bytes,
                        model_parallel=model_parallel, layout_map=layout_map)


class Strategy:
    """The devices in use, the engine and precision chosen, the batch plan and the sharding.

    sharding: 'auto' (the default, modes.DEFAULT), or a mode of meshfit.parallel.modes: 'data'
    (replicated variables), 'fsdp' (large variables sharded); a name or the object. 'auto' lays
    variables out as 'data' (with the device memory known, those past a quarter of it as 'fsdp':
    MeshParallel.spill_after) until a model's first fit (memory_plan.plan_at_first_fit) or
    memory_plan.choose_sharding picks a mode. `sharding` is then the ShardingMode in use and
    `sharding_asked` what was asked (modes.AUTO or a mode).
    fsdp_min_bytes: under fsdp, variables smaller than this stay replicated.
    device_memory: bytes per device to plan with (None: the device's own figure, where known).
    layout_map: optional keras.distribution.LayoutMap whose entries win over the fsdp rule.
    Values come checked (meshfit.connect checks what users pass).
    """

    def __init__(self, info: devices_lib.DeviceInfo, engine: str, precision: str,
                 sharding: modes.ShardingMode | str | None = None,
                 fsdp_min_bytes: int = sharding_lib.DEFAULT_FSDP_MIN_BYTES,
                 device_memory: int | None = None, layout_map=None, model_parallel: int | None = 1,
                 precision_auto: bool = False):
        self.info = info
        self.engine = engine
        self.precision = precision
        self.precision_auto = precision_auto  # chosen for the devices: a user's own policy wins
        self.per_core_multiple = planning.batch_multiple(info.platform, info.device_kind)
        self.sharding_asked = asked = modes.sharding_named(sharding)  # None: modes.DEFAULT
        self.fsdp_min_bytes = fsdp_min_bytes
        self.device_memory = device_memory
        # None: not given, so that 'auto' may choose it (memory_plan.model_parallel_plans); 1 until then.
        self.model_parallel_asked = model_parallel
        model_parallel = self.model_parallel = model_parallel or 1
        # under auto, its first mode until choose_sharding decides
        self.sharding: modes.ShardingMode = modes.AUTO.first if asked is modes.AUTO else asked
        self._distribution = None
        distributed = engine == "jax" and len(info.devices) > 1
        if self.sharding.splits_state and not distributed:
            warnings.warn(f"sharding {self.sharding} needs several devices on the JAX engine; with "
                          f"{len(info.devices)} device(s) on {engine} every variable is whole on "
                          "each device (data-parallel)", stacklevel=2)
            self.sharding = modes.DATA
        if model_parallel > 1 and not distributed:
            raise MeshfitError(f"model_parallel={model_parallel} needs several devices on the JAX "
                               f"engine (here {len(info.devices)} on {engine}); use model_parallel=1")
        if model_parallel > 1 and len(info.devices) % model_parallel:
            raise MeshfitError(f"model_parallel={model_parallel} does not divide the "
                               f"{len(info.devices)} devices; use a divisor of {len(info.devices)}")
        if distributed:
            # One device needs no distribution: Keras' distributed input path would cost ~0.3 ms/step.
            self._distribution = keras_distribution(list(info.devices), self.sharding,
                                                    fsdp_min_bytes, layout_map, model_parallel)
            memory = devices_lib.memory_bytes(info, device_memory) if asked is modes.AUTO else None
            if memory is not None:
                self._distribution.spill_after = memory // 4
        elif layout_map is not None:
            warnings.warn(f"layout_map ignored: {len(info.devices)} device(s) on {engine} lay "
                          "nothing out (it needs several devices on the JAX engine)", stacklevel=2)
        self._layout_map = layout_map

    def with_sharding(self, sharding: modes.ShardingMode | str,
                      model_parallel: int | None = None) -> "Strategy":
        """This strategy on the same devices with another sharding (a mode or its name) and, given
        model_parallel, another mesh ((devices/K) x K), e.g. what the memory plan chose for 'auto';
        activate it before building the model."""
        chosen = Strategy(self.info, self.engine, self.precision, sharding, self.fsdp_min_bytes,
                          self.device_memory, self._layout_map, model_parallel or self.model_parallel,
                          self.precision_auto)
        chosen.sharding_asked = self.sharding_asked  # the report says 'auto' chose it, not the user
        chosen.model_parallel_asked = self.model_parallel_asked
        return chosen

    @property
    def device_mesh(self):
        """The Keras `DeviceMesh` (axes 'batch' and 'model'), e.g. for keras-hub's
        `Backbone.get_layout_map(strategy.device_mesh)`; None without a distribution."""
        return None if self._distribution is None else self._distribution.device_mesh

    @property
    def layout_map(self):
        """The user's LayoutMap (entries win over meshfit's rule), or None. Setting it applies to
        variables created afterwards: `strategy.layout_map = GemmaBackbone.get_layout_map(
        strategy.device_mesh)`, then build the model."""
        return self._layout_map

    @layout_map.setter
    def layout_map(self, layout_map) -> None:
        if self._distribution is None:
            warnings.warn(f"layout_map ignored: {len(self.info.devices)} device(s) on {self.engine} "
                          "lay nothing out (it needs several devices on the JAX engine)", stacklevel=2)
        else:
            self._distribution.use_layout_map(layout_map)
        self._layout_map = layout_map

    def relayout(self, model, sharding: modes.ShardingMode | str) -> None:
        """Lay `model`'s variables (and its optimizer's, once built) out under `sharding` (a mode
        or its name) in place, and make it the mode of variables created afterwards: what 'auto'
        decides at the first fit (meshfit.fit.memory_plan), from the layout they were built with
        ('data', and 'fsdp' past MeshParallel.spill_after). A user's layout_map entries keep
        their layout."""
        distribution = self._distribution
        if distribution is None:
            return
        sharding = modes.mode_named(sharding)
        distribution.sharding = self.sharding = sharding
        optimizer = getattr(model, "optimizer", None)
        variables = list(model.variables) + (list(optimizer.variables) if optimizer is not None
                                             and optimizer.built else [])
        for v in variables:
            shape = tuple(v.shape)
            axes = list(getattr(v._layout, "axes", None) or [None] * len(shape))
            target = distribution.axes_under(shape, v.dtype, axes, sharding)
            if axes == target:
                continue  # laid out already, or by a layout_map entry (or as its optimizer slot)
            v._layout = MeshLayout(target, distribution.device_mesh)
            v._direct_assign(v.value)  # placed by the new layout (Keras' distribute_tensor)

    platform = property(lambda self: self.info.platform, doc="'tpu', 'gpu' or 'cpu'.")
    device_kind = property(lambda self: self.info.device_kind, doc="e.g. 'TPU v4' or the CPU model.")
    hosts = property(lambda self: self.info.hosts, doc="Processes (hosts) in the job.")
    distribution = property(lambda self: self._distribution,
                            doc="The Keras distribution (JAX on several devices), else None.")

    @property
    def replicas(self) -> int:
        """Model replicas, each taking 1/replicas of a batch: every device on every host under
        JAX (divided by model_parallel, the devices that hold one replica), one under other engines."""
        return self.info.device_count // self.model_parallel if self.engine == "jax" else 1

    @property
    def peak_flops(self) -> float | None:
        """Peak FLOP/s of all devices in use together at this precision, None where unknown."""
        peak = planning.peak_flops(self.platform, self.device_kind, self.precision)
        return peak * self.replicas * self.model_parallel if peak else None

    def activate(self) -> None:
        """Make this strategy's distribution and precision the global Keras ones, and this the
        strategy plain `model.fit`/`evaluate`/`predict` run under (see meshfit.fit.hooks). Under
        precision 'auto', a mixed dtype policy the user set (before connect() or since) is kept
        and becomes the strategy's precision (see users_precision)."""
        if self.precision_auto:
            self.precision = users_precision() or self.precision
        set_dtype_policy(planning.keras_policy(self.precision))
        if self.engine == "jax":
            keras.distribution.set_distribution(self._distribution)  # None on one device
        hooks.set_active(self)

    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Create and compile models inside this scope to replicate them on every device; the
        Keras distribution and dtype policy in force before are restored on exit."""
        policy, distribution = keras.config.dtype_policy(), keras.distribution.distribution()
        strategy = hooks.active()
        self.activate()
        try:
            yield self
        finally:
            set_dtype_policy(policy)
            if self.engine == "jax":
                keras.distribution.set_distribution(distribution)
            hooks.set_active(strategy)

    def global_batch(self, per_core: int, rounding: bool = True) -> int:
        """Global batch for `per_core` samples per core, rounded to the hardware multiple."""
        return planning.plan_global_batch(self, per_core_batch=per_core, rounding=rounding)

    def check_batch(self, global_batch: int, rounding: bool = True) -> int:
        """`global_batch` checked to split evenly across the replicas (rounded up if allowed)."""
        return planning.split_global_batch(global_batch, self.replicas, rounding)

    def describe(self) -> dict[str, Any]:
        """The discovery report as plain data (what `meshfit info --json` prints)."""
        return {
            "platform": self.platform,
            "device_kind": self.device_kind,
            "devices_per_host": self.info.devices_per_host,
            "hosts": self.hosts,
            "process_index": self.info.process_index,
            "replicas": self.replicas,
            "simulated": self.info.simulated,
            "engine": self.engine,
            "precision": self.precision,
            "keras_policy": planning.keras_policy(self.precision),
            "per_core_batch_multiple": self.per_core_multiple,
            "peak_flops": self.peak_flops,
            "sharding": self.sharding.name,
            "sharding_asked": self.sharding_asked.name,
            "model_parallel": self.model_parallel,
            "model_parallel_asked": self.model_parallel_asked,  # None: 'auto' may choose it
            "fsdp_min_bytes": self.fsdp_min_bytes,
            "device_memory": devices_lib.memory_bytes(self.info, self.device_memory),
        }

    def report(self) -> str:
        """The discovery report as text (see meshfit.watch.keras_side.report.discovery_text)."""
        return discovery_text(self.describe())

    def fit(self, model, x=None, y=None, *, batch_size: int | None = None, epochs: int = 1,
            callbacks: list | None = None, verbose: int = 0, report: bool = True,
            micro_batches: int | str = "auto", **kwargs):
        """`model.fit` under this strategy, with the global batch checked and the report on.

        Plain `model.fit` after `connect()` already runs on every replica with the per-epoch
        report (see meshfit.fit.hooks); this adds: `batch_size` (Keras' keyword, here the global
        batch over all replicas) checked to split across the replicas, the report even with
        verbose=0 (report=False: none), and micro-batches (slices each batch's gradient is
        summed over; 'auto': cache-sized on a TensorFlow CPU, else 1; 1: whole batches; on
        TensorFlow every batch needs at least that many samples, and a shorter one is cut with a
        warning; on JAX each device's share is sliced, for memory, see meshfit.fit.jax_microbatch).
        x: numpy arrays, or any source Keras reads yielding (x, y) or (x, y, sample_weight) global
        batches: a tf.data.Dataset, a keras.utils.PyDataset, a generator or other iterator, a
        grain.MapDataset / IterDataset; validation_data likewise. On one host a batch that does
        not split across the replicas is computed whole on every device (exact); on several
        hosts, where each process feeds its own rows, it is cut to the largest multiple of the
        replicas with one warning (see meshfit.fit.sources). A generator (read only once) trains one
        epoch unless steps_per_epoch is given.
        """
        global_batch = batch_size
        callbacks = list(callbacks or [])
        micro_batches = tf_microbatch.plan_micro_batches(model, global_batch, micro_batches, self.engine)
        if global_batch is not None:
            global_batch = self.check_batch(global_batch)
        if report and self.info.process_index == 0 and not any(isinstance(c, EpochReport) for c in callbacks):
            callbacks.append(EpochReport(global_batch=global_batch, strategy=self))
        sliced = tf_microbatch if self.engine == "tensorflow" else jax_microbatch
        if sliced.installed(model) != micro_batches:
            sliced.install(model, micro_batches)
        with self.scope(), warnings.catch_warnings(), (
                contextlib.nullcontext() if report else hooks.report_off()):
            if not (self.hosts > 1 and getattr(x, "process_local", False)):  # else it yields its own rows
                cut_to = self.replicas if self.hosts > 1 else 1  # one host: the placement copes
                # On JAX a batch too short for its slices trains whole: nothing to cut for them.
                rows_for = micro_batches if self.engine == "tensorflow" else 1
                x, y, kwargs = sources.prepare(x, y, global_batch, cut_to, rows_for, epochs, kwargs)
            if self.hosts > 1:  # each process feeds its own rows of every global batch
                x, y, global_batch, kwargs = hosts.fit_arguments(self, x, y, global_batch, kwargs)
            if (isinstance(x, sources.SplitBatches) and not kwargs.get("steps_per_epoch")) or (
                    isinstance(kwargs.get("validation_data"), sources.SplitBatches)
                    and not kwargs.get("validation_steps")):
                # The source's end is the epoch's end; Keras warns there all the same.
                warnings.filterwarnings("ignore", message="Your input ran out of data")
            return model.fit(x, y, batch_size=global_batch, epochs=epochs, callbacks=callbacks,
                             verbose=verbose, **kwargs)


def plan(build, global_batch: int, input_shapes=None, verbose: bool = True) -> memory_plan.MemoryPlan:
    """The memory plan of the model `build()` returns (compiled) on the devices and device memory
    of the last `meshfit.connect()` (e.g. `connect(simulate_devices=8, device_memory="16GB",
    model_parallel=2)`), without allocating its weights: per device the weights, optimizer state
    and the step's temporary memory under data and fsdp (with the connected model parallelism),
    whether each fits and the layout 'auto' would choose. input_shapes: the inputs' shapes without
    the batch where keras.Input leaves them unknown, e.g. {"token_ids": (1024,), "padding_mask":
    (1024,)}. Returns the meshfit.fit.memory_plan.MemoryPlan (its `as_dict()` for JSON). See
    meshfit.fit.memory_plan.plan_build."""
    strategy = hooks.active()
    if strategy is None:
        raise MeshfitError("meshfit.plan plans on the connected devices: call meshfit.connect() "
                           "first (e.g. connect(simulate_devices=8, device_memory='16GB'))")
    if strategy.engine != "jax":
        raise MeshfitError("meshfit.plan compiles the train step with JAX; connect(engine='jax')")
    return memory_plan.plan_build(strategy, build, global_batch, input_shapes, verbose)


# The dtype policy meshfit set last (Keras' default before it set any): a policy that differs from
# it is the user's own. The user's seen last stays theirs after a scope put it back (then
# recorded as meshfit's) and after clear_session() (which meshfit's hook makes keep the policy,
# meshfit.fit.hooks), as they set it once: connect() run again (a notebook's cells) keeps it too.
_policy_set = "float32"
_users_policy: str | None = None
_USERS_PRECISIONS = {planning.keras_policy(p): p for p in ("float32", "bfloat16", "float16")}


def set_dtype_policy(policy) -> None:
    """Keras' global dtype policy, set by meshfit (every time meshfit sets it: see users_precision)."""
    global _policy_set
    keras.config.set_dtype_policy(policy)
    _policy_set = keras.config.dtype_policy().name


def users_precision() -> str | None:
    """The precision of the dtype policy the user set, if any: e.g. tutorial 3's
    `keras.mixed_precision.set_global_policy("mixed_bfloat16")`, before connect() or after it,
    which precision 'auto' (float32 on a CPU) once replaced unseen, or "float32" set after a
    mixed one (the next model in float32, as in plain Keras). Keras' own float32, its default
    before meshfit set any policy, is not the user's: it must not turn an accelerator's bfloat16
    into float32 (precision="float32" asks for it)."""
    global _users_policy
    name = keras.config.dtype_policy().name
    if name != _policy_set and name in _USERS_PRECISIONS:
        _users_policy = name
    return _USERS_PRECISIONS.get(_users_policy or "")


def connected(info: devices_lib.DeviceInfo, engine: str, precision: str, sharding: str,
              fsdp_min_bytes: int, device_memory: int | None, layout_map=None,
              verbose: bool = True, model_parallel: int | None = None,
              precision_auto: bool = False) -> Strategy:
    """The second half of `meshfit.connect()`, once Keras runs on `engine`: the Strategy for
    these devices (precision already resolved, settings checked), activated; the report printed."""
    if engine == "tensorflow":
        tf_bias_gradient.install()  # before any model is built on TensorFlow
    if info.hosts > 1:
        hosts.agree_on_seed()  # the same initial weights on every host
    strategy = Strategy(info, engine, precision, sharding, fsdp_min_bytes, device_memory, layout_map,
                        model_parallel, precision_auto)
    strategy.activate()
    if verbose and info.process_index == 0:
        print(strategy.report(), flush=True)
        hint = engine_lib.hint_faster_engine(engine, info.platform, info.device_count)
        if hint:
            print(f"  note: {hint}", file=sys.stderr)
    return strategy
