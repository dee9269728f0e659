"""The one place meshfit reaches into Keras' private code: every patch of a Keras function or
method (the table PATCHES, applied once by `apply_patches`, and one patch held for a block:
`optimizers_made_outside_stateless_scope`) and every name read from `keras.src`. For each: what
it changes or gives, why Keras' public API does not do it, and what happens on a Keras that lacks
it: a one-line MeshfitError naming the version and the supported pins (never a silent wrong
result). JAX's private code and native libraries have the light core's seam,
meshfit.parallel.jax_internals; no other module imports `keras.src` (tests/test_seam.py reads every
import statement). docs/reference/internals.md is the list for readers.

Checked on Keras 3.15.1 with JAX 0.10.2 (Python 3.11), 0.11.2 (Python 3.12) and 0.12.0.1 (Python
3.13); the
Keras side of the TensorFlow engine on TensorFlow 2.21 (Python 3.11).

Where Keras offers a public way it is used instead: `keras.tree`, `keras.utils.
unpack_x_y_sample_weight`, `keras.random.SeedGenerator`, `keras.initializers.Initializer`, and
initializers that take `layout=` (Keras 3.15, keras-team/keras#22680: such an initializer, a
user's, is left to Keras' own sharded path). Keras' built-in initializers do not take `layout`,
and nothing public lets meshfit give every variable a layout-aware initializer, so the variables'
own initialization stays patched (PATCHES, "JaxVariable._initialize_with_initializer").
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import keras

from meshfit.errors import MeshfitError
from meshfit.parallel import jax_internals

CHECKED_ON = "Keras 3.15.1 with JAX 0.10.2, 0.11.2 and 0.12.0.1"
_BACKEND_MODULES = "keras.src.backend."  # where each backend's trainer and variables live


def lacking(what: str) -> MeshfitError:
    """The one-line error for a Keras without `what` (a private name meshfit relies on)."""
    return jax_internals.lacking("Keras", keras.__version__, what, CHECKED_ON)


def private(module: str, name: str | None = None) -> Any:
    """Keras' private module `module` (e.g. "keras.src.utils.rng_utils"), or its attribute
    `name`; a one-line MeshfitError where this Keras lacks it."""
    try:
        found = importlib.import_module(module)
        return found if name is None else getattr(found, name)
    except (ImportError, AttributeError):
        raise lacking(module if name is None else f"{module}.{name}") from None


# ------------------------------------------------------------------ names read from keras.src

# Each private name meshfit reads, by the key its accessor below uses; `check()` reads them all.
_NAMES = {
    "get_random_seed": ("keras.src.utils.rng_utils", "get_random_seed"),
    "train_validation_split": ("keras.src.trainers.data_adapters.array_slicing", "train_validation_split"),
    "can_convert_arrays": ("keras.src.trainers.data_adapters.array_data_adapter", "can_convert_arrays"),
    "get_data_adapter": ("keras.src.trainers.data_adapters", "get_data_adapter"),
    "DataAdapter": ("keras.src.trainers.data_adapters.data_adapter", "DataAdapter"),
    "global_state": ("keras.src.backend.common.global_state", None),
    "BaseOptimizer": ("keras.src.optimizers.base_optimizer", "BaseOptimizer"),
    "unscale_loss_for_distribution": ("keras.src.losses.loss", "unscale_loss_for_distribution"),
    "draw_seed": ("keras.src.random.seed_generator", "draw_seed"),
    "tensorflow_handle": ("keras.src.utils.module_utils", "tensorflow"),
    "KerasVariable": ("keras.src.backend.common.variables", "Variable"),
    "saving_lib": ("keras.src.saving.saving_lib", None),
    "H5IOStore": ("keras.src.saving.saving_lib", "H5IOStore"),
    "file_utils": ("keras.src.utils.file_utils", None),
    "backend": ("keras.src.backend", None),
    "Trainer": ("keras.src.trainers.trainer", "Trainer"),
}
_JAX_NAMES = {  # the JAX backend's, read only on that engine
    "distribution_lib": ("keras.src.backend.jax.distribution_lib", None),
    "JaxVariable": ("keras.src.backend.jax.core", "JaxVariable"),
}
# Where a later Keras moved a name: read there when its place above is gone. Keras 3.16 (its
# nightly builds, `make test-next`) moved the JAX variable to keras.src.backend.jax.ops.core as
# `Variable`; with Flax NNX on, that name is its NNX subclass and the plain class is `JaxVariable`.
_MOVED = {
    "JaxVariable": (("keras.src.backend.jax.ops.core", "JaxVariable"),
                    ("keras.src.backend.jax.ops.core", "Variable")),
}


def _name(key: str) -> Any:
    """The private name `key` from its place in Keras 3.15, else from where a later one moved it
    (the error, where none has it, names the first place)."""
    try:
        return private(*{**_NAMES, **_JAX_NAMES}[key])
    except MeshfitError:
        for place in _MOVED.get(key, ()):
            with contextlib.suppress(MeshfitError):
                return private(*place)
        raise


def get_random_seed() -> int | None:
    """Keras' global seed (keras.utils.set_random_seed's), None when unset: Keras has a public
    setter but no public getter. meshfit.fit.hosts gives every process process 0's seed."""
    return _name("get_random_seed")()


# The Keras modules that ask whether TensorFlow is installed only to seed it or to recognise its
# objects (isinstance of tf.TensorShape, tf.data.Dataset...), which cannot exist before TensorFlow
# is loaded; Keras' preprocessing layers, which require it, keep Keras' own handle.
_TENSORFLOW_IF_LOADED = ("keras.src.utils.rng_utils", "keras.src.saving.serialization_lib",
                         "keras.src.legacy.saving.json_utils", "keras.src.distribution.distribution_lib")


def tensorflow_counted_once_loaded() -> None:
    """On the JAX engine: where Keras asks whether TensorFlow is installed only to seed it or to
    recognise its objects (_TENSORFLOW_IF_LOADED), it counts as there only once something (a
    user's tf.data) has imported it, so Keras does not import it by itself. Keras' set_random_seed
    and serialization imported it: 5.5-6.6 s of every JAX run's start-up on a loaded 2-vCPU VM
    (`import jax, keras` took 2.8-4.5 s, `import jax, keras, tensorflow` 9.3-9.5 s, 3 runs each,
    2026-11-28), paid again by every generation of an elastic job. Keras has no public switch for
    it: those modules' `tf` (Keras' lazy handle, keras.src.utils.module_utils.tensorflow) becomes
    a handle whose `available` also requires TensorFlow in sys.modules."""
    handle = _name("tensorflow_handle")
    lazy = type(handle)
    if not isinstance(getattr(lazy, "available", None), property):
        raise lacking("keras.src.utils.module_utils.LazyModule.available")

    class LoadedOnly(lazy):
        @property
        def available(self):
            return "tensorflow" in sys.modules and lazy.available.fget(self)

    for name in _TENSORFLOW_IF_LOADED:
        module = private(name)
        if getattr(module, "tf", None) is handle:  # a later Keras that no longer asks: nothing
            module.tf = LoadedOnly(handle.name)


def train_validation_split(arrays: tuple, validation_split: float) -> tuple:
    """Keras' own split of fit's arrays by `validation_split` (its last rows for validation), so
    that Strategy.fit cuts only the training part exactly as Keras' fit would split it."""
    return _name("train_validation_split")(arrays, validation_split=validation_split)


def can_convert_arrays(arrays: tuple) -> bool:
    """True when Keras reads (x, y, sample_weight) as arrays it slices into batches itself."""
    return _name("can_convert_arrays")(arrays)


def get_data_adapter(source: Any, **kwargs) -> Any:
    """Keras' data adapter for `source` (what its fit reads a dataset, generator, ... through):
    meshfit.fit.sources cuts the batches it yields. Keras' data adapters have no public API."""
    return _name("get_data_adapter")(source, **kwargs)


# The base class of Keras' data adapters, which meshfit.fit.sources.SplitBatches extends: read
# when this module is imported (a class needs its base), so a Keras without it fails at connect().
DataAdapter = _name("DataAdapter")

# Keras' global state (the variables awaiting values, the active StatelessScope): read by
# meshfit.fit.memory_plan's abstract models, which Keras offers no public way to build.
global_state = _name("global_state")


def unscale_loss_for_distribution(loss: Any) -> Any:
    """A loss as Keras' loss tracker records it (the inverse of the scaling Keras applies for a
    distribution), for meshfit.fit.tf_microbatch's sliced train step, which repeats Keras'."""
    return _name("unscale_loss_for_distribution")(loss)


def draw_seed(seed: Any) -> Any:
    """The key Keras' random functions draw with for `seed` (an int: [seed, 0]; a SeedGenerator:
    its next state, advanced as Keras would): meshfit.fit.sharded_init passes it to a compiled
    draw, so the values are Keras' own."""
    return _name("draw_seed")(seed)


def stacks_dispatch_batches() -> bool:
    """True where Keras' JAX trainer asks its data adapter for each dispatch's batches stacked
    (`get_jax_iterator(super_batch=k)` with steps_per_execution = k: Keras 3.16, its nightly
    builds), and runs them in its own on-device loop; Keras 3.15 takes them one by one."""
    return "super_batch" in inspect.signature(DataAdapter.get_jax_iterator).parameters


def super_batch_iterator(batches: Any, k: int) -> Any:
    """Keras 3.16's stacking of `batches` for `get_jax_iterator(super_batch=k)`: every k batches of
    equal shapes stacked on a new leading axis, the others (an epoch's last) as a list of them.
    Only a Keras that asks for it (stacks_dispatch_batches) is asked."""
    import jax.numpy as jnp  # the JAX engine's only (the TensorFlow engine reads no jax iterator)

    return private("keras.src.trainers.data_adapters.data_adapter_utils", "super_batch_iterator")(
        batches, k, stack_fn=jnp.stack)


def is_backend_class(cls: type) -> bool:
    """True for a class of one of Keras' backends (JAXTrainer, TensorFlowTrainer, ...), i.e. not
    a user's subclass: the layout of keras.src, which has no public name for these classes."""
    return cls.__module__.startswith(_BACKEND_MODULES)


def is_keras_layer(cls: type) -> bool:
    """True for a layer class of Keras' own (keras.src.layers), not a user's subclass of one."""
    return cls.__module__.startswith("keras.src.layers.")


def layers_declining_jit(model) -> list:
    """The layers of `model` whose `supports_jit` is False: what makes Keras' jit_compile="auto"
    (its private model_supports_jit, reading the same attribute) run the model op by op."""
    return [layer for layer in model._flatten_layers() if not layer.supports_jit]


def forget_failed_trace(model) -> None:
    """Empty `model._losses_override` where a failed trace of its step left it non-empty. Keras'
    JAX `compute_loss_and_updates` puts the traced `add_loss` terms there and empties it only when
    the trace gets through the loss, and the next trace of the step takes that stale list for
    the forward pass' losses and empties it: those terms silently dropped from the next fit or
    evaluate (docs/reference/keras-losses-override.md). (meshfit.watch.keras_side.report, below
    this package, does the same for its own traces.)"""
    if getattr(model, "_losses_override", None):  # only a failed trace leaves it non-empty
        model._losses_override = []


@contextlib.contextmanager
def jit_compiled(model):
    """Inside the block `model.jit_compile` is True, whatever its layers say (Keras' setter turns
    True into False, with a warning, for a model with a layer declining XLA); False after it.
    meshfit.fit.declined_jit makes the compiled step functions there."""
    model._jit_compile = True
    try:
        yield
    finally:
        model._jit_compile = False


def backend_trainer() -> type:
    """The trainer class of Keras' backend that keras.Model takes `fit` from (JAXTrainer, ...)."""
    found = next((c for c in type.mro(keras.Model) if "fit" in vars(c) and is_backend_class(c)), None)
    if found is None:
        raise lacking(f"backend trainer with fit in {_BACKEND_MODULES}* among keras.Model's bases")
    return found


def _trainer() -> type:
    return _name("Trainer")


def _jax_distribution_lib():
    return _name("distribution_lib")


def _jax_variable() -> type:
    return _name("JaxVariable")


def _keras_variable() -> type:
    return _name("KerasVariable")


def _saving_lib():
    return _name("saving_lib")


def _h5_store() -> type:
    return _name("H5IOStore")


def _file_utils():
    return _name("file_utils")


def _numpy_conversions():
    """Where ops.convert_to_numpy finds the backend's convert_to_numpy at each call: the module
    keras.src.backend (Keras 3.15); Keras 3.16 moved it to keras.src.backend.jax.ops.core."""
    backend = _name("backend")
    if hasattr(backend, "convert_to_numpy"):
        return backend
    return private("keras.src.backend.jax.ops.core")


def variables_drawn_by(draw: Callable[[Any, tuple, str, Any], Any]) -> Callable[[Callable], Callable]:
    """The wrapper of `JaxVariable._initialize_with_initializer` (PATCHES): a variable's value is
    `draw(initializer, shape, dtype, layout)` (layout: the variable's JAX layout, e.g. a
    NamedSharding, or None), and Keras' own initialization where that returns None. Every use
    of the variable's private attributes is here: its layout is resolved as Keras does first."""

    def wrap(keras_init: Callable) -> Callable:
        @functools.wraps(keras_init)
        def initialize(variable, initializer):
            variable._initialize_layout()
            layout = getattr(variable._layout, "backend_layout", variable._layout)
            value = draw(initializer, tuple(variable._shape), variable._dtype, layout)
            if value is None:
                keras_init(variable, initializer)
            else:
                variable._value = value

        return initialize

    return wrap


@contextlib.contextmanager
def optimizers_made_outside_stateless_scope():
    """Inside the block, an optimizer's __init__ runs outside any StatelessScope.

    Patches `BaseOptimizer.__init__` for the block only (restored after it). Keras' optimizer
    makes its step counter and learning rate from values, which a StatelessScope refuses;
    meshfit.fit.memory_plan builds abstract models (variables without values) in one, optimizer
    included. No public option makes the optimizer's own variables concrete."""
    base = _name("BaseOptimizer")
    init = base.__init__

    def concrete_init(self, *args, **kwargs):
        scope = global_state.get_global_attribute("stateless_scope")
        global_state.set_global_attribute("stateless_scope", None)
        try:
            init(self, *args, **kwargs)
        finally:
            global_state.set_global_attribute("stateless_scope", scope)

    base.__init__ = concrete_init
    try:
        yield
    finally:
        base.__init__ = init


# ------------------------------------------------------------------ the patches of Keras

@dataclass(frozen=True)
class Patch:
    """One Keras function or method meshfit replaces by a wrapper of it (see apply_patches)."""

    name: str  # the key its wrapper is given under
    owner: Callable[[], Any]  # the class or module holding it (resolved when patches are applied)
    attribute: str
    backend: str | None  # the Keras backend it applies on; None: every backend
    parameters: tuple[str, ...]  # its leading parameters, as the wrapper calls it
    changes: str  # what meshfit's wrapper does
    why: str  # why no public way does it


_TRAINER_METHOD = ("self", "force")
PATCHES = (
    Patch("fit: report and loop", backend_trainer, "fit", None,
          ("self", "x", "y", "batch_size", "epochs", "verbose", "callbacks"),
          "adds the per-epoch report (or the notebook bar), the memory plan of sharding='auto', "
          "the on-device k-step loop (JAX) and goodput while a meshfit Strategy is active",
          "users call plain model.fit; a callback cannot change fit's arguments or its train function"),
    Patch("make_train_function: timed (TensorFlow)", backend_trainer, "make_train_function",
          "tensorflow", _TRAINER_METHOD,
          "reads each batch in Python so that input wait can be timed (goodput)",
          "Keras' TensorFlow train function reads tf.data iterators in-graph, where no wait shows"),
    Patch("distribute_data_input", _jax_distribution_lib, "distribute_data_input", "jax",
          ("per_process_batch", "layout", "batch_dim_name"),
          "a batch whose rows do not split across the devices is placed whole on every device",
          "Keras' placement raises JAX's IndivisibleError for an epoch's short last batch"),
    Patch("distribute_tensor", _jax_distribution_lib, "distribute_tensor", "jax", ("tensor", "layout"),
          "every dimension the layout's mesh axes do not divide is held whole",
          "keras-hub's generate and user code place tensors through it: IndivisibleError otherwise"),
    Patch("JaxVariable._initialize_with_initializer", _jax_variable, "_initialize_with_initializer",
          "jax", ("self", "initializer"),
          "a variable whose layout splits it is drawn by one compiled program into its shards",
          "Keras draws variables under 250 MiB x devices whole on one device, compiling per variable; "
          "its public layout= path needs initializers that take layout, which its own do not"),
    Patch("compile: jit_compile asked", _trainer, "compile", "jax", ("self", "optimizer"),
          "remembers whether the user passed jit_compile=False (then kept op by op)",
          "Keras keeps only the resolved value, False also where a layer declined XLA"),
    Patch("make_train_function", backend_trainer, "make_train_function", "jax", _TRAINER_METHOD,
          "each dispatch is counted for the heartbeat and timed for goodput; a model that one of "
          "Keras' layers keeps op by op is compiled (meshfit.fit.declined_jit)",
          "the train function is made inside fit, where no callback sees each dispatch; Keras "
          "offers no way past a layer's supports_jit = False"),
    Patch("make_test_function", backend_trainer, "make_test_function", "jax", _TRAINER_METHOD,
          "each dispatch is counted for the heartbeat; compiled as make_train_function's",
          "as make_train_function"),
    Patch("make_predict_function", backend_trainer, "make_predict_function", "jax", _TRAINER_METHOD,
          "each dispatch is counted for the heartbeat; compiled as make_train_function's",
          "as make_train_function"),
    Patch("fit: stall guard", backend_trainer, "fit", "jax", ("self",),
          "fit runs under the stall guard and returns once its last step has run",
          "a collective that never finishes otherwise hangs, or XLA aborts the process"),
    Patch("evaluate: stall guard", backend_trainer, "evaluate", "jax", ("self",),
          "evaluate runs under the stall guard, its time charged to goodput's eval", "as fit"),
    Patch("predict: stall guard", backend_trainer, "predict", "jax", ("self",),
          "predict runs under the stall guard", "as fit"),
    *(Patch(f"{name}: stall guard", backend_trainer, name, "jax", ("self",),
            f"{name} runs under the stall guard",
            "as fit: a custom loop of them (a GAN's) made on one process alone waited for ever")
      for name in ("train_on_batch", "test_on_batch", "predict_on_batch")),
    Patch("Variable.__array__", _keras_variable, "__array__", "jax", ("self", "dtype"),
          "on several processes, a variable split across them is read whole (gathered from every "
          "process) by Keras' saving, numpy() and get_weights",
          "Keras reads each variable with np.array, which JAX refuses for an array other "
          "processes hold part of"),
    Patch("backend.convert_to_numpy", _numpy_conversions, "convert_to_numpy", "jax", ("x",),
          "on several processes, an array split across them is read whole (keras-hub's generate "
          "returns its tokens so)", "ops.convert_to_numpy reads arrays with np.array, as above"),
    Patch("saving_lib.save_model", _saving_lib, "save_model", "jax", ("model", "filepath"),
          "on several processes, each writes a private .keras file and renames it over the target",
          "model.save and ModelCheckpoint write the path they are given from every process"),
    Patch("H5IOStore.__init__", _h5_store, "__init__", "jax", ("self", "path_or_io", "archive", "mode"),
          "on several processes, a .weights.h5 (or keras-hub's .lora.h5) is written to a private "
          "file", "as saving_lib.save_model: save_weights and BackupAndRestore write it from every process"),
    Patch("H5IOStore.close", _h5_store, "close", "jax", ("self",),
          "that private file is renamed over the target once complete", "as H5IOStore.__init__"),
    *(Patch(f"{owner}.clear_session", functools.partial(importlib.import_module, owner),
            "clear_session", None, ("free_memory",),
            "the active meshfit Strategy's distribution and dtype policy are set again after it",
            "Keras' clear_session drops every global setting, inside a Strategy's scope too: a "
            "hyperparameter loop's models were built silently on one device")
      for owner in ("keras.backend", "keras.utils")),
    Patch("BackupAndRestore.on_train_end", lambda: keras.callbacks.BackupAndRestore, "on_train_end",
          "jax", ("self", "logs"),
          "on several processes, each meets the others before the backup folder is removed",
          "a process that finished first removed it while another still wrote its last backup"),
    Patch("Model.export", lambda: keras.Model, "export", "jax", ("self", "filepath"),
          "on several processes, the variables split across them are gathered and process 0 "
          "alone writes the SavedModel", "Keras' export reads each variable with tf.Variable, "
          "which JAX refuses for an array other processes hold part of"),
    Patch("CSVLogger.on_train_begin", lambda: keras.callbacks.CSVLogger, "on_train_begin", "jax",
          ("self", "logs"), "on several processes, only process 0 writes the CSV file",
          "every process wrote the same file: each line as many times with append=True"),
    Patch("file_utils.rmtree", _file_utils, "rmtree", "jax", ("path",),
          "on several processes, a folder another process removes at the same time is removed to "
          "the end, not an error", "BackupAndRestore removes its folder from every process at the end of fit"),
)
_applied: set[str] = set()  # names of the patches applied in this process


def _target(patch: Patch) -> tuple[Any, Callable]:
    """(owner, the function now there) of `patch`; a one-line MeshfitError where this Keras lacks
    it or it takes other parameters than the wrapper calls it with."""
    owner = patch.owner()
    where = f"{owner.__module__}.{owner.__qualname__}" if inspect.isclass(owner) else owner.__name__
    where += f".{patch.attribute}"
    # A class's own attribute: one inherited from a base is not the backend's to wrap.
    present = patch.attribute in vars(owner) if inspect.isclass(owner) else hasattr(owner, patch.attribute)
    if not present:
        raise lacking(where)
    function = getattr(owner, patch.attribute)
    try:
        names = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        names = ()
    if names[:len(patch.parameters)] != patch.parameters:
        raise lacking(f"{where}({', '.join(patch.parameters)}, ...) (it takes ({', '.join(names)}))")
    return owner, function


def check() -> None:
    """Read every private name and patch target meshfit uses on Keras' backend: the one-line
    MeshfitError of the first one this Keras lacks or has changed, else nothing."""
    backend = keras.backend.backend()
    for key in list(_NAMES) + (list(_JAX_NAMES) if backend == "jax" else []):
        _name(key)
    for patch in PATCHES:
        if patch.backend in (None, backend):
            _target(patch)


def apply_patches(wrappers: Mapping[str, Callable[[Callable], Callable] | None]) -> None:
    """Replace each function of PATCHES that applies to Keras' backend by `wrappers[name](it)`, in
    the table's order (a later patch of the same method wraps the earlier one), once per process.
    A wrapper that is None leaves its function as Keras has it. Every target is checked before
    any is replaced: a Keras that lacks one gets a one-line MeshfitError and no patch at all."""
    unknown = set(wrappers) - {p.name for p in PATCHES}
    if unknown:
        raise ValueError(f"no such patch: {sorted(unknown)}")
    backend = keras.backend.backend()
    chosen = [p for p in PATCHES if p.backend in (None, backend) and wrappers.get(p.name)
              and p.name not in _applied]
    for patch in chosen:
        _target(patch)
    for patch in chosen:
        owner, function = _target(patch)  # again: an earlier patch may have wrapped it
        setattr(owner, patch.attribute, wrappers[patch.name](function))
        _applied.add(patch.name)
