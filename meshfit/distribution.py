"""`connect()` and `Strategy`: one model replicated on every device, each taking 1/N of a batch.

On JAX this is Keras' own `keras.distribution.DataParallel` over a `jax.sharding` mesh: variables
are replicated, every global batch is split along its first axis, and XLA inserts the gradient
all-reduce. Nothing here writes a collective by hand.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Iterator

from meshfit import devices as devices_lib
from meshfit import engine as engine_lib
from meshfit import planning
from meshfit.errors import MeshfitError


class Strategy:
    """The devices in use, the engine and precision chosen, and the batch plan."""

    def __init__(self, info: devices_lib.DeviceInfo, engine: str, precision: str):
        self.info = info
        self.engine = engine
        self.precision = precision
        self.per_core_multiple = planning.batch_multiple(info.platform, info.device_kind)
        self._distribution = None
        if engine == "jax" and len(info.devices) > 1:
            import keras

            # Multi-host: each process feeds its own rows of every batch (see fit), no auto-sharding.
            # One device needs no distribution; Keras' distributed input path would cost ~0.3 ms/step.
            self._distribution = keras.distribution.DataParallel(devices=list(info.devices),
                                                                 auto_shard_dataset=False)

    platform = property(lambda self: self.info.platform, doc="'tpu', 'gpu' or 'cpu'.")
    device_kind = property(lambda self: self.info.device_kind, doc="e.g. 'TPU v4' or the CPU model.")
    hosts = property(lambda self: self.info.hosts, doc="Processes (hosts) in the job.")

    @property
    def replicas(self) -> int:
        """Model replicas: every device on every host under JAX, one under other engines."""
        return self.info.device_count if self.engine == "jax" else 1

    @property
    def peak_flops(self) -> float | None:
        """Peak FLOP/s of all replicas together at this precision, None where unknown."""
        peak = planning.peak_flops(self.platform, self.device_kind, self.precision)
        return peak * self.replicas if peak else None

    def activate(self) -> None:
        """Make this strategy's distribution and precision the global Keras ones."""
        import keras

        keras.config.set_dtype_policy(planning.keras_policy(self.precision))
        if self.engine == "jax":
            keras.distribution.set_distribution(self._distribution)  # None on one device

    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Create and compile models inside this scope to replicate them on every device."""
        self.activate()
        yield self

    def global_batch(self, per_core: int, rounding: bool = True) -> int:
        """Global batch for `per_core` samples per core, rounded to the hardware multiple."""
        rounded = planning.round_per_core(per_core, self.per_core_multiple)
        if rounded != per_core:
            if not rounding:
                raise MeshfitError(
                    f"per-core batch {per_core} is not a multiple of {self.per_core_multiple} "
                    f"on {self.device_kind}; use {rounded} or allow rounding"
                )
            warnings.warn(f"per-core batch {per_core} rounded to {rounded}, a multiple of "
                          f"{self.per_core_multiple} on {self.device_kind}", stacklevel=2)
        return rounded * self.replicas

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
        }

    def report(self) -> str:
        """The discovery report as text, like the tutorials' TPU log but for any platform."""
        d = self.describe()
        sim = " (simulated on the CPU)" if d["simulated"] else ""
        mixed = ", float32 variables" if self.precision != "float32" else ""
        peak = f"{d['peak_flops'] / 1e12:.1f} TFLOP/s" if d["peak_flops"] else "n/a"
        rows = [
            ("platform", f"{self.platform}{sim}"),
            ("device kind", self.device_kind),
            ("hosts", f"{self.hosts} (this is process {d['process_index']})"),
            ("devices per host", d["devices_per_host"]),
            ("replicas", self.replicas),
            ("engine", f"keras on {self.engine}"),
            ("precision", f"{self.precision} ({d['keras_policy']}{mixed})"),
            ("per-core batch", f"multiple of {self.per_core_multiple}"),
            ("peak", peak),
        ]
        return "meshfit connected\n" + "\n".join(f"  {k:<17}{v}" for k, v in rows)

    def micro_batches(self, model, batch_size: int | None, requested: int | str = "auto") -> int:
        """Slices per batch for `model`'s train step (see meshfit.tf_microbatch).

        'auto': cache-sized slices on the TensorFlow engine when the batch size is known, else 1.
        """
        from meshfit import tf_microbatch

        if requested == "auto":
            return tf_microbatch.plan(model, batch_size) if self.engine == "tensorflow" and batch_size else 1
        slices = tf_microbatch.check(model, requested)
        if slices > 1 and self.engine != "tensorflow":
            raise MeshfitError(f"micro-batches run on the TensorFlow engine (one CPU), not on "
                               f"{self.engine}; use micro_batches=1")
        return slices

    def fit(self, model, x=None, y=None, *, batch_size: int | None = None, epochs: int = 1,
            callbacks: list | None = None, verbose: int = 0, report: bool = True,
            micro_batches: int | str = "auto", **kwargs):
        """`model.fit` with the batch checked against the replicas and the per-epoch report on.

        micro_batches: slices each batch's gradient is summed over ('auto': cache-sized on a CPU;
        1: whole batches); with slices, every batch needs at least that many samples.
        """
        from meshfit.report import EpochReport

        callbacks = list(callbacks or [])
        slices = self.micro_batches(model, batch_size, micro_batches)
        if batch_size is not None:
            batch_size = self.check_batch(batch_size)
            x, y = self._trim_last_batch(x, y, batch_size, slices)
            if isinstance(kwargs.get("validation_data"), tuple):
                kwargs["validation_data"] = self._trim_last_batch(*kwargs["validation_data"][:2], batch_size)
        if report and self.info.process_index == 0 and not any(isinstance(c, EpochReport) for c in callbacks):
            callbacks.append(EpochReport(batch_size=batch_size, strategy=self))
        if self.hosts > 1:  # each process feeds its own rows of every global batch
            from meshfit import cluster

            x, y, batch_size, kwargs = cluster.fit_arguments(self, x, y, batch_size, kwargs)
        if self.engine == "jax" and model.train_function is None:  # on-device k-step loop, see meshfit.jax_loop
            from meshfit import jax_loop

            jax_loop.install(model, model.steps_per_execution)
        if self.engine == "tensorflow":
            from meshfit import tf_microbatch

            if tf_microbatch.installed(model) != slices:
                tf_microbatch.install(model, slices)
        return model.fit(x, y, batch_size=batch_size, epochs=epochs, callbacks=callbacks,
                         verbose=verbose, **kwargs)

    def _trim_last_batch(self, x, y, batch_size: int, slices: int = 1):
        """Arrays shortened so their last partial batch splits across the replicas (and has at
        least `slices` samples, one per micro-batch).

        Keras would otherwise hand XLA a last batch it cannot shard and fail deep inside it.
        """
        n = len(x) if hasattr(x, "shape") else None
        rest = n % batch_size if n else 0
        extra = rest if rest < slices else rest % self.replicas
        if not extra:
            return x, y
        into = f"{slices} micro-batches" if rest < slices else f"{self.replicas} replicas"
        warnings.warn(f"dropping the last {extra} of {n} samples so the last batch splits into "
                      f"{into}", stacklevel=3)
        return x[: n - extra], (y[: n - extra] if y is not None else None)


def connect(require: str | None = None, simulate: int | None = None, precision: str = "auto",
            engine: str | None = None, verbose: bool = True) -> Strategy:
    """Find the devices, pick engine and precision, print what was found, return the Strategy.

    require: 'tpu' or 'gpu' to fail unless that platform is present.
    simulate: run on this many JAX CPU devices (also $MESHFIT_SIMULATE_DEVICES).
    precision: 'auto', 'float32', 'bfloat16' or 'float16' (variables stay float32).
    engine: 'auto', 'jax' or 'tensorflow' (also $MESHFIT_ENGINE).
    """
    planning.resolve_precision(precision, "cpu")  # reject unknown names before any slow work
    info = devices_lib.discover(simulate=simulate, require=require)
    chosen = engine_lib.choose(engine, info.platform, info.device_count)
    engine_lib.activate(chosen)
    if info.hosts > 1:
        from meshfit import cluster

        cluster.agree_on_seed()  # the same initial weights on every host
    strategy = Strategy(info, chosen, planning.resolve_precision(precision, info.platform,
                                                                 info.compute_capability))
    strategy.activate()
    if verbose and info.process_index == 0:
        print(strategy.report(), flush=True)
        hint = engine_lib.hint_faster_engine(chosen, info.platform, info.device_count)
        if hint:
            print(f"  note: {hint}", file=sys.stderr)
    return strategy
