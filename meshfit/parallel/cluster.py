"""Joining a multi-host job: the same program runs once per host (or per GPU) and JAX joins them.

`join()` runs inside `meshfit.connect()`, before JAX starts its backends. It calls
`jax.distributed.initialize` only when the environment describes a job of two or more processes:

- `MESHFIT_COORDINATOR` (host:port of process 0), `MESHFIT_NUM_PROCESSES`, `MESHFIT_PROCESS_ID`
  and optionally `MESHFIT_LOCAL_DEVICE_IDS` (e.g. "0" for one GPU per process), as set by
  `meshfit launch` or by hand;
- otherwise the environments JAX itself detects: Cloud TPU pod slices (GCE or GKE), SLURM,
  Open MPI (`mpirun`) and Kubernetes (with `pip install jax[k8s]`).

A plain single-host run finds neither and starts at once. `MESHFIT_NUM_PROCESSES=1` turns the
detection off. Joining waits at most `MESHFIT_INIT_TIMEOUT` seconds (default 300) for all processes,
and a process that stops sending heartbeats for `MESHFIT_HEARTBEAT_TIMEOUT` seconds (default 60)
makes the others stop with an error, so a dead peer cannot hang the job.

Process 0 runs JAX's coordinator, an unauthenticated gRPC service. It listens on
`MESHFIT_COORDINATOR_BIND` (host:port) when set; else, when `MESHFIT_COORDINATOR` is a loopback
address (as under `meshfit launch`), on that address only, with gloo's collectives on the loopback
too; else where JAX puts it: `$JAX_COORDINATOR_BIND_ADDRESS`, or every interface on the
coordinator's port. On a real cluster set it to the private interface, e.g. 10.0.0.1:1234.

In the job every process feeds its own rows of each global batch (`local_rows`, the rule), and
`barrier()` lines the processes up. A process that fails leaves at once (`exit_failed()`), so its
peers are not left waiting for it. Under `meshfit launch`, `join()` leaves a marker for the
launcher (meshfit.parallel.heartbeat), which then names a process that never arrived. What needs
Keras once the job runs (cutting fit's arguments to a process's rows, gathering predictions,
agreeing on the seed and on a stop) is meshfit.fit.hosts.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

from meshfit import env
from meshfit.parallel import heartbeat, jax_internals
from meshfit.errors import MeshfitError

# The rule of a user's own fit, evaluate and predict on several processes, for the lines that
# name its breach (meshfit.fit.hosts in the job, meshfit.launch.watchdog from outside).
AS_MANY_BATCHES = ("each process passes its own rows to fit, evaluate and predict, so as many "
                   "batches on every process, each of as many rows (np.array_split of a count "
                   "the processes do not divide, or a generator with a batch fewer on one, leaves "
                   "a process short), and a callback that stops training (model.stop_training = "
                   "True) stops it on every process; give every process as many samples")
SHUTDOWN_TIMEOUT_SECONDS = 300  # how long finished processes wait at exit for the slowest one
REACH_POLL_SECONDS = 0.05  # how often a process asks whether the coordinator listens yet


@dataclass(frozen=True)
class Job:
    """A multi-process job as the environment describes it.

    source: where it was found ("MESHFIT_* variables" or a JAX cluster name, e.g. "SlurmCluster").
    For a detected cluster, coordinator/process_id/local_device_ids stay None: JAX fills them in.
    """

    source: str
    num_processes: int
    coordinator: str | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None


def _seconds_env(name: str, default: int, environ) -> int:
    value = env.read_int(name, environ)
    if value is not None and value < 1:
        raise MeshfitError(f"{name} must be at least 1 second, got {value}")
    return default if value is None else value


def job_from_variables(environ=os.environ) -> Job | None:
    """The job that the MESHFIT_* variables describe; None when they describe no multi-process job."""
    coordinator = environ.get(env.COORDINATOR, "").strip()
    count = env.read_int(env.NUM_PROCESSES, environ)
    process_id = env.read_int(env.PROCESS_ID, environ)
    if not coordinator:
        if count is not None and count > 1:
            raise MeshfitError(f"{env.NUM_PROCESSES}={count} but {env.COORDINATOR} is not set; "
                               f"set it to host:port of process 0 on every process")
        return None
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise MeshfitError(f"{env.COORDINATOR}={coordinator!r} is not host:port; "
                           "set it to process 0's address and a free port, e.g. 10.0.0.1:1234")
    if count is None or process_id is None:
        missing = env.NUM_PROCESSES if count is None else env.PROCESS_ID
        raise MeshfitError(f"{env.COORDINATOR} is set but {missing} is not; set "
                           f"{env.NUM_PROCESSES} (processes in the job) and {env.PROCESS_ID} "
                           f"(0 .. {env.NUM_PROCESSES}-1) on every process")
    if count < 1 or process_id >= count:
        raise MeshfitError(f"{env.PROCESS_ID}={process_id} is not below {env.NUM_PROCESSES}={count}; "
                           f"number the processes 0 .. {max(count, 1) - 1}")
    ids = environ.get(env.LOCAL_DEVICE_IDS, "").strip()
    try:
        local_ids = tuple(int(i) for i in ids.split(",")) if ids else None
    except ValueError:
        raise MeshfitError(f"{env.LOCAL_DEVICE_IDS}={ids!r} is not a comma-separated list of "
                           "device numbers; set it to e.g. 0 or 0,1") from None
    if count == 1:
        return None
    return Job("MESHFIT_* variables", count, coordinator, process_id, local_ids)


def detected_cluster() -> Job | None:
    """A job of two or more processes found by JAX's own cluster detectors, else None.

    Uses the detectors `jax.distributed.initialize()` uses (Cloud TPU, SLURM, Open MPI,
    Kubernetes), skipping opt-in ones (mpi4py). Importing JAX starts no backend.
    """
    for kind in jax_internals.cluster_detectors():
        try:
            with warnings.catch_warnings():  # e.g. "Kubernetes detected but `kubernetes` missing"
                warnings.simplefilter("ignore")
                if not kind.is_env_present():
                    continue
                count = int(kind.get_process_count())
        except Exception as e:  # a half-configured environment: say so, run on this host
            warnings.warn(f"found a {kind.__name__} environment but could not read it ({e}); "
                          f"running as one process (set {env.COORDINATOR} etc. to join a job)")
            continue
        if count > 1:
            return Job(kind.__name__, count)
    return None


def describe_job(environ=os.environ) -> Job | None:
    """The multi-process job this process belongs to, or None for a single-process run."""
    if env.read_int(env.NUM_PROCESSES, environ) == 1:
        return None
    return job_from_variables(environ) or detected_cluster()


def jax_started() -> bool:
    """True once JAX has created its backends (device count and platform are then fixed)."""
    return jax_internals.backends_started()


def join(environ=os.environ) -> Job | None:
    """Join the job the environment describes (before JAX's backends start); None if there is none."""
    import jax

    if jax.distributed.is_initialized():
        return None  # the program joined the job itself
    job = describe_job(environ)
    if job is None:
        return None
    if jax_started():
        raise MeshfitError(f"cannot join the {job.num_processes}-process job ({job.source}): JAX "
                           "already started; call meshfit.connect() before anything else uses JAX")
    init_timeout = _seconds_env(env.INIT_TIMEOUT, 300, environ)
    heartbeat.joining(job.process_id)  # under meshfit launch: tells the launcher this one arrived
    if job.coordinator and job.process_id != 0 and not _reachable(job.coordinator, init_timeout):
        raise MeshfitError(
            f"cannot reach the coordinator {job.coordinator} within {init_timeout} s (this is process "
            f"{job.process_id} of {job.num_processes}); start process 0 with the same "
            f"{env.COORDINATOR}, check the address and firewall, or raise {env.INIT_TIMEOUT}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # collectives between CPU hosts
    jax_internals.cpp_stdout_off()  # gloo's "[Gloo] Rank i is connected..." lines: see there
    explicit = job.coordinator is not None  # else JAX reads the detected cluster's settings
    bind = bind_address(job.coordinator, environ)
    if job.coordinator and is_loopback(job.coordinator):
        jax_internals.gloo_on_loopback()  # gloo's collectives on the loopback too
    if explicit:  # JAX still asks its detectors for local device ids: in a Kubernetes pod without
        # jax[k8s] it would warn that joining needs that package, which this job does not
        warnings.filterwarnings("ignore", message="Kubernetes environment detected")
    try:
        jax.distributed.initialize(
            coordinator_address=job.coordinator, num_processes=job.num_processes if explicit else None,
            process_id=job.process_id,
            local_device_ids=list(job.local_device_ids) if job.local_device_ids else None,
            initialization_timeout=init_timeout,
            heartbeat_timeout_seconds=_seconds_env(env.HEARTBEAT_TIMEOUT, 60, environ),
            shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_SECONDS, coordinator_bind_address=bind)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = f" at {job.coordinator}" if explicit else ""
        raise MeshfitError(
            f"could not join the {job.num_processes}-process job ({job.source}){where}: {reason}; "
            f"start every process with the same coordinator and process count") from None
    sys.excepthook = functools.partial(_exit_after_traceback, sys.excepthook)
    return job


def is_loopback(address: str) -> bool:
    """True when host:port names this machine only (localhost, 127.x.x.x, ::1)."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_address(coordinator: str | None, environ=os.environ) -> str | None:
    """host:port process 0's coordinator listens on; None leaves it to JAX (every interface).

    MESHFIT_COORDINATOR_BIND when set; else a loopback coordinator address itself.
    """
    bind = environ.get(env.COORDINATOR_BIND, "").strip()
    if bind:
        host, _, port = bind.rpartition(":")
        if not host or not port.isdigit():
            raise MeshfitError(f"{env.COORDINATOR_BIND}={bind!r} is not host:port; set it to the "
                               "address process 0 listens on, e.g. 10.0.0.1:1234")
        return bind
    return coordinator if coordinator and is_loopback(coordinator) else None


def _reachable(address: str, timeout: float) -> bool:
    """True once a TCP connection to host:port succeeds, False after `timeout` seconds of trying.

    JAX aborts the whole process when it cannot reach the coordinator; this check comes first so
    that a wrong address or a missing process 0 is a one-line error instead.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            # Every 50 ms, not every second: process 0 opens its port a moment after the others
            # first ask (a refused connection returns at once), and the wait past that moment was
            # 1.0 s of every multi-process start-up, so of each elastic generation's recovery
            time.sleep(min(REACH_POLL_SECONDS, max(0.0, deadline - time.monotonic())))


def exit_failed(code: int, together: bool = False) -> None:
    """End this process at once with `code` if it is part of a multi-process job, else return.

    At a normal exit JAX waits (up to SHUTDOWN_TIMEOUT_SECONDS) until every process reaches its
    exit; a failed process must not, since the others may be waiting for it in a collective and
    both would hang. Leaving at once lets a launcher, or JAX's heartbeat check, stop the others.

    together: every process of the job leaves here with this code (a stop on a signal, agreed at
    one step): they first pass JAX's shutdown barrier. Process 0 hosts the coordination service,
    and a process still connected when it goes aborts (SIGABRT: "Terminating process because the
    JAX distributed service detected fatal errors"), as process 1 did whenever process 0 left
    first. The barrier is sufficient: no process leaves before all have disconnected, and process
    0 stops the service only after it (reproduction: benchmarks/coordinator_exit_order.py).
    """
    if "jax" not in sys.modules:
        return
    import jax

    if not jax.distributed.is_initialized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if together:
        try:
            jax.distributed.shutdown()
        except Exception as e:  # a peer gone meanwhile: leaving is all that is left to do
            print(f"meshfit: warning: leaving the job without its shutdown barrier ({e})",
                  file=sys.stderr, flush=True)
    os._exit(code)


def _exit_after_traceback(previous_hook, kind, value, traceback) -> None:
    previous_hook(kind, value, traceback)
    exit_failed(1)


def local_rows(samples: int, global_batch: int, devices: Sequence[Any], process_index: int):
    """Indices of the rows this process feeds: its devices' slices of every global batch.

    Global batch k is rows [k*B, (k+1)*B); device i of the data-parallel mesh takes slice i of B/D
    rows, and a process feeds the slices of its own devices, in mesh order (the order
    `jax.make_array_from_process_local_data` places them in). So all processes together feed
    exactly the batches one process would. A last partial batch is split the same way when it
    divides by the D devices; otherwise it is dropped with a warning.
    """
    import numpy as np

    mine = [i for i, d in enumerate(devices) if d.process_index == process_index]
    if global_batch % len(devices):
        raise MeshfitError(f"global batch {global_batch} does not split across {len(devices)} "
                           f"devices; use a multiple of {len(devices)}")
    full = samples // global_batch * global_batch
    rows = np.arange(full).reshape(-1, len(devices), global_batch // len(devices))[:, mine].ravel()
    tail = samples - full
    if tail % len(devices):
        warnings.warn(f"the last {tail} samples are left out: a batch of {tail} does not split "
                      f"across {len(devices)} devices on {len({d.process_index for d in devices})} hosts")
    elif tail:
        rows = np.concatenate([rows, full + np.arange(tail).reshape(len(devices), -1)[mine].ravel()])
    return rows


def multi_process() -> bool:
    """True in a process that joined a job of two or more processes."""
    if "jax" not in sys.modules:
        return False
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


def barrier(name: str) -> None:
    """Wait until every process of the job reaches the barrier `name` (no-op in a single process)."""
    if multi_process():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


