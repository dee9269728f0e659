"""The one place meshfit's light core reaches into JAX's and jaxlib's private code or into a
native library (ctypes): each use below says what it does, why no public way does it, which
versions it was checked on, and what happens on a version that lacks it. The Keras side has its
own seam, meshfit.fit.keras_internals; no other module imports `jax._src`, `jaxlib` or ctypes
(tests/test_seam.py reads every import statement). docs/reference/internals.md lists both seams.

Checked on JAX and jaxlib 0.10.2 (Python 3.11), 0.11.2 (Python 3.12) and 0.12.0.1 (Python 3.13),
on Linux. Like every
module of meshfit.parallel this imports no JAX at its top (and never Keras): each function
imports what it needs when called.
"""

from __future__ import annotations

import functools
import sys
import warnings

from meshfit.errors import MeshfitError

CHECKED_ON = "JAX 0.10.2, 0.11.2 and 0.12.0.1"


def supported(package: str) -> str:
    """meshfit's requirement for `package` as pip takes it, e.g. "jax<0.13,>=0.6" (read from
    meshfit's installed metadata, pyproject.toml's pins), or the bare name where unknown."""
    from importlib import metadata

    try:
        requirements = metadata.requires("meshfit") or []
    except metadata.PackageNotFoundError:
        return package
    for requirement in requirements:
        name = requirement.split(";")[0].strip()
        if name.startswith(package) and name[len(package):][:1] in ("<", ">", "=", "!", "~", " "):
            return name.replace(" ", "")
    return package


def lacking(package: str, version: str, what: str, checked: str) -> MeshfitError:
    """The one-line error for a `package` `version` without `what`, which meshfit relies on."""
    return MeshfitError(f"{package} {version} has no {what}, which meshfit relies on (checked on "
                        f"{checked}); install a supported version: pip install '{supported(package.lower())}'")


def _jax_version() -> str:
    import jax

    return jax.__version__


def cluster_detectors() -> list[type]:
    """JAX's cluster detectors that `jax.distributed.initialize()` runs unasked (Cloud TPU, SLURM,
    Open MPI, Kubernetes; not the opt-in ones such as mpi4py), each with `is_env_present()` and
    `get_process_count()`.

    Private: `jax._src.clusters.ClusterEnv._cluster_types`. JAX has no public way to ask whether
    the environment describes a job without joining it, and meshfit must know before it starts
    JAX's backends. Without JAX: none. A JAX lacking these detectors: none, with a warning that
    only the MESHFIT_* variables then describe a job (a SLURM or mpirun job is not joined).
    """
    try:
        import jax  # noqa: F401 (no JAX: no detectors, and no job to join)
    except ImportError:
        return []
    try:
        from jax._src import clusters

        kinds = list(clusters.ClusterEnv._cluster_types)
    except (ImportError, AttributeError):
        warnings.warn(f"JAX {_jax_version()} has no cluster detectors meshfit knows "
                      "(jax._src.clusters.ClusterEnv._cluster_types): SLURM, Open MPI, TPU-pod and "
                      "Kubernetes jobs are not detected; set MESHFIT_COORDINATOR, "
                      "MESHFIT_NUM_PROCESSES and MESHFIT_PROCESS_ID to join one, MESHFIT_NUM_PROCESSES=1 "
                      f"on one host, or pip install '{supported('jax')}'", stacklevel=3)
        return []
    return [kind for kind in kinds if not getattr(kind, "opt_in_only_method", False)]


def backends_started() -> bool:
    """True once JAX has created its backends (device count and platform are then fixed).

    Private: `jax._src.xla_bridge.backends_are_initialized()`. Public calls (`jax.devices()`)
    would start the backends themselves. A JAX lacking it: a one-line MeshfitError (guessing
    either way would silently simulate the wrong device count or refuse to join a job).
    """
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized
    except (ImportError, AttributeError):
        raise lacking("JAX", _jax_version(), "jax._src.xla_bridge.backends_are_initialized",
                      CHECKED_ON) from None
    return started()


def every_process_reaches(barrier: str, seconds: float) -> bool:
    """Wait up to `seconds` until every process of the job reaches `barrier` (a name each process
    uses once, in the same order); False where one did not in that time.

    Private: `jax._src.distributed.global_state.client.wait_at_barrier`, the barrier of JAX's
    coordination service (orbax-checkpoint's is the same call). JAX's public barrier,
    multihost_utils.sync_global_devices, is a device collective, which waits without end for a
    process that never comes. A barrier that timed out fails only itself; later ones pass (checked
    on JAX 0.10.2 and 0.12.0.1). A JAX lacking it: True at once, so the caller goes on to
    its collective as before (the stall guard then ends a wait for a process that never comes).
    """
    try:
        from jax._src import distributed

        wait = distributed.global_state.client.wait_at_barrier
    except (ImportError, AttributeError):
        return True
    try:
        wait(barrier, max(1, int(seconds * 1000)))
    except Exception as e:  # jax.errors.JaxRuntimeError; the service's status is in its text
        if "DEADLINE_EXCEEDED" in str(e):
            return False
        raise
    return True


def every_process_tells(key: str, value: str, processes: int, index: int,
                        seconds: float) -> list[str] | None:
    """Every process's `value` under `key` (a name each process uses once, in the same order),
    in process order; None where one did not tell within `seconds`, or where this JAX lacks the
    store (the caller then checks nothing).

    Private: the key-value store of JAX's coordination service
    (`jax._src.distributed.global_state.client.key_value_set`, `blocking_key_value_get`; checked
    on JAX 0.10.2 and 0.12.0.1): one round trip to the coordinator, no device collective (which
    would wait for the devices' queued steps, or for ever for a process that never comes)."""
    try:
        from jax._src import distributed

        client = distributed.global_state.client
        client.key_value_set(f"{key}/{index}", value)
        return [client.blocking_key_value_get(f"{key}/{i}", max(1, int(seconds * 1000)))
                for i in range(processes)]
    except (ImportError, AttributeError):
        return None
    except Exception as e:  # jax.errors.JaxRuntimeError; the service's status is in its text
        if "DEADLINE_EXCEEDED" in str(e):
            return None
        raise


def gloo_on_loopback() -> None:
    """Make gloo's collectives listen on 127.0.0.1 rather than on this host name's address.

    Patches jaxlib's `jax._src.lib._jax.make_gloo_tcp_collectives` (a jaxlib function), giving it
    `hostname="127.0.0.1"`: JAX creates the collectives without a host name
    (jax._src.xla_bridge), and has no setting for it. Used for a job whose coordinator is on the
    loopback (`meshfit launch`), so nothing listens beyond this machine. A jaxlib lacking the
    function, or whose function takes no `hostname`: a warning, and gloo listens where JAX puts
    it (the job still runs; its collectives are reachable from the network like JAX's own).
    """
    from jax._src.lib import _jax

    make = getattr(_jax, "make_gloo_tcp_collectives", None)
    if isinstance(make, functools.partial):
        return  # patched already
    if make is None or "hostname" not in (getattr(make, "__doc__", None) or ""):
        warnings.warn(f"jaxlib {_jax_version()} has no make_gloo_tcp_collectives(hostname=...) "
                      f"(checked on {CHECKED_ON}): gloo's collectives listen on this host name's "
                      f"address, not only on 127.0.0.1; pip install '{supported('jax')}' to keep "
                      "them on the loopback", stacklevel=2)
        return
    _jax.make_gloo_tcp_collectives = functools.partial(make, hostname="127.0.0.1")


def cpp_stdout_off() -> None:
    """Make C++'s std::cout write nothing in this process (Python's own output is untouched).

    Gloo writes "[Gloo] Rank i is connected to n peer ranks..." to std::cout, unconditionally, each
    time a set of devices first runs a collective: 24-45 lines a training run under srun or mpirun
    (gloo/transport/tcp/context.cc, printConnectivityInfo), and srun or mpirun, unlike meshfit
    launch, filter nothing. Nothing meshfit shows is written there: sys.stdout writes to file
    descriptor 1 itself, C++ logs go to stderr. Setting std::cout's badbit through ctypes
    (Itanium C++ ABI, libstdc++: Linux) makes its writes no-ops. Where that library or its layout
    is not what is expected (macOS, another C++ runtime), nothing is changed: the lines stay.
    """
    import ctypes

    try:
        libstdcxx = ctypes.CDLL("libstdc++.so.6")  # the one jaxlib loaded: same soname
        cout = ctypes.addressof(ctypes.c_char.in_dll(libstdcxx, "_ZSt4cout"))
        clear = libstdcxx._ZNSt9basic_iosIcSt11char_traitsIcEE5clearESt12_Ios_Iostate
    except (OSError, AttributeError, ValueError):
        return
    vtable = ctypes.c_void_p.from_address(cout).value  # None until some library's iostream init ran
    if not vtable:
        return
    # std::ostream's virtual base std::basic_ios: its offset is the word 3 before the vtable's start
    offset = ctypes.c_ssize_t.from_address(vtable - 3 * ctypes.sizeof(ctypes.c_void_p)).value
    if not 0 < offset <= 64:
        return
    clear.argtypes, clear.restype = [ctypes.c_void_p, ctypes.c_int], None
    clear(cout + offset, 1)  # std::ios_base::badbit
