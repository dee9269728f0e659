"""Where a recipe's TensorFlow train step spends its time on the CPU: a per-op profile.

Builds the recipe's model as meshfit trains it on the TensorFlow engine (its split conv bias
gradient and cache-sized micro-batches), trains a warm-up epoch on random data, then records
`--steps` steps with TensorFlow's profiler and sums the time of each kind of op over every thread
(XPlane events of the host plane), per step. BENCHMARKS.md section 1 sets the conv and matmul
kinds' time against the step's FLOP count and the CPU's probed matmul peak (meshfit.watch.peak).

    python benchmarks/step_profile.py [--recipe fashion-mnist-cnn] [--steps 10] [--top 15]

Results: BENCHMARKS.md section 1 (the profile row).
"""

import argparse
import collections
import glob
import os
import re
import tempfile
import time

import meshfit
from meshfit.data import arrays
from train_step_ab import random_data  # this folder's: the same random data as the A/B


def op_seconds(logdir: str) -> tuple[dict[str, float], float]:
    """({op kind: seconds summed over threads}, seconds the trace spans) from the XPlane file
    TensorFlow's profiler wrote under `logdir`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    (path,) = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    totals: dict[str, float] = collections.Counter()
    first, last = None, None
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        names = {i: m.name for i, m in plane.event_metadata.items()}
        for line in plane.lines:
            # TF's kernels are events named "op/name:OpType"; the runtime's own ("Class::Method",
            # "EagerLocalExecute: X") and zero-length markers are left out, and so is an op that
            # encloses others on its thread (a while loop, a function call).
            events = sorted((e for e in line.events if e.duration_ps > 0
                             and re.fullmatch(r"[^\s:]+:[A-Za-z_]\w*", names.get(e.metadata_id, ""))),
                            key=lambda e: e.offset_ps)
            for i, event in enumerate(events):
                end = event.offset_ps + event.duration_ps
                if i + 1 < len(events) and events[i + 1].offset_ps < end:
                    continue
                kind = names[event.metadata_id].rsplit(":", 1)[1]
                totals[kind] += event.duration_ps * 1e-12
                start = line.timestamp_ns * 1e-9 + event.offset_ps * 1e-12
                first = start if first is None else min(first, start)
                last = max(last or 0, start + event.duration_ps * 1e-12)
    return dict(totals), (last - first) if first is not None else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="fashion-mnist-cnn")
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    strategy = meshfit.connect(engine="tensorflow", precision=args.precision, verbose=False)
    import tensorflow as tf

    from meshfit.fit import tf_microbatch  # imports Keras: after connect()

    recipe, batch, shape, x, y = random_data(args.recipe, args.steps)
    with strategy.scope():
        model = recipe.build_model(shape, 10)
        model.compile(optimizer=recipe.optimizer(args.steps, 2), loss=recipe.make_loss(),
                      metrics=["accuracy"])
    slices = tf_microbatch.cache_sized(model, batch)
    tf_microbatch.install(model, slices)
    batches = arrays.TrainBatches(x, y, batch, seed=0)
    model.fit(batches.iterate(0), steps_per_epoch=args.steps, epochs=1, verbose=0)  # traced, warm

    logdir = tempfile.mkdtemp(prefix="meshfit-profile-")
    tf.profiler.experimental.start(logdir)
    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(batches.iterate(1), steps_per_epoch=args.steps, epochs=1, verbose=0)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tf.profiler.experimental.stop()
    totals, _ = op_seconds(logdir)
    busy = sum(totals.values())
    print(f"{args.recipe} {args.precision}, batch {batch} in {slices} micro-batches, "
          f"{args.steps} steps profiled: wall {1000 * wall / args.steps:.1f} ms/step, "
          f"CPU {1000 * cpu / args.steps:.1f} ms/step, ops {1000 * busy / args.steps:.1f} "
          f"thread-ms/step (ops overlap on {os.cpu_count()} cores)")
    print(f"{'op':<34}{'ms/step':>9}{'share':>8}")
    for kind, seconds in sorted(totals.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{kind:<34}{1000 * seconds / args.steps:>9.2f}{seconds / busy:>8.1%}")


if __name__ == "__main__":
    main()
