"""Same-process A/B: a model with Keras' augmentation layers inside, compiled by meshfit
(`meshfit.fit.declined_jit`) against op by op, as Keras runs it (`jit_compile=False`).

Keras' RandomRotation and RandomZoom set `supports_jit = False`, so Keras trains such a model op
by op on JAX; meshfit compiles it. Two copies of one small CNN (RandomFlip, RandomRotation(0.1),
RandomZoom(0.1), Conv2D(16, 3), pooling, Dense(10)) on random 32x32x3 images train in turn on the
same devices, after one warm-up epoch each; each round times one epoch of each, and the script
prints each side's seconds per epoch, the losses (equal: the same draws), and the median per-round
ratio (op by op / compiled).

    python benchmarks/declined_jit.py [--devices 8] [--rounds 3] [--steps 16]

Results: BENCHMARKS.md, section 2 ("Models Keras runs op by op").
"""

import argparse
import statistics
import time

import numpy as np

import meshfit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="steps per epoch, batch 32")
    args = parser.parse_args()
    strategy = meshfit.connect(simulate_devices=args.devices, engine="jax", verbose=False)
    import keras
    from keras import layers

    rng = np.random.default_rng(0)
    x = rng.random((32 * args.steps, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, len(x))
    models = {}
    for side, jit_compile in (("compiled", "auto"), ("op by op", False)):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((32, 32, 3)), layers.RandomFlip(),
                                      layers.RandomRotation(0.1), layers.RandomZoom(0.1),
                                      layers.Conv2D(16, 3), layers.GlobalAveragePooling2D(),
                                      layers.Dense(10)])
            model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          jit_compile=jit_compile)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # compiles (op by op: each op's program)
        models[side] = model
    seconds = {side: [] for side in models}
    losses = {side: [] for side in models}
    for _ in range(args.rounds):
        for side, model in models.items():
            start = time.perf_counter()
            history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
            seconds[side].append(time.perf_counter() - start)
            losses[side].append(history.history["loss"][0])
    for side in models:
        print(f"{side:9s} s/epoch {', '.join(f'{s:.2f}' for s in seconds[side])} "
              f"(median {statistics.median(seconds[side]):.2f}); losses "
              f"{', '.join(f'{v:.6f}' for v in losses[side])}")
    ratios = [slow / fast for slow, fast in zip(seconds["op by op"], seconds["compiled"])]
    print(f"op by op / compiled per round: {', '.join(f'{r:.1f}' for r in ratios)}; median "
          f"{statistics.median(ratios):.1f}x on {args.devices} devices")


if __name__ == "__main__":
    main()
