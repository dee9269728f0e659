"""The seam to Keras' and JAX's private code: only meshfit.fit.keras_internals and
meshfit.parallel.jax_internals reach into it (read from every import statement and string of
meshfit/), everything they read exists on the installed versions, and a version lacking one gets a
one-line MeshfitError naming the version and the pins (or a stated fallback), not a wrong result."""

import ast
import os
import warnings

import pytest

import meshfit
from meshfit.errors import MeshfitError
from meshfit.parallel import jax_internals

PACKAGE = os.path.dirname(meshfit.__file__)
SEAMS = {"fit/keras_internals.py", "parallel/jax_internals.py"}
PRIVATE = ("keras.src", "jax._src", "jaxlib", "ctypes")
# ctypes elsewhere only for a public C function, never a library's internals: each with its reason.
PUBLIC_C_CALLS = {"launch/process.py": "libc's prctl(PR_SET_PDEATHSIG): launched processes die "
                                        "with the launcher"}


def _private(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PRIVATE)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module and its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def private_reaches(path: str) -> list[str]:
    """'line: what' for each import of private Keras/JAX code or ctypes in the file at `path`
    (at its top or inside a function), and each string naming such a module (importlib's way in)."""
    tree = ast.parse(open(path).read())
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings and any(p in node.value for p in ("keras.src", "jax._src"))):
            found.append(f"{node.lineno}: the string {node.value!r}")
        found += [f"{node.lineno}: import {n}" for n in names if _private(n)][:1]
    return found


def test_only_the_two_seams_reach_into_private_keras_jax_or_native_code():
    offences = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            relative = os.path.relpath(os.path.join(folder, name), PACKAGE).replace(os.sep, "/")
            if not name.endswith(".py") or relative in SEAMS:
                continue
            reaches = private_reaches(os.path.join(folder, name))
            if relative in PUBLIC_C_CALLS:
                reaches = [r for r in reaches if not r.endswith("import ctypes")]
            offences += [f"meshfit/{relative}:{r}" for r in reaches]
    assert not offences, offences
    for seam in SEAMS:  # the check sees what the seams do
        assert private_reaches(os.path.join(PACKAGE, seam)), seam


def test_the_reach_finder_sees_every_way_in(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('"""keras.src in a docstring is prose."""\n'
                      "import ctypes\nfrom keras.src.utils import rng_utils\nfrom jax import numpy\n"
                      "def f():\n    from jax._src import clusters\n    import jaxlib._jax\n"
                      "    return importlib.import_module('keras.src.tree')\n")
    assert private_reaches(str(source)) == [
        "2: import ctypes", "3: import keras.src.utils", "6: import jax._src", "7: import jaxlib._jax",
        "8: the string 'keras.src.tree'"]


# ------------------------------------------------------------------------------- Keras' seam

def test_every_private_name_and_patch_target_exists_on_this_keras():
    """What the CI's version sets check: a Keras that moved one fails here, not in a user's fit."""
    from meshfit.fit import keras_internals

    keras_internals.check()
    assert len(keras_internals.PATCHES) == 26
    assert len({p.name for p in keras_internals.PATCHES}) == 26


def test_the_patches_are_applied_where_the_table_says(strategy):
    """After connect() every patch of the JAX engine wraps the function Keras had (functools.wraps)."""
    import inspect

    from meshfit.fit import keras_internals

    assert {p.name for p in keras_internals.PATCHES if p.backend != "tensorflow"} <= keras_internals._applied
    for patch in keras_internals.PATCHES:
        if patch.backend != "tensorflow":
            function = getattr(patch.owner(), patch.attribute)
            assert hasattr(function, "__wrapped__") and inspect.getmodule(
                inspect.unwrap(function)).__name__.startswith("keras."), patch.name


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_a_keras_lacking_a_patched_function_is_one_line_and_patches_nothing(monkeypatch):
    import keras
    from keras.src.backend.jax import distribution_lib

    from meshfit.fit import keras_internals

    monkeypatch.setattr(keras_internals, "_applied", set())  # as in a fresh process
    place = distribution_lib.distribute_tensor
    monkeypatch.delattr(distribution_lib, "distribute_data_input")
    with pytest.raises(MeshfitError) as error:
        keras_internals.apply_patches({"distribute_tensor": lambda f: None,
                                       "distribute_data_input": lambda f: None})
    message = _one_line(error)
    assert f"Keras {keras.__version__} has no keras.src.backend.jax.distribution_lib.distribute_data_input" in message
    assert "checked on Keras 3.15.1" in message and "pip install 'keras" in message
    assert distribution_lib.distribute_tensor is place  # checked first: nothing half-patched


def test_a_method_only_inherited_or_with_other_parameters_is_lacking(monkeypatch):
    """A backend trainer that stops defining make_predict_function itself (the base Trainer's
    would be wrapped instead), or a function whose parameters changed, is refused by name."""
    from keras.src.backend.jax import distribution_lib

    from meshfit.fit import keras_internals

    monkeypatch.setattr(keras_internals, "_applied", set())
    trainer = keras_internals.backend_trainer()
    monkeypatch.delattr(trainer, "make_predict_function")
    with pytest.raises(MeshfitError) as error:
        keras_internals.apply_patches({"make_predict_function": lambda f: f})
    assert f"{trainer.__name__}.make_predict_function, which meshfit relies on" in _one_line(error)
    monkeypatch.setattr(distribution_lib, "distribute_tensor", lambda value, where: value)
    with pytest.raises(MeshfitError, match=r"distribute_tensor\(tensor, layout, \.\.\.\) \(it takes "
                                           r"\(value, where\)\)"):
        keras_internals.check()


def test_a_keras_lacking_a_private_name_is_one_line(monkeypatch):
    from keras.src.utils import rng_utils

    from meshfit.fit import keras_internals

    monkeypatch.delattr(rng_utils, "get_random_seed")
    with pytest.raises(MeshfitError) as error:
        keras_internals.get_random_seed()
    assert "has no keras.src.utils.rng_utils.get_random_seed, which meshfit relies on" in _one_line(error)


def test_a_name_a_later_keras_moved_is_read_where_it_went(monkeypatch):
    """Keras 3.16 moved the JAX variable class to keras.src.backend.jax.ops.core (as `Variable`,
    or `JaxVariable` under Flax NNX); a Keras with neither place is named by the first."""
    import sys
    import types

    from meshfit.fit import keras_internals

    old, new = (types.ModuleType(f"keras.src.backend.jax.{name}") for name in ("core", "ops.core"))
    monkeypatch.setitem(sys.modules, old.__name__, old)  # without JaxVariable, as in Keras 3.16
    monkeypatch.setitem(sys.modules, new.__name__, new)
    new.Variable = type("Variable", (), {})
    assert keras_internals._name("JaxVariable") is new.Variable
    new.JaxVariable = type("JaxVariable", (), {})  # NNX on: `Variable` is its subclass
    assert keras_internals._name("JaxVariable") is new.JaxVariable
    old.JaxVariable = type("JaxVariable", (), {})  # Keras 3.15: its own place first
    assert keras_internals._name("JaxVariable") is old.JaxVariable
    del old.JaxVariable
    monkeypatch.setitem(sys.modules, new.__name__, None)  # no such module
    with pytest.raises(MeshfitError) as error:
        keras_internals._name("JaxVariable")
    assert "has no keras.src.backend.jax.core.JaxVariable, which meshfit relies on" in _one_line(error)


def test_the_abstract_optimizer_patch_is_undone_after_its_block():
    import keras

    from meshfit.fit import keras_internals

    base = keras_internals._name("BaseOptimizer")
    init = base.__init__
    with keras_internals.optimizers_made_outside_stateless_scope(), keras.StatelessScope():
        assert base.__init__ is not init
        optimizer = keras.optimizers.SGD(0.1)  # its iteration counter needs a value: refused otherwise
    assert base.__init__ is init and int(keras.ops.convert_to_numpy(optimizer.iterations)) == 0


# --------------------------------------------------------------------------------- JAX's seam

def test_the_pins_in_the_errors_are_meshfits_own():
    """pyproject.toml's, as installed: e.g. jax<0.13,>=0.6 (not jaxlib's, nor an extra's)."""
    import re

    for package in ("jax", "keras"):
        assert re.fullmatch(rf"{package}[<>=!~][<>=!~,.\d]+", jax_internals.supported(package))
    assert jax_internals.supported("no-such-package") == "no-such-package"


def test_a_jax_lacking_its_backend_state_is_one_line(monkeypatch):
    import jax
    from jax._src import xla_bridge

    monkeypatch.delattr(xla_bridge, "backends_are_initialized")
    with pytest.raises(MeshfitError) as error:
        jax_internals.backends_started()
    message = _one_line(error)
    assert f"JAX {jax.__version__} has no jax._src.xla_bridge.backends_are_initialized" in message
    assert "pip install 'jax" in message


def test_a_jax_lacking_its_cluster_detectors_says_so_and_detects_none(monkeypatch):
    from jax._src import clusters

    monkeypatch.delattr(clusters.ClusterEnv, "_cluster_types")
    with pytest.warns(UserWarning, match="SLURM, Open MPI, TPU-pod and Kubernetes jobs are not detected"):
        assert jax_internals.cluster_detectors() == []
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert any(kind.__name__ == "SlurmCluster" for kind in jax_internals.cluster_detectors())


def test_gloo_on_the_loopback_or_a_warning_where_jaxlib_lacks_it(monkeypatch):
    from jax._src.lib import _jax

    make = _jax.make_gloo_tcp_collectives
    monkeypatch.setattr(_jax, "make_gloo_tcp_collectives", make)  # restored after the test
    jax_internals.gloo_on_loopback()
    assert _jax.make_gloo_tcp_collectives.keywords == {"hostname": "127.0.0.1"}
    jax_internals.gloo_on_loopback()  # once: not wrapped twice
    assert _jax.make_gloo_tcp_collectives.func is make
    monkeypatch.setattr(_jax, "make_gloo_tcp_collectives", None)
    with pytest.warns(UserWarning, match="listen on this host name's address"):
        jax_internals.gloo_on_loopback()
    assert _jax.make_gloo_tcp_collectives is None


def test_the_coordination_barrier_exists_and_times_out_into_false(monkeypatch):
    """every_process_reaches reads JAX's distributed client (its barrier is checked in a job by
    tests/test_keras_backup.py): here a client that times out answers False, another error is
    raised, and a JAX without the client lets the caller go on (True)."""
    from jax._src import distributed
    from jax._src.lib import _jax

    assert hasattr(distributed.global_state, "client")
    assert "timeout_in_ms" in _jax.DistributedRuntimeClient.wait_at_barrier.__doc__

    class Client:
        def __init__(self, error=None):
            self.error, self.calls = error, []

        def wait_at_barrier(self, barrier, timeout_in_ms):
            self.calls.append((barrier, timeout_in_ms))
            if self.error:
                raise self.error

    timed_out = Client(RuntimeError("DEADLINE_EXCEEDED: Barrier timed out. Id: b::0"))
    monkeypatch.setattr(distributed.global_state, "client", timed_out)
    assert jax_internals.every_process_reaches("b", 2.5) is False
    assert timed_out.calls == [("b", 2500)]
    monkeypatch.setattr(distributed.global_state, "client", Client())
    assert jax_internals.every_process_reaches("c", 1) is True
    monkeypatch.setattr(distributed.global_state, "client", Client(RuntimeError("UNAVAILABLE")))
    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        jax_internals.every_process_reaches("d", 1)
    monkeypatch.setattr(distributed.global_state, "client", None)  # no wait_at_barrier
    assert jax_internals.every_process_reaches("e", 1) is True
