"""The global batch and the learning rate across device counts, with plain Keras `model.fit`.

Trains tutorial 1's Fashion-MNIST CNN (meshfit.recipes.fashion_mnist_cnn's model, Adam) under
`meshfit.connect()` on N devices with a global batch B and a learning rate LR, the way a user's
own script would, and prints one JSON line: devices, global and per-core batch, learning rate,
steps, test accuracy and loss. Run one process per setting (the device count is fixed when JAX
starts); docs/guides/batch-and-learning-rate.md gives the table it made (2026-11-25).

    python benchmarks/batch_and_lr.py --devices 8 --batch-size 1000 --lr 3e-3 --data-dir DATA
"""

import argparse
import json
import time

import meshfit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, required=True, help="simulated CPU devices")
    parser.add_argument("--batch-size", type=int, required=True, help="global batch")
    parser.add_argument("--lr", type=float, required=True, help="Adam's learning rate")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir")
    args = parser.parse_args()

    strategy = meshfit.connect(simulate=args.devices, engine="jax", verbose=False)
    import keras

    from meshfit.data import datasets
    from meshfit.recipes import fashion_mnist_cnn

    data = datasets.load("fashion_mnist", args.data_dir)
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = fashion_mnist_cnn.build_model()
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=args.lr),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    start = time.perf_counter()
    model.fit(data.x_train, data.y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=0)
    seconds = time.perf_counter() - start
    loss, accuracy = model.evaluate(data.x_test, data.y_test, batch_size=1000, verbose=0)
    steps = -(-len(data.x_train) // args.batch_size)
    print(json.dumps({
        "devices": strategy.replicas, "global_batch": args.batch_size,
        "per_core_batch": args.batch_size / strategy.replicas, "lr": args.lr,
        "epochs": args.epochs, "steps": steps * args.epochs, "seed": args.seed,
        "test_accuracy": round(float(accuracy), 4), "test_loss": round(float(loss), 4),
        "fit_seconds": round(seconds, 1), "jax": __import__("jax").__version__,
        "keras": keras.__version__, "meshfit": meshfit.__version__}), flush=True)


if __name__ == "__main__":
    main()
