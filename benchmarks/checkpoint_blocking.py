"""How long training is blocked per checkpoint: asynchronous (orbax, written in the background)
against synchronous saves, on a model with >= 100 MB of state (weights + Adam's two moments).

    python benchmarks/checkpoint_blocking.py [--devices 8] [--width 2048] [--layers 3] [--runs 5]
                                             [--sharding fsdp] [--dir DIR]

Builds an MLP of `layers` Dense(width, width) layers under meshfit.connect(simulate_devices=devices,
engine="jax", sharding=...), trains it one step (so the optimizer state exists), then saves it
`runs` times each way, alternating (async, sync, npz, npz, sync, async, ...) after one untimed
save of each: "async" is orbax in the background (format 3, what training does on JAX), "sync"
the same files written before returning, "npz" the format before orbax (every array gathered to
process 0 into arrays.npz, format 2). "blocked" is the time until `checkpoint_save.begin_save` returns
(training could go on from then), "committed" until its manifest is written. Prints one line per save and the medians, in seconds. Numbers for
BENCHMARKS.md section 2b.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--runs", type=int, default=5, help="saves of each kind (default 5)")
    parser.add_argument("--sharding", default="fsdp", choices=["data", "fsdp"])
    parser.add_argument("--dir", help="where to write (default: a temporary folder, removed)")
    args = parser.parse_args()

    import meshfit

    strategy = meshfit.connect(simulate_devices=args.devices, engine="jax", sharding=args.sharding,
                               verbose=False)
    import keras
    import numpy as np

    from meshfit.run.keras_side import checkpoint_save

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((args.width,)),
                                  *[keras.layers.Dense(args.width, activation="relu")
                                    for _ in range(args.layers)], keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    batch = 8 * args.devices
    model.fit(rng.normal(size=(batch, args.width)).astype("float32"), rng.integers(0, 10, batch),
              batch_size=batch, epochs=1, verbose=0)
    state = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                for v in model.variables + model.optimizer.variables)
    print(f"model: {args.layers} x Dense({args.width}) + Adam, state {state / 1e6:.1f} MB, "
          f"{args.devices} device(s), sharding {args.sharding}", flush=True)
    root = args.dir or tempfile.mkdtemp(prefix="meshfit-ckpt-bench-")
    modes = ("async", "sync", "npz")
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    order = list(modes)  # untimed: the first save of each kind compiles and allocates
    for i in range(args.runs):
        order += modes if i % 2 == 0 else modes[::-1]
    try:
        for step, mode in enumerate(order, 1):
            started = time.perf_counter()
            pending = checkpoint_save.begin_save(root, model, epoch=0, step=step, steps_per_epoch=10 ** 6,
                                                 keep=2, background=mode == "async",
                                                 sharded=mode != "npz")
            blocked = time.perf_counter() - started
            pending.result()
            committed = time.perf_counter() - started
            if step > len(modes):
                times[mode].append((blocked, committed))
            print(f"{mode:5s}  blocked {blocked:.3f} s  committed {committed:.3f} s"
                  f"{'' if step > len(modes) else '  (untimed)'}", flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    medians = {mode: (statistics.median(b for b, _ in t), statistics.median(c for _, c in t))
               for mode, t in times.items()}
    for mode, (blocked, committed) in medians.items():
        print(f"median {mode:5s}  blocked {blocked:.3f} s  committed {committed:.3f} s")
    print(f"async blocks {medians['async'][0] / medians['sync'][0]:.1%} of sync, "
          f"{medians['async'][0] / medians['npz'][0]:.1%} of npz")


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
