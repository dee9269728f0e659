"""What a JAX job of several CPU processes repeats at every start on every process but 0: the
reproduction of docs/reference/jax-multiprocess-start.md (plain JAX, no Keras, no meshfit).

    python benchmarks/jax_multiprocess_start.py [--variables 40]

starts 2 processes of 4 CPU devices each (jax.distributed on 127.0.0.1) twice, with one
persistent compilation cache (min compile time 0), and prints, per process and start, the
persistent cache's hits and misses of a few eager operations on the process's own device, and
the seconds of `--variables` device_put calls of a host array onto a sharding over all 8 devices
against the same arrays placed with jax.make_array_from_callback. On the second start, process 0
finds its programs in the cache, process 1 compiles its own again (JAX writes the cache from
process 0 only, and on CPUs a program's key holds its device); each device_put of host data runs
multihost_utils.assert_equal, an all-gather compiled and run per call.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import json, os, sys, time
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

pid, port, cache, count = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
seen = {"hits": 0, "asked": 0}  # programs found in the persistent cache, and looked up there
def event(name, **kwargs):
    if name == "/jax/compilation_cache/cache_hits":
        seen["hits"] += 1
    elif name == "/jax/compilation_cache/compile_requests_use_cache":
        seen["asked"] += 1
jax.monitoring.register_event_listener(event)
jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid)
import jax.numpy as jnp
x = jnp.arange(16.0)                          # eager operations on this process's own device
y = (x * 2.0 + 1.0).sum() / jnp.sqrt(x + 1.0).max()
y.block_until_ready()
eager = dict(seen)
mesh = Mesh(np.array(jax.devices()), ("batch",))
everywhere = NamedSharding(mesh, PartitionSpec())
arrays = [np.full((64, 64), float(i), np.float32) for i in range(count)]
began = time.perf_counter()
for a in arrays:
    jax.device_put(a, everywhere).block_until_ready()
put = time.perf_counter() - began
began = time.perf_counter()
for a in arrays:
    jax.make_array_from_callback(a.shape, everywhere, a.__getitem__).block_until_ready()
callback = time.perf_counter() - began
print(json.dumps({"process": pid, "eager_hits": eager["hits"], "eager_misses": eager["asked"] - eager["hits"],
                  "device_put_s": round(put, 3), "make_array_from_callback_s": round(callback, 3)}),
      flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variables", type=int, default=40)
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="jax-cache-")
    environment = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                   "JAX_PLATFORMS": "cpu"}
    print(f"jax {__import__('jax').__version__}, cache {cache}", flush=True)
    for start in (1, 2):
        port = str(free_port())
        workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), port, cache, str(args.variables)],
                                    env=environment, stdout=subprocess.PIPE, text=True)
                   for i in (0, 1)]
        for w in workers:
            out, _ = w.communicate(timeout=600)
            for line in out.splitlines():
                if line.startswith("{"):
                    print(f"start {start}: {json.dumps(json.loads(line))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
