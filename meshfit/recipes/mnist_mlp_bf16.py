"""mnist-mlp-bf16: tutorial 3's MLP on MNIST in mixed bfloat16 precision.

Model: Flatten -> Dense(512, relu) -> Dropout .2 -> Dense(10) -> softmax (float32 output).
Precision: mixed bfloat16 (bfloat16 compute, float32 variables) on every platform.
Budget: Adam 1e-3, global batch 128, 10 epochs. Pixels scaled to [0, 1] inside the model.
Target: >= 98% test accuracy.
Measured on a 2-vCPU Intel Xeon (AMX), Keras on TensorFlow: 98.12% test accuracy in 26.9 s of
training (1 run). Command and date: BENCHMARKS.md.
"""

from meshfit import Recipe


def build_model(input_shape=(28, 28, 1), num_classes=10):
    import keras
    from keras import layers

    return keras.Sequential([
        keras.Input(input_shape),
        layers.Rescaling(1 / 255),
        layers.Flatten(),
        layers.Dense(512, activation="relu"),
        layers.Dropout(0.2),
        layers.Dense(num_classes),
        layers.Activation("softmax", dtype="float32"),
    ], name="mnist_mlp_bf16")


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.Adam(learning_rate=1e-3)


RECIPE = Recipe(
    name="mnist-mlp-bf16",
    dataset="mnist",
    build_model=build_model,
    optimizer=optimizer,
    epochs=10,
    global_batch=128,
    precision="bfloat16",
    doc=__doc__,
)
