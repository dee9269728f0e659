"""Memory of a streamed image folder: resident size after each epoch, with or without training.

Without --fit: pulls --epochs epochs of FolderTrainBatches(folder, 160x160, RGB, batch 128,
flip-crop) from iterate() and prints the resident size (psutil) after each. With --fit ENGINE:
trains one epoch of a small CNN (Conv2D 8, global pooling, Dense) with Strategy.fit on those
batches. Run it under `/usr/bin/time -v` for the peak (threads only: the process is the tree).

    /usr/bin/time -v python benchmarks/input_memory.py FOLDER [--epochs 2] [--fit tensorflow|jax]
"""

from __future__ import annotations

import argparse
import time

SIZE, BATCH = (160, 160), 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--fit", choices=("tensorflow", "jax"))
    args = parser.parse_args()
    if args.fit:
        import meshfit

        strategy = meshfit.connect(engine=args.fit, verbose=False)
    import psutil

    from meshfit.data import folder_scan, folders

    batches = folders.FolderTrainBatches(folder_scan.scan(args.folder), SIZE, 3, BATCH,
                                             augment="flip-crop")
    if args.fit:
        import keras

        with strategy.scope():
            model = keras.Sequential([keras.Input((*SIZE, 3)), keras.layers.Rescaling(1 / 255),
                                      keras.layers.Conv2D(8, 3, strides=4, activation="relu"),
                                      keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
            model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            start = time.perf_counter()
            strategy.fit(model, batches.iterate(0), epochs=1, steps_per_epoch=len(batches), report=False)
        print(f"{args.fit}: one epoch of {len(batches)} steps in {time.perf_counter() - start:.1f} s, "
              f"RSS {psutil.Process().memory_info().rss / 2**20:,.0f} MB")
        return
    stream = batches.iterate()
    for epoch in range(args.epochs):
        start = time.perf_counter()
        for _ in range(len(batches)):
            next(stream)
        print(f"epoch {epoch}: {len(batches) * BATCH / (time.perf_counter() - start):,.0f} images/s, "
              f"RSS {psutil.Process().memory_info().rss / 2**20:,.0f} MB", flush=True)


if __name__ == "__main__":
    main()
