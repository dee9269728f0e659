"""Tests run on 8 simulated JAX CPU devices with the JAX engine unless a test says otherwise.

The fixtures shared by the test files are here; the plain helpers they import are in helpers.py.
Tests marked `slow` take more than about 20 s each on a 2-core CPU: `pytest -m "not slow"` skips them.
"""

import os
import shutil
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
from meshfit.parallel import devices  # noqa: E402 (light: no JAX yet)

devices.use_simulated_devices(8)  # the device count and meshfit's other XLA flags for simulated devices
# TensorFlow's and XLA's C++ log lines off in the suite's processes but for fatal ones (a user's
# run keeps warnings and errors: `import jax` sets the level to 1, and meshfit leaves it).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One JAX compilation cache for the session, its xdist workers and every meshfit subprocess they
# start (all inherit this environment): the suite compiles the same small programs in dozens of
# processes. Entries are keyed by program, flags and devices, so a hit is the same executable.
_JAX_CACHE = None if "JAX_COMPILATION_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="meshfit-tests-jax-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _JAX_CACHE or "")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The CPU peak behind MFU is probed once per machine and cached under $XDG_CACHE_HOME/meshfit
# (about a second of matrix products): once for the session too, though tests give each meshfit
# subprocess a HOME of its own (test_goodput sets its own cache where it tests the probe).
if _JAX_CACHE:  # the session's own folders, removed at its end
    os.environ.setdefault("XDG_CACHE_HOME", os.path.join(_JAX_CACHE, "xdg"))
    # and the datasets' cache (downloads, unpacked arrays), so no test leaves files in HOME
    os.environ.setdefault("MESHFIT_CACHE", os.path.join(_JAX_CACHE, "datasets"))

import pytest  # noqa: E402 (the environment above must come first)
from helpers import connect_eight_devices, write_idx_dataset  # noqa: E402


@pytest.fixture
def strategy():
    """The 8 simulated devices, made the active Keras distribution and precision again for each
    test (a test may leave another one active); cheap, as JAX starts only once."""
    return connect_eight_devices()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A folder with tiny generated fashion-mnist/ and mnist/ datasets (helpers.N_TRAIN training
    and helpers.N_TEST test images each) in their canonical IDX files."""
    root = tmp_path_factory.mktemp("data")
    write_idx_dataset(root / "fashion-mnist")
    write_idx_dataset(root / "mnist", seed=1)
    return str(root)


def pytest_unconfigure(config):
    if _JAX_CACHE:  # the session (or xdist controller) that made the cache removes it
        shutil.rmtree(_JAX_CACHE, ignore_errors=True)
