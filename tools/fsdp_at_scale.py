"""Issue 23's checks at full size: a model too big for data parallelism under --device-memory.

    python tools/fsdp_at_scale.py [--data-dir ../shared/data] [--work DIR]

A recipe file (an MLP on Fashion-MNIST whose weights + Adam state are about 70 MB, gradients
another 23 MB) on 8 simulated CPU devices with `--device-memory 64MB`:

  refused         `--sharding data` is one line about memory, exit 2
  auto is fsdp    the default trains it with fsdp and config.json records "sharding": "fsdp"
  exact resume    fsdp, SIGKILLed after its epoch-1 checkpoint, `--resume` on 8 devices ends with
                  the weights of the uninterrupted run, bit for bit
  4 devices       the same killed run resumed with `--simulate-devices 4`: test accuracy within 1
                  point of the uninterrupted run's
  2 processes     `meshfit launch --processes 2 --devices-per-process 4` trains it (fsdp), and its
                  checkpoint holds shards written by both processes

Prints a line per check and exits 1 when one fails. Takes about 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = '''"""An MLP of 5.8 M parameters: 23 MB of weights, 70 MB with Adam's two moments."""
import keras
import meshfit


def build_model(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Rescaling(1 / 255),
                             keras.layers.Flatten(), keras.layers.Dense(4096, activation="relu"),
                             keras.layers.Dense(640, activation="relu"),
                             keras.layers.Dense(num_classes, activation="softmax")])


RECIPE = meshfit.Recipe(name="wide-mlp", dataset="fashion_mnist", build_model=build_model,
                        optimizer=lambda steps_per_epoch, epochs: keras.optimizers.Adam(1e-4),
                        epochs=2, global_batch=512)
'''
EIGHT = ["--simulate-devices", "8", "--engine", "jax", "--device-memory", "64MB", "--no-tensorboard"]


def meshfit(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python -m meshfit ARGS` with its output captured."""
    return subprocess.run([sys.executable, "-m", "meshfit", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def weights(run: str) -> list[np.ndarray]:
    import keras

    return keras.saving.load_model(os.path.join(run, "model.keras"), compile=False).get_weights()


def recorded(run: str, name: str, key: str):
    """`key` of the run's `name` (config.json, metrics.json); None when the file is missing."""
    try:
        with open(os.path.join(run, name)) as f:
            return json.load(f).get(key)
    except FileNotFoundError:
        return None


def until_checkpoint_then_kill(command: list[str], run: str) -> None:
    """Start `command`, SIGKILL it once its first checkpoint is committed."""
    from meshfit.run import checkpoint_format

    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                           start_new_session=True)
    while checkpoint_format.latest(os.path.join(run, "checkpoints")) is None and job.poll() is None:
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "..", "shared", "data"))
    parser.add_argument("--work", help="where the runs go (default: a temporary folder, removed)")
    args = parser.parse_args()
    from meshfit.parallel import engine

    engine.activate("jax")  # this process reads checkpoints and models with Keras as meshfit imports it
    work = args.work or tempfile.mkdtemp(prefix="fsdp-at-scale-")
    recipe = os.path.join(work, "wide_mlp.py")
    os.makedirs(work, exist_ok=True)
    with open(recipe, "w") as f:
        f.write(RECIPE)
    data = ["--data-dir", os.path.abspath(args.data_dir)]
    failures = 0

    def report(name: str, ok: bool, detail: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{name:14s} {'ok' if ok else 'FAILED'}  {detail}", flush=True)

    out = meshfit("train", recipe, *EIGHT, *data, "--sharding", "data", "--out", f"{work}/refused")
    lines = out.stderr.strip().splitlines()
    report("refused", out.returncode == 2 and len(lines) == 1 and "out of device memory" in out.stderr,
           f"exit {out.returncode}: {out.stderr.strip()[-300:]}")

    whole = f"{work}/whole"
    out = meshfit("train", recipe, *EIGHT, *data, "--out", whole, "--checkpoint-every", "epoch")
    sharding = recorded(whole, "config.json", "sharding")
    report("auto is fsdp", sharding == "fsdp",
           f"exit {out.returncode}, sharding {sharding}" + ("" if out.returncode == 0 else out.stderr[-2000:]))

    killed = f"{work}/killed"
    until_checkpoint_then_kill([sys.executable, "-m", "meshfit", "train", recipe, *EIGHT, *data,
                                "--sharding", "fsdp", "--out", killed, "--checkpoint-every", "epoch"],
                               killed)
    shutil.copytree(killed, f"{killed}-4")
    out = meshfit("train", "--resume", killed, *EIGHT)
    same = out.returncode == 0 and all(np.array_equal(a, b) for a, b in zip(weights(killed), weights(whole),
                                                                             strict=True))
    report("exact resume", same, f"exit {out.returncode}" + ("" if out.returncode == 0 else out.stderr[-2000:]))

    out = meshfit("train", "--resume", f"{killed}-4", *EIGHT[:1], "4", *EIGHT[2:])
    gap = abs(recorded(f"{killed}-4", "metrics.json", "test_accuracy")
              - recorded(whole, "metrics.json", "test_accuracy")) if out.returncode == 0 else float("nan")
    report("4 devices", gap <= 0.01, f"exit {out.returncode}, accuracy {100 * gap:.2f} points from the "
           "uninterrupted run's" + ("" if out.returncode == 0 else out.stderr[-2000:]))

    launched = f"{work}/launched"
    out = meshfit("launch", "--processes", "2", "--devices-per-process", "4", "--", "meshfit", "train",
                  recipe, *EIGHT[2:], *data, "--out", launched, "--checkpoint-every", "epoch")
    from meshfit.run import checkpoint_format

    final = checkpoint_format.latest(os.path.join(launched, "checkpoints")) if out.returncode == 0 else None
    writers = sorted(d for d in os.listdir(os.path.join(final, "arrays")) if d.startswith("ocdbt.process_")) \
        if final else []
    sharding = recorded(launched, "config.json", "sharding")
    report("2 processes", sharding == "fsdp" and writers == ["ocdbt.process_0", "ocdbt.process_1"],
           f"exit {out.returncode}, sharding {sharding}, shards by {writers}"
           + ("" if out.returncode == 0 else out.stderr[-2000:]))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{5 - failures} of 5 checks passed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
