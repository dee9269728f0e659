"""What cutting a stream's short last batch costs on 8 simulated devices (meshfit.fit.sources).

1. The extra compilation. The Fashion-MNIST CNN trains 2 epochs on 1,003 random images from a
   keras.utils.PyDataset in batches of 64; the last batch (43) is cut to 40, a shape of its own.
   Every step is timed to the end of its work on the devices. The short step's first run (epoch
   1) includes its compilation, its second (epoch 2) does not: the difference is what padding to
   the full batch would save, once per `fit`. Each round builds a fresh model (fresh compiles).
2. The wrapper's own time per batch: the same PyDataset read through Keras' adapter alone and
   through meshfit.fit.sources.SplitBatches, alternating; the median per-round ratio.

    python benchmarks/last_batch.py [--rounds 3]

Results: BENCHMARKS.md, section 3 (Input).
"""

import argparse
import statistics
import time

import numpy as np

import meshfit

SAMPLES, BATCH = 1003, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    strategy = meshfit.connect(simulate_devices=8, engine="jax", verbose=False)
    import keras
    from keras.src.trainers import data_adapters

    from meshfit.watch.keras_side import report
    from meshfit.fit import sources
    from meshfit.recipes import fashion_mnist_cnn

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (SAMPLES, 28, 28, 1), dtype=np.uint8)
    y = rng.integers(0, 10, SAMPLES).astype(np.int32)

    class Images(keras.utils.PyDataset):
        def __init__(self, batches=None):
            super().__init__()
            self.batches = batches or -(-SAMPLES // BATCH)

        def __len__(self):
            return self.batches

        def __getitem__(self, i):
            i %= -(-SAMPLES // BATCH)
            return x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]

    class StepTimes(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.seconds = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            report.wait_for_device(self.model)
            self.seconds.append(time.perf_counter() - self.start)

    compiles, epochs, short, full = [], [], [], []
    steps = -(-SAMPLES // BATCH)
    for _ in range(args.rounds):
        with strategy.scope():
            model = fashion_mnist_cnn.build_model()
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        timer = StepTimes()
        strategy.fit(model, Images(), epochs=2, shuffle=False, report=False, callbacks=[timer])
        first, second = timer.seconds[:steps], timer.seconds[steps:]
        compiles.append(first[-1] - second[-1])
        epochs.append(sum(second))
        short.append(second[-1])
        full.append(statistics.median(second[1:-1]))
    print(f"short-batch compile: {statistics.median(compiles):.3f} s (rounds: "
          f"{', '.join(f'{c:.3f}' for c in compiles)}); epoch 2 without compiles: "
          f"{statistics.median(epochs):.3f} s; steps of 64: {1000 * statistics.median(full):.1f} ms, "
          f"the cut step of 40: {1000 * statistics.median(short):.1f} ms")

    def read(adapter) -> float:
        start = time.perf_counter()
        for _ in adapter.get_jax_iterator():
            pass
        return time.perf_counter() - start

    many = Images(batches=2000)
    ratios, plain, wrapped = [], [], []
    for _ in range(args.rounds):
        a = read(data_adapters.get_data_adapter(many, shuffle=False))
        b = read(sources.SplitBatches(many, strategy.replicas))
        plain.append(a / many.batches)
        wrapped.append(b / many.batches)
        ratios.append(b / a)
    print(f"reading a batch: Keras' adapter {1e6 * statistics.median(plain):.1f} us, through "
          f"SplitBatches {1e6 * statistics.median(wrapped):.1f} us; ratio {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
