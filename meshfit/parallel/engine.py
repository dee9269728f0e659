"""Engine choice: which Keras backend runs the model.

Keras fixes its backend when it is first imported, so the choice is made here, before that
import. Multi-device and accelerator work runs on JAX; a single CPU device runs on TensorFlow when
it is installed: Keras/TF trained the tutorial CNNs 3-7x faster than Keras/JAX on our CPUs
(XLA:CPU convolutions are slow; `meshfit bench` measures it, see BENCHMARKS.md).

TensorFlow settings, measured with the tutorial CNNs on a 2-core Xeon with AVX-512/AMX (Keras
3.15.1, TF 2.21; preliminary, busy machine): oneDNN kernels on (TF's default on x86; off was 2-4x
slower), no XLA (`jit_compile=True` was 3-7x slower and compiled for 5-20 s; Keras' "auto" already
turns XLA off on CPU-only machines), and TF's own thread pools (intra- and inter-op threads = cores;
other settings were within noise), so `activate` keeps those defaults and only pins oneDNN on.
On TensorFlow meshfit also computes the bias gradient of convolutions apart from their filter
gradient (meshfit.fit.tf_bias_gradient, installed by connect() once Keras is loaded).

`start_engine` is the first half of `meshfit.connect()`: the devices found and the engine chosen
for them, set for Keras' first import (meshfit.fit's). Nothing here imports Keras, JAX or
TensorFlow, at the top or in a function.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
import tempfile
import threading
import warnings

from meshfit import env
from meshfit.errors import MeshfitError
from meshfit.parallel import devices

ENGINES = ("auto", "jax", "tensorflow")
DEFAULT_ENGINE = "auto"  # an engine not given (nor $MESHFIT_ENGINE): the fastest for the devices
_MULTI_DEVICE_ENGINES = ("jax",)
ONEDNN = "TF_ENABLE_ONEDNN_OPTS"  # TensorFlow reads it once, when it is imported
# Lines TensorFlow's C++ code writes to stderr while it loads, whatever TF_CPP_MIN_LOG_LEVEL says
# (twice, once per shared library): dropped, every other line is passed on.
_LOAD_NOTICES = (b"All log messages before absl::InitializeLog() is called",
                 b"oneDNN custom operations are on",
                 # The `tensorflow` wheel (not tensorflow-cpu; keras-hub's tensorflow-text pulls it
                 # in) looks for CUDA as it loads; on a machine without it, TF runs on the CPU.
                 b"Could not find cuda drivers on your machine",
                 b"failed call to cuInit")


@contextlib.contextmanager
def tensorflow_notices_dropped(loads_tensorflow: bool = True):
    """For a block that may import TensorFlow (`import keras` on the tensorflow engine): capture
    file descriptor 2 while TensorFlow is first loaded and finds its devices, then write back all
    but its load notices. A no-op when TensorFlow is loaded already or `loads_tensorflow` is
    False."""
    if not loads_tensorflow or "tensorflow" in sys.modules:
        yield
        return
    with _notices_dropped():
        yield
        if "tensorflow" in sys.modules:
            _list_devices(sys.modules["tensorflow"])


def _list_devices(tensorflow) -> None:
    # The `tensorflow` wheel calls cuInit when it first lists its devices (a model's first
    # variable), not as it loads, and logs its failure as an error whatever TF_CPP_MIN_LOG_LEVEL
    # said before `import jax` set it to 1: list them while its notices are dropped.
    tensorflow.config.list_physical_devices()


@contextlib.contextmanager
def _notices_dropped():
    """Capture file descriptor 2 for the block, then write back all but _LOAD_NOTICES' lines
    (the other lines are delayed, never lost; also when the block raises)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().splitlines(keepends=True)
            kept = b"".join(line for line in lines if not any(n in line for n in _LOAD_NOTICES))
            if kept:
                os.write(2, kept)


class _TensorFlowImportedQuietly(importlib.abc.MetaPathFinder):
    """On the JAX engine TensorFlow is imported, if ever, by the user's program or a library
    (keras-hub's tensorflow-text, a tf.data pipeline), not inside a block meshfit could wrap: this
    finder drops its load notices wherever that first import happens. It finds `tensorflow` with
    the other finders and wraps the loader; it leaves sys.meta_path once TensorFlow has loaded,
    not at a lookup: meshfit's own question whether TensorFlow is installed (`installed`, asked by
    connect()'s summary on one CPU device) took it out before the user's import came."""

    def __init__(self):
        self._looking = threading.local()  # inside its own lookup through the other finders

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow" or getattr(self._looking, "now", False):
            return None
        self._looking.now = True
        try:
            spec = importlib.util.find_spec(name)  # the other finders' (this one answers None)
        finally:
            self._looking.now = False
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderDroppingNotices(spec.loader, self)
        return spec


class _LoaderDroppingNotices:
    """A module loader that runs another's exec_module with TensorFlow's load notices dropped,
    then takes `finder` out of sys.meta_path; all else (create_module, get_resource_reader, ...)
    is the other loader's."""

    def __init__(self, loader, finder):
        self._loader, self._finder = loader, finder

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        with _notices_dropped():
            self._loader.exec_module(module)
            # Best effort: the user's import must not fail where it would not without meshfit.
            with contextlib.suppress(Exception):
                _list_devices(module)
        with contextlib.suppress(ValueError):  # another thread's import took it out first
            sys.meta_path.remove(self._finder)


def drop_tensorflow_notices_at_import() -> None:
    """Have TensorFlow's first import in this process, wherever it happens, drop its load notices
    (the JAX engine's; TensorFlow's engine imports it in tensorflow_notices_dropped)."""
    if "tensorflow" not in sys.modules and not any(
            isinstance(finder, _TensorFlowImportedQuietly) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TensorFlowImportedQuietly())


# Optional imports at Keras' top (`try: import x`) for features no meshfit command uses: on a GPU
# machine with them installed they were 2.1 s of Keras' 4.5 s import (H200, 2026-11-28, `python -X
# importtime`): scikit-learn 0.96 s (keras.wrappers), matplotlib's pyplot 0.67 (keras.visualization)
# and pandas 0.44 (DataFrames as fit's input). Not requests (0.19 s, for the RemoteMonitor
# callback): TensorFlow, which Keras loads on its engine, imports it unconditionally.
KERAS_EXTRAS = ("sklearn", "matplotlib", "pandas")
_keras_extras_skipped = False


def skip_keras_extras() -> None:
    """Have Keras' first import in this process (meshfit.fit's) leave out KERAS_EXTRAS, as if they
    were not installed: for meshfit's own processes (the command line), never a user's program,
    whose fit may take pandas DataFrames. They import normally afterwards (meshfit's pictures use
    matplotlib's Figure); only Keras' features built on them stay off in that process."""
    global _keras_extras_skipped
    _keras_extras_skipped = True


def keras_extras_skipped() -> tuple[str, ...]:
    """The modules Keras' first import leaves out in this process (see skip_keras_extras)."""
    return KERAS_EXTRAS if _keras_extras_skipped else ()


@contextlib.contextmanager
def imports_skipped(names: tuple[str, ...]):
    """For the block: importing each of `names` not imported yet (or a submodule of it) raises
    ImportError, as if it were not installed; afterwards it imports normally. For optional
    imports at a library's top (`try: import x` / `except ImportError`) that this process never
    uses. A None in sys.modules is how Python itself marks a module unimportable; only the
    entries still None at the end are removed, so a module imported meanwhile is kept."""
    skipped = [name for name in names if name not in sys.modules]
    for name in skipped:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in skipped:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def submodule(package: str, name: str):
    """The module `package.name`, imported when first named as its package's attribute (the
    __getattr__ of meshfit and its sub-packages but this one, whose modules load with meshfit:
    `meshfit.data.datasets.load` after `import meshfit` alone, as the API reference names it);
    AttributeError where the package has no such module."""
    if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return importlib.import_module(f"{package}.{name}")


def installed(module: str) -> bool:
    """True when the module (an engine's framework, onnxruntime, ...) can be imported."""
    return importlib.util.find_spec(module) is not None


def loaded_backend() -> str | None:
    """The backend of an already imported Keras, else None."""
    keras = sys.modules.get("keras")  # read, never imported here: this is the light core
    return keras.backend.backend() if keras is not None else None


def fastest(platform: str, device_count: int) -> str:
    """The fastest installed engine for these devices: TensorFlow on one CPU device, else JAX."""
    if platform == "cpu" and device_count == 1 and installed("tensorflow"):
        return "tensorflow"
    return "jax"


def choose_engine(requested: str | None, platform: str, device_count: int) -> str:
    """The engine to run: the requested one, or for 'auto' the fastest for these devices."""
    requested = (requested or os.environ.get(env.ENGINE) or DEFAULT_ENGINE).lower()
    if requested not in ENGINES:
        raise MeshfitError(f"unknown engine {requested!r}; use one of: {', '.join(ENGINES)}")
    loaded = loaded_backend()
    if requested == "auto":
        chosen = loaded or os.environ.get("KERAS_BACKEND") or fastest(platform, device_count)
        # Never a one-CPU engine on several devices or an accelerator (1 replica, silently).
        if chosen not in _MULTI_DEVICE_ENGINES and (device_count > 1 or platform != "cpu"):
            why = (f"Keras was already imported with the {chosen} backend" if loaded else
                   f"KERAS_BACKEND={chosen} is set")
            fix = (_restart_fix("jax") if loaded else
                   "let meshfit choose the engine: unset KERAS_BACKEND or set KERAS_BACKEND=jax")
            raise MeshfitError(f"{why}, which trains on one CPU device in meshfit, but "
                               f"{device_count} {platform} device(s) are in use; {fix}",
                               see="keras-imported-first")
        return chosen
    if loaded and loaded != requested:
        raise MeshfitError(
            f"too late to switch to engine {requested}: Keras was already imported with the "
            f"{loaded} backend; {_restart_fix(requested)}", see="keras-imported-first"
        )
    if requested not in _MULTI_DEVICE_ENGINES and (device_count > 1 or platform != "cpu"):
        raise MeshfitError(
            f"engine {requested} runs on one CPU device in meshfit, but {device_count} {platform} "
            f"device(s) are in use; use --engine jax"
        )
    if not installed(requested):
        raise MeshfitError(f"engine {requested} is not installed; pip install {_PACKAGES[requested]}")
    return requested


_PACKAGES = {"jax": "jax", "tensorflow": "tensorflow-cpu"}


def _restart_fix(backend: str) -> str:
    """How to get Keras on `backend` once it was imported with another: a new process (in a
    notebook, a restarted kernel) that imports meshfit first or sets KERAS_BACKEND."""
    if env.notebook():
        return (f"restart the kernel (Colab: Runtime > Restart session), then run `import meshfit` "
                f"and meshfit.connect() before `import keras`, or set "
                f"os.environ['KERAS_BACKEND'] = '{backend}' before importing keras")
    return (f"import meshfit and call meshfit.connect() before importing keras, or set "
            f"KERAS_BACKEND={backend}")


def activate(engine: str) -> None:
    """Set what Keras reads at its first import so that it runs on `engine`. The import itself
    happens above the engine line (meshfit.fit imports Keras at its top; a recipe file may import
    it first), inside tensorflow_notices_dropped(): nothing in the light core imports Keras."""
    # No TF_CPP_MIN_LOG_LEVEL here: device discovery has imported JAX, whose import sets it to 1
    # where unset (TensorFlow's and XLA's C++ warnings and errors kept: meshfit launch reads the
    # latter), so a setdefault here did nothing; TensorFlow's load notices, its failed cuInit
    # among them, are dropped where it is first imported (tensorflow_notices_dropped,
    # drop_tensorflow_notices_at_import).
    os.environ["KERAS_BACKEND"] = engine
    if engine == "tensorflow":
        if "tensorflow" in sys.modules and ONEDNN not in os.environ:
            warnings.warn("TensorFlow was imported before meshfit, with its own oneDNN default (off "
                          "on CPUs without VNNI/AMX): kernels, speed and rounding may differ from "
                          "the meshfit command line, so a run resumed there is not bit-identical; "
                          f"import meshfit first or set {ONEDNN}=1", stacklevel=3)
        os.environ.setdefault(ONEDNN, "1")  # oneDNN kernels: 2-4x faster CNNs on x86
    else:
        drop_tensorflow_notices_at_import()


def start_engine(simulate_devices: int | None, engine: str | None,
                 require: str | None) -> tuple[devices.DeviceInfo, str]:
    """Find the devices and choose the engine for them, set for Keras' first import; returns
    (devices, engine).

    `meshfit.connect()` starts with it; a recipe file is run only after it, so that a file
    importing keras at its top gets the backend its run uses (Keras fixes it at its first import).
    """
    use_compile_cache()
    info = devices.discover(simulate_devices=simulate_devices, require=require)
    chosen = choose_engine(engine, info.platform, info.device_count)
    activate(chosen)
    return info, chosen


def use_compile_cache() -> None:
    """JAX's persistent compilation cache in $XDG_CACHE_HOME/meshfit/jax (default ~/.cache) for
    every program, however quickly it compiles, where the user chose no cache of their own (then
    every JAX_* cache setting is theirs), read by JAX at its import (a JAX imported before
    connect() keeps its own). Why: the batch order's program (meshfit.data.arrays) compiled in
    0.95 CPU-s in every run, even on the TensorFlow engine; loaded from this cache, 0.31 (44 KB on
    disk; BENCHMARKS.md section 1). And every program, not JAX's default of those compiling in
    1 s or more: the main job on JAX compiles 27 programs of 2-90 ms each (variable initializers,
    the data's gather, the scores), which with a 0.1 s floor were compiled again in every run
    (compile part 1.14 s, median of 3 warm runs on a 2-core CPU); all cached, 0.72 s, and 260 KB
    on disk (BENCHMARKS.md section 1). No size cap: JAX's cap (JAX_COMPILATION_CACHE_MAX_SIZE)
    evicts by access-time files that processes sharing the folder race on ("Error writing
    persistent compilation cache entry ... FileNotFoundError: ...-atime", seen in the test
    suite's shared cache), so the folder grows by each new program's few KB to MB: delete it to
    free it."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(env.cache_home(), "jax")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


_hinted = False


def hint_faster_engine(engine: str, platform: str, device_count: int) -> str | None:
    """A one-line hint, once per process, when a faster engine for this machine is an install away."""
    global _hinted
    if _hinted or engine != "jax" or platform != "cpu" or device_count != 1 or installed("tensorflow"):
        return None
    _hinted = True
    return "on a single CPU Keras/TensorFlow trains these CNNs 3-7x faster: pip install 'meshfit[cpu]'"
