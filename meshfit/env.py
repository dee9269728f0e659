"""The MESHFIT_* environment variables: every name in one place, and how their values are read.

  MESHFIT_ENGINE             Keras backend: auto, jax or tensorflow (like --engine)
  MESHFIT_SIMULATE_DEVICES   run on N JAX CPU devices standing in for accelerator cores
  MESHFIT_DATA               a folder searched for datasets (after --data-dir)
  MESHFIT_CACHE              where datasets are downloaded (default ~/.cache/meshfit/datasets)
  MESHFIT_OFFLINE            1: never download
  MESHFIT_COORDINATOR        host:port of process 0 of a multi-host job
  MESHFIT_COORDINATOR_BIND   host:port process 0's coordinator listens on (default: see meshfit.parallel.cluster)
  MESHFIT_NUM_PROCESSES      processes in the job (1 turns cluster detection off)
  MESHFIT_PROCESS_ID         this process's index, 0 .. MESHFIT_NUM_PROCESSES-1
  MESHFIT_LOCAL_DEVICE_IDS   the local devices this process uses, e.g. "0"
  MESHFIT_INIT_TIMEOUT       seconds to wait for every process to join (default 300)
  MESHFIT_HEARTBEAT_TIMEOUT  seconds of silence after which a process counts as dead (default 60)
  MESHFIT_STALL_TIMEOUT      seconds a training process may wait without progress (blocked in a
                             device computation, for input or on a checkpoint) before it ends with
                             one line and exit code 124 (meshfit.parallel.stall), and that
                             meshfit launch waits for progress in any process before it stops the
                             job (default 600; 0: never)
  MESHFIT_LAUNCH_STATUS      set by meshfit launch: the folder of its processes' status files
                             (meshfit.parallel.heartbeat)
  MESHFIT_LOCAL_COPIES       the host-local folder of the training state's local copies
                             (--local-copy-every; default $TMPDIR/meshfit-local-copies;
                             meshfit.run.local_copies)
  MESHFIT_GOODPUT            0: no goodput accounting in the training loop (meshfit.watch.goodput;
                             to measure what it costs)

`notebook()` says whether this process is a Jupyter kernel, which changes how bars are drawn and
what an error tells the user to do (restart the kernel rather than set a variable).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

from meshfit.errors import MeshfitError

ENGINE = "MESHFIT_ENGINE"
SIMULATE_DEVICES = "MESHFIT_SIMULATE_DEVICES"
DATA = "MESHFIT_DATA"
CACHE = "MESHFIT_CACHE"
OFFLINE = "MESHFIT_OFFLINE"
COORDINATOR = "MESHFIT_COORDINATOR"
COORDINATOR_BIND = "MESHFIT_COORDINATOR_BIND"
NUM_PROCESSES = "MESHFIT_NUM_PROCESSES"
PROCESS_ID = "MESHFIT_PROCESS_ID"
LOCAL_DEVICE_IDS = "MESHFIT_LOCAL_DEVICE_IDS"
INIT_TIMEOUT = "MESHFIT_INIT_TIMEOUT"
HEARTBEAT_TIMEOUT = "MESHFIT_HEARTBEAT_TIMEOUT"
STALL_TIMEOUT = "MESHFIT_STALL_TIMEOUT"
LAUNCH_STATUS = "MESHFIT_LAUNCH_STATUS"
GOODPUT = "MESHFIT_GOODPUT"
LOCAL_COPIES = "MESHFIT_LOCAL_COPIES"


def cache_home() -> str:
    """Where meshfit keeps what it measured or compiled between runs: $XDG_CACHE_HOME/meshfit
    (default ~/.cache/meshfit): JAX's compile cache (jax/), peak.json, flops.json."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "meshfit")


def read_int(name: str, environ: Mapping[str, str] = os.environ, example: int = 2) -> int | None:
    """The whole number in $name, None when unset or empty; anything else is a MeshfitError."""
    value = environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise MeshfitError(f"{name}={value!r} is not a whole number; set it to e.g. {example}")
    return int(value)


def is_set(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """True when $name holds a true value (not empty, 0, false or no)."""
    return environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def notebook() -> bool:
    """True inside a Jupyter kernel: ipykernel is imported and runs an IPython kernel."""
    if "ipykernel" not in sys.modules or "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None
