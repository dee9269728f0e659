"""XLA:CPU's kernel libraries on JAX against the TensorFlow engine, one CPU (issue 48, item 4).

For each recipe, each round runs `meshfit bench RECIPE --engines tensorflow` once and
`meshfit bench RECIPE --engines jax` once per XLA flag set below, in a shuffled order (XLA reads
its flags when a process starts, so each set needs its own process). Each JAX row is divided by
the TensorFlow row of its own round, and the table gives the median of those ratios over the
rounds (ms per step of meshfit's path: lower is faster). Run it on a quiet machine:

    python benchmarks/xla_cpu_kernels.py --rounds 3            # both recipes, about 40 minutes
    python benchmarks/xla_cpu_kernels.py --recipes fashion-mnist-cnn --rounds 2 --steps 3

BENCHMARKS.md section 2 has the result and the decision it supports (the one-CPU default engine).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

# What each set asks of XLA:CPU for convolutions and matmuls (jaxlib 0.12 names; 0.10 has them too).
FLAG_SETS = {
    "default (YNNPACK dots)": "",
    "Eigen only (YNNPACK off)": "--xla_cpu_experimental_ynn_fusion_type=",
    "YNNPACK dots and convolutions": "--xla_cpu_experimental_ynn_fusion_type=individual_dot,individual_convolution",
    "oneDNN matmuls and convolutions": "--xla_cpu_use_onednn=true --xla_cpu_experimental_ynn_fusion_type=",
    "XNNPACK fusions": "--xla_cpu_experimental_xnn_fusion_type=dot,eltwise,reduce "
                       "--xla_cpu_experimental_ynn_fusion_type=",
}
BATCHES = {"fashion-mnist-cnn": 1000, "cifar10-cnn": 256}  # the recipe's, and section 2's CIFAR-10 batch


def bench(recipe: str, engine: str, flags: str, steps: int, repeats: int) -> dict:
    """meshfit's row of one `meshfit bench` process: {'ms': ms per step, 'compile': s}."""
    env = dict(os.environ, XLA_FLAGS=flags)
    env.pop("KERAS_BACKEND", None)
    command = [sys.executable, "-m", "meshfit", "bench", recipe, "--engines", engine, "--json",
               "--global-batches", str(BATCHES[recipe]), "--steps", str(steps), "--repeats", str(repeats),
               "--out", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"xla-cpu-kernels-{os.getpid()}")]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (XLA_FLAGS={flags!r}):\n{out.stderr[-2000:]}")
    rows = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    row = next(r for r in rows if r["path"] == "meshfit")
    return {"ms": row["ms_per_step"], "compile": row["compile_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="fashion-mnist-cnn,cifar10-cnn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the shuffle of each round's order")
    args = parser.parse_args()
    shuffle = random.Random(args.seed)
    for recipe in args.recipes.split(","):
        ratios = {name: [] for name in FLAG_SETS}
        times = {name: [] for name in ["TensorFlow engine", *FLAG_SETS]}
        for round_ in range(args.rounds):
            runs = [("TensorFlow engine", "tensorflow", "")] + [(n, "jax", f) for n, f in FLAG_SETS.items()]
            shuffle.shuffle(runs)
            measured = {name: bench(recipe, engine, flags, args.steps, args.repeats)["ms"]
                        for name, engine, flags in runs}
            for name in FLAG_SETS:
                ratios[name].append(measured[name] / measured["TensorFlow engine"])
            for name, ms in measured.items():
                times[name].append(ms)
            print(f"{recipe} round {round_ + 1}: " + ", ".join(f"{n} {ms:.0f} ms" for n, ms in measured.items()),
                  flush=True)
        print(f"\n{recipe}, batch {BATCHES[recipe]}, {args.rounds} rounds (ms per step of meshfit's path; "
              "JAX / TensorFlow per round, median)")
        print(f"| {'engine and XLA flags':34s} | ms per step (rounds) | JAX / TensorFlow |")
        for name, values in times.items():
            ratio = f"{statistics.median(ratios[name]):.2f}x" if name in ratios else "1"
            print(f"| {name:34s} | {', '.join(f'{v:.0f}' for v in values)} | {ratio} |")


if __name__ == "__main__":
    main()
