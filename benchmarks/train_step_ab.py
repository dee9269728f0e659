"""Same-process A/B of two ways to run one recipe's TensorFlow train step on the CPU.

  --compare bias-gradient   TF's conv bias gradient (which oneDNN fuses with the conv's filter
                            gradient) against meshfit's split one (`meshfit.fit.tf_bias_gradient`);
  --compare micro-batches   whole batches against meshfit's cache-sized micro-batches
                            (`meshfit.fit.tf_microbatch`; both with meshfit's bias gradient).

Two copies of the recipe's model train in one process on the same random data, fed by meshfit's
input path. Their epochs alternate, so a change in the machine's speed hits both. Each epoch is
timed from the end of its first step to the end of its last, which leaves out the pauses Keras/TF
take around each `fit` call; it prints wall and CPU milliseconds per step for each and the median
per-round ratio (A's time / B's time).

    python benchmarks/train_step_ab.py --compare micro-batches [--recipe fashion-mnist-cnn]
        [--precision float32] [--rounds 5] [--steps 60]

Results on a 2-vCPU Xeon (AMX), 2026-11-22: BENCHMARKS.md ("Tutorial recipes" notes).
"""

import argparse
import statistics
import time

import numpy as np

import meshfit
from meshfit.data import arrays
from meshfit import recipes


def random_data(name: str, steps: int):
    """(recipe, global batch, input shape, images, labels): `steps` batches of random uint8
    images and 10-class labels shaped for the recipe."""
    recipe = recipes.get(name)
    batch = recipe.global_batch or recipe.per_core_batch
    shape = recipes.input_shape(recipe)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (steps * batch, *shape), dtype=np.uint8)
    y = rng.integers(0, 10, steps * batch).astype(np.int32)
    return recipe, batch, shape, x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=("bias-gradient", "micro-batches"), default="bias-gradient")
    parser.add_argument("--recipe", default="fashion-mnist-cnn")
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="steps per timed epoch (at least 2)")
    args = parser.parse_args()

    strategy = meshfit.connect(engine="tensorflow", precision=args.precision, verbose=False)
    import keras
    from tensorflow.python.framework import ops

    from meshfit.fit import tf_bias_gradient, tf_microbatch  # imports Keras: after connect()

    recipe, batch, shape, x, y = random_data(args.recipe, args.steps)
    entry = ops._gradient_registry._registry["BiasAdd"]
    if args.compare == "bias-gradient":  # (gradient, slices) of A and B
        variants = {"tensorflow gradient": (tf_bias_gradient.tensorflow_bias_gradient, 1),
                    "meshfit gradient": (tf_bias_gradient.conv_bias_gradient, 1)}
    else:
        variants = {"whole batches": (tf_bias_gradient.conv_bias_gradient, 1),
                    "micro-batches": (tf_bias_gradient.conv_bias_gradient, None)}
    models = {}
    for name, (gradient, slices) in variants.items():
        entry["type"] = gradient  # read when the train step is traced, in the warm-up fit below
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = recipe.build_model(shape, 10)
            model.compile(optimizer=recipe.optimizer(args.steps, args.rounds + 1),
                          loss=recipe.make_loss(), metrics=["accuracy"])
        slices = tf_microbatch.cache_sized(model, batch) if slices is None else slices
        tf_microbatch.install(model, slices)
        batches = arrays.TrainBatches(x, y, batch, seed=0)
        model.fit(batches.iterate(0), steps_per_epoch=args.steps, epochs=1, verbose=0)
        models[f"{name} ({slices} x {batch // slices})"] = (model, batches)
    entry["type"] = tf_bias_gradient.conv_bias_gradient

    class StepClock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.times = []

        def on_train_batch_end(self, batch, logs=None):  # (makes Keras finish each step)
            self.times.append((time.perf_counter(), time.process_time()))

    wall = {name: [] for name in models}
    cpu = {name: [] for name in models}
    clock = StepClock()
    for r in range(args.rounds):
        for name, (model, batches) in models.items():
            model.fit(batches.iterate(r + 1), steps_per_epoch=args.steps, epochs=1, verbose=0,
                      callbacks=[clock])
            (first_wall, first_cpu), (last_wall, last_cpu) = clock.times[0], clock.times[-1]
            wall[name].append(1000 * (last_wall - first_wall) / (args.steps - 1))
            cpu[name].append(1000 * (last_cpu - first_cpu) / (args.steps - 1))
    for name in models:
        print(f"{name:>28}: wall ms/step {' '.join(f'{v:.1f}' for v in wall[name])}; "
              f"CPU ms/step median {statistics.median(cpu[name]):.1f}")
    a, b = models
    ratios = [ta / tb for ta, tb in zip(wall[a], wall[b])]
    print(f"{args.recipe} {args.precision} batch {batch}: time per step, {a} / {b}, "
          f"median of {args.rounds} rounds: {statistics.median(ratios):.3f}x")


if __name__ == "__main__":
    main()
