"""Does the goodput breakdown say where the time went? Checked against measurements of its own.

Runs `meshfit train` on a recipe file (synthetic 28x28 images, a small CNN, 2 simulated devices,
one epoch of 60 steps, checkpoints off) in these variants, interleaved over ROUNDS rounds so that
a loaded machine disturbs each alike, after one run that fills a JAX compilation cache of the
check's own (compiling varies by several seconds from run to run on a loaded machine: loaded
from the cache, it varies far less than the delays injected):

  plain       the baseline;
  checkpoint  --checkpoint-every 6 (10 saves of 20 MB): the checkpoint part should hold the extra wall time, and
              the train part stay as it was (the saves' wait for dispatched steps is training);
  input       every 4th training batch produced $GOODPUT_CHECK_INPUT s late (a sleep in the
              source, read in the training loop: nothing reads ahead; the steps still queued on the
              devices hide part of each delay): input wait should grow as the wall time does;
  eval        each validation pass $GOODPUT_CHECK_EVAL s late: eval should grow as the wall
              time does, by the delay.

Each run's wall time is measured outside the process (subprocess start to exit); its parts must
add up to it within 5% (what the ledger cannot see is the process's exit after metrics.json,
about 0.5 s: see docs/guides/goodput.md). Differences are of medians over the rounds, and pass within TOLERANCE of
the injected delay (for checkpoints, of the measured extra wall time, and at least 1 s; the train
part within 25% of the plain run's).

    python tools/goodput_check.py [ROUNDS]      (default 2; about 40 s a run on a loaded 2-core CPU)

Prints one line per run and one per check; exits 1 when a check fails.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
INPUT_DELAY = 0.6  # seconds before every 4th training batch: 15 of the 60, 9 s
EVAL_DELAY = 8.0  # seconds per validation pass (one epoch: one pass)
TOLERANCE = 0.4  # of the injected delay
STEPS = 60

RECIPE = f'''"""goodput-check: bright or dark 28x28 images from generator functions, delays injected
by $GOODPUT_CHECK_INPUT (seconds before every 4th training batch) and $GOODPUT_CHECK_EVAL (seconds
before each validation pass but the first, which meshfit reads when it loads the data)."""
import os
import time

import numpy as np

import meshfit

BATCH, STEPS = 64, {STEPS}
INPUT = float(os.environ.get("GOODPUT_CHECK_INPUT", "0"))
EVAL = float(os.environ.get("GOODPUT_CHECK_EVAL", "0"))
_validation_passes = [0]


def images(seed, n):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    x = np.clip(70 + 110 * labels[:, None, None, None] + rng.normal(0, 30, (n, 28, 28, 1)), 0, 255)
    return x.astype("uint8"), labels.astype("int32")


def dataset(seed):
    x, y = images(seed, BATCH * STEPS)
    vx, vy = images(seed + 1, 4 * BATCH)

    def train(epoch):
        for i in range(STEPS):
            if i % 4 == 3:
                time.sleep(INPUT)
            yield x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]

    def validation():
        if _validation_passes[0]:
            time.sleep(EVAL)
        _validation_passes[0] += 1
        for i in range(0, len(vx), BATCH):
            yield vx[i:i + BATCH], vy[i:i + BATCH]

    return {{"train": train, "validation": validation, "class_names": ["dark", "bright"]}}


def build_model(input_shape, num_classes):
    import keras

    return keras.Sequential([
        keras.Input(input_shape), keras.layers.Rescaling(1 / 255),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Flatten(), keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(num_classes, activation="softmax")])


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.Adam(1e-3)


RECIPE = meshfit.Recipe(name="goodput-check", dataset=dataset, build_model=build_model,
                        optimizer=optimizer, epochs=1, steps_per_epoch=STEPS)
'''

VARIANTS = {
    "plain": ([], {}),
    "checkpoint": (["--checkpoint-every", "6"], {}),
    "input": ([], {"GOODPUT_CHECK_INPUT": str(INPUT_DELAY)}),
    "eval": ([], {"GOODPUT_CHECK_EVAL": str(EVAL_DELAY)}),
}


def train(folder: str, variant: str) -> dict:
    """One run of `variant`: its goodput parts and the wall time measured outside it."""
    flags, changes = VARIANTS[variant]
    run = os.path.join(folder, f"run-{variant}")
    shutil.rmtree(run, ignore_errors=True)
    command = [sys.executable, "-m", "meshfit", "train", os.path.join(folder, "recipe.py"),
               "--simulate-devices", "2", "--out", run, "--seed", "1", "--no-tensorboard",
               "--checkpoint-every", "off", *flags]
    started = time.time()
    done = subprocess.run(command, env={**os.environ, **changes}, capture_output=True, text=True)
    outside = time.time() - started
    if done.returncode:
        sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
    spent = json.load(open(os.path.join(run, "metrics.json")))["goodput"]
    shutil.rmtree(run)
    return {"outside": outside, "wall": spent["wall_seconds"], **spent["seconds"]}


def main() -> int:
    folder = tempfile.mkdtemp(prefix="goodput-check-")
    with open(os.path.join(folder, "recipe.py"), "w") as f:
        f.write(RECIPE)
    runs = {variant: [] for variant in VARIANTS}
    failures = []
    os.environ.update({"JAX_COMPILATION_CACHE_DIR": os.path.join(folder, "jax-cache"),
                       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    try:
        for variant in ("plain", "checkpoint"):  # the cache filled, not counted
            train(folder, variant)
        for r in range(ROUNDS):
            for variant in VARIANTS:
                row = train(folder, variant)
                runs[variant].append(row)
                share = row["wall"] / row["outside"]
                parts = " ".join(f"{k} {row[k]:.2f}" for k in ("startup", "setup", "compile", "train",
                                                               "input_wait", "eval", "checkpoint", "other"))
                print(f"round {r} {variant:<10} outside {row['outside']:6.2f} s, parts add to "
                      f"{row['wall']:6.2f} s ({share:.1%}) | {parts}", flush=True)
                if abs(1 - share) > 0.05:
                    failures.append(f"round {r} {variant}: parts {row['wall']:.2f} s vs outside "
                                    f"{row['outside']:.2f} s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    def median(variant, key):
        return statistics.median(row[key] for row in runs[variant])

    def check(name, measured, expected, tolerance):
        ok = abs(measured - expected) <= tolerance
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {measured:+.2f} s, expected {expected:+.2f} "
              f"+- {tolerance:.2f} s")
        if not ok:
            failures.append(name)

    for variant, part, injected in (("input", "input_wait", INPUT_DELAY * (STEPS // 4)),
                                    ("eval", "eval", EVAL_DELAY)):
        slower = median(variant, "outside") - median("plain", "outside")
        grew = median(variant, part) - median("plain", part)
        print(f"     {variant}: {injected:.2f} s injected, the wall time grew by {slower:+.2f} s")
        check(f"{variant}: {part} grew as the wall time did", grew, slower, TOLERANCE * injected)
        if variant == "eval":  # a late input batch is partly hidden by the steps still queued
            # on the devices (JAX dispatches ahead), so only the wall time measures what it cost;
            # nothing overlaps an evaluation pass
            check(f"{variant}: {part} grew by the injected delay", grew, injected, TOLERANCE * injected)
    extra = median("checkpoint", "outside") - median("plain", "outside")
    check("checkpoint: the checkpoint part is the extra wall time",
          median("checkpoint", "checkpoint"), extra, max(TOLERANCE * abs(extra), 1.0))
    trained = median("plain", "train")
    check("checkpoint: the train part stays as it was",
          median("checkpoint", "train") - trained, 0.0, max(0.25 * trained, 1.0))
    print("all checks passed" if not failures else "failed: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
