"""Can the accelerator's start overlap Keras' import? Wall seconds of a fresh process's start-up,
JAX's backend started (jax.devices(): CUDA's start on a GPU) before Keras' import, or beside it
in a thread; and its exit (the interpreter's teardown with the backend started: the main job's
`exit` part was 1.07 s on an H200 against about 0.3 s on a CPU).

Each run is a fresh process: `import jax`, then either jax.devices() and `import keras` one after
the other ("serial"), or jax.devices() in a thread while the main thread imports Keras
("overlapped"); Keras' import leaves out what meshfit's command line leaves out
(meshfit.parallel.engine.KERAS_EXTRAS). The modes alternate; prints each part's median. Worth
doing in meshfit only where "overlapped" is clearly below "serial", which needs the backend's
start to release Python's GIL.

Usage: python benchmarks/start_overlap.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from main_job import environment  # this checkout first on PYTHONPATH (benchmarks/ is sys.path[0])

PROGRAM = """
import json, sys, threading, time
start = time.perf_counter()
import jax
from meshfit.parallel import engine
imported_jax = time.perf_counter()
with engine.imports_skipped(engine.KERAS_EXTRAS):
    if sys.argv[1] == "serial":
        jax.devices()
        started = time.perf_counter()
        import keras
    else:
        thread = threading.Thread(target=jax.devices)
        thread.start()
        import keras
        thread.join()
        started = None
done = time.perf_counter()
print(json.dumps({"jax import": imported_jax - start, "backend start": started and started - imported_jax,
                  "after jax's import": done - imported_jax, "total": done - start,
                  "devices": str(jax.devices()), "end": time.time()}), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    env = {**environment(), "KERAS_BACKEND": "jax"}
    results = {"serial": [], "overlapped": []}
    for _ in range(args.runs):
        for mode in results:
            done = subprocess.run([sys.executable, "-c", PROGRAM, mode], env=env, capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                sys.exit(f"{mode} run failed:\n{done.stderr[-3000:]}")
            ended = time.time()
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result["exit"] = ended - result.pop("end")  # the program's last line to its exit
            results[mode].append(result)
    print(f"devices: {results['serial'][0]['devices']}; {args.runs} runs each, medians (s)")
    for mode, runs in results.items():
        parts = {key: statistics.median(r[key] for r in runs) for key in runs[0]
                 if key != "devices" and runs[0][key] is not None}
        print(f"{mode:10s} " + "  ".join(f"{key} {value:.2f}" for key, value in parts.items()))


if __name__ == "__main__":
    main()
