"""meshfit: train any Keras model data-parallel on every core of a TPU, GPU or CPU.

`connect()` finds the devices and returns a `Strategy`; build the model in `strategy.scope()` and
fit as usual. A `Recipe` (a model, its data and hyperparameters) is what `meshfit train` trains.
Keras is imported only by `connect()` (after the engine is chosen), so import meshfit before keras
if you want meshfit to choose the Keras backend.
"""

import os as _os
import signal as _signal
import sys as _sys


def _ctrl_c_while_starting(signum, frame) -> None:
    """A Ctrl-C before the command line's main() runs (the command has done nothing yet, so
    nothing is lost by an immediate exit): its one line and exit code 130, not a traceback."""
    _sys.stderr.write("meshfit: interrupted\n")
    _sys.stderr.flush()
    _os._exit(130)  # not an exception: it cannot be caught, nor cut an import half-way


def _stop_on_ctrl_c_while_starting() -> None:
    """In the `meshfit` process, Ctrl-C ends it from here until cli.main() sets its own handler."""
    try:
        if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:  # not when ignored
            _signal.signal(_signal.SIGINT, _ctrl_c_while_starting)
    except ValueError:  # not the main thread
        pass


if _os.path.basename(_sys.argv[0] if _sys.argv else "") in ("meshfit", "meshfit.exe"):
    _stop_on_ctrl_c_while_starting()  # first thing: the console script imports meshfit.cli (0.15 s)

from meshfit.errors import MeshfitError, TrainingDiverged, TrainingInterrupted  # noqa: E402
from meshfit.parallel import engine as _engine
from meshfit.parallel import modes as _modes
from meshfit.parallel import planning as _planning
from meshfit.parallel import sharding as _sharding

__version__ = "0.1.0"
__all__ = ["connect", "plan", "verify", "Strategy", "EpochReport", "Recipe", "MeshfitError", "TrainingInterrupted",
           "TrainingDiverged", "__version__"]


def connect(require: str | None = None, simulate_devices: int | None = None,
            precision: str = _planning.DEFAULT_PRECISION,
            engine: str | None = None, verbose: bool = True, sharding: str | None = None,
            fsdp_min_bytes: int | str | None = None, device_memory: int | str | None = None,
            layout_map=None, *, simulate: int | None = None, model_parallel: int | None = None):
    """Find the devices, pick engine and precision, print what was found, return the Strategy
    (meshfit.fit.strategy.Strategy).

    require: 'tpu' or 'gpu' to fail unless that platform is present.
    simulate_devices: run on this many JAX CPU devices (also $MESHFIT_SIMULATE_DEVICES); the
      older keyword `simulate` is still accepted.
    precision: 'auto', 'float32', 'bfloat16' or 'float16' (variables stay float32). 'auto': the
      hardware's, unless the user set a mixed global dtype policy (Strategy.activate).
    engine: 'auto', 'jax' or 'tensorflow' (also $MESHFIT_ENGINE).
    sharding: 'auto' (default), 'data' or 'fsdp' (see meshfit.parallel.modes). 'auto' lays
      variables out as 'data' until a model's first fit plans its train step with fit's batch
      (meshfit.fit.memory_plan) and, when the device memory is known and the replicated step
      does not fit, lays its variables out as fsdp (`meshfit train` plans before building).
      With the device memory known, the variables created past a quarter of it are created
      sharded, so that a model too large to hold replicated can be built; the first fit
      gathers them if the replicated step fits.
    fsdp_min_bytes: under fsdp, floating-point variables of at least this size ('1MiB', bytes;
      default 1 MiB) are sharded. device_memory: bytes per device to plan with ('16GB'; default:
      the device's).
    layout_map: a keras.distribution.LayoutMap (on any mesh with axes 'batch' and 'model', or a
      function of the mesh returning one, e.g. keras-hub's `GemmaBackbone.get_layout_map`) whose
      entries win over meshfit's rule; or set `strategy.layout_map` later.
    model_parallel: K devices per model replica: the mesh is (devices/K) x K with axes 'batch'
      and 'model', and every kernel is split over 'model' (tensor parallelism chosen from its
      shape, see meshfit.parallel.sharding), combined with `sharding` on 'batch'. Not given
      (None): 1, except that where 'auto' finds that neither data nor fsdp fits, it tries
      K = 2, 4, ... (`meshfit train`, `meshfit plan` and `meshfit.plan` choose it; a plain `fit`
      names the model_parallel to pass here).
    """
    if simulate is not None:
        if simulate_devices is not None and simulate_devices != simulate:
            raise MeshfitError(f"simulate={simulate} and simulate_devices={simulate_devices} "
                               "disagree; give simulate_devices only")
        simulate_devices = simulate
    # Every setting is checked before any slow work (finding devices, importing Keras).
    precision = _planning.precision_name(precision)
    sharding = _modes.check_sharding(sharding)  # None: modes.DEFAULT
    fsdp_min_bytes = _sharding.parse_fsdp_min_bytes(fsdp_min_bytes)
    device_memory = _sharding.parse_size(device_memory)
    model_parallel = None if model_parallel is None else _sharding.check_model_parallel(model_parallel)
    info, chosen = _engine.start_engine(simulate_devices, engine, require)
    from meshfit.fit import strategy  # the engine line: Keras is imported, on the engine just chosen

    return strategy.connected(
        info, chosen, _planning.resolve_precision(precision, info.platform, info.compute_capability),
        sharding, fsdp_min_bytes, device_memory, layout_map, verbose, model_parallel,
        precision_auto=precision == _planning.DEFAULT_PRECISION)


def __getattr__(name: str):
    # The public names below load on first use: Strategy and EpochReport import Keras, which must
    # wait for connect() to choose the engine; Recipe would load the recipes and data packages.
    if name in ("Strategy", "plan"):  # plan: the memory plan of a model built by a function
        from meshfit.fit.strategy import Strategy, plan  # imports Keras: use after connect()

        return Strategy if name == "Strategy" else plan
    if name == "EpochReport":
        from meshfit.watch.keras_side.report import EpochReport  # imports Keras: use after connect()

        return EpochReport
    if name == "verify":  # loads numpy; the Keras side only once it has connected
        from meshfit.run.verify import verify  # the run package: loaded when first named

        return verify
    if name == "Recipe":
        from meshfit.recipes import Recipe  # loads the recipes and data packages

        return Recipe
    if name == "fit":  # the engine line: importing it imports Keras, on the engine connect() chose
        raise AttributeError("meshfit.fit is the Keras side: call meshfit.connect() first, which "
                             "chooses the engine and imports it")
    # a sub-package or module (meshfit.data.datasets.load, as the API reference names it)
    return _engine.submodule("meshfit", name)


def __dir__() -> list[str]:
    """The public names too (tab completion, `dir(meshfit)`), without importing them."""
    return sorted(set(globals()) | set(__all__))
