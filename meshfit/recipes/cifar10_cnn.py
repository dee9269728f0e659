"""cifar10-cnn: tutorial 2's CNN on CIFAR-10, its exact model, per-core batch 128, 50 epochs.

Model: BatchNorm -> 2x Conv(32, 3x3, same, relu) -> MaxPool -> Dropout .25 -> BatchNorm ->
Conv(64, 3x3, same, relu) -> Conv(64, 3x3, valid, relu) -> MaxPool -> Dropout .25 -> Flatten ->
Dense(512, relu) -> Dropout .5 -> Dense(10, softmax). Adam 1e-3.
Batch: 128 per core, so 1024 on a TPU v2-8 as in the tutorial (`--global-batch 1024` gives the
tutorial's global batch on any machine). Pixels are scaled to [0, 1] inside the model.
Tutorial: 90.06% train / 80.79% test after 50 epochs, ~6 s/epoch (~300 s) on a TPU v2-8.
Measured on a 2-vCPU Intel Xeon (AMX), Keras on TensorFlow, float32, batch 128: 82.21% test
accuracy after 50 epochs, 2,893 s of training (1 run). On one H100/H200: target 80.8% in <= 15 s.
Measured on one H100, JAX, bfloat16, batch 128 (BENCHMARKS.md section 5): 80.8% test accuracy
first after 6.4 s (epoch 18); 81.38% after 50 epochs, 15.7 s of training (1 run).
"""

from meshfit import Recipe


def build_model(input_shape=(32, 32, 3), num_classes=10):
    import keras
    from keras import layers

    return keras.Sequential([
        keras.Input(input_shape),
        layers.Rescaling(1 / 255),
        layers.BatchNormalization(),
        layers.Conv2D(32, (3, 3), padding="same", activation="relu"),
        layers.Conv2D(32, (3, 3), padding="same", activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Dropout(0.25),
        layers.BatchNormalization(),
        layers.Conv2D(64, (3, 3), padding="same", activation="relu"),
        layers.Conv2D(64, (3, 3), padding="valid", activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Dropout(0.25),
        layers.Flatten(),
        layers.Dense(512, activation="relu"),
        layers.Dropout(0.5),
        layers.Dense(num_classes),
        layers.Activation("softmax", dtype="float32"),
    ], name="cifar10_cnn")


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.Adam(learning_rate=1e-3)


RECIPE = Recipe(
    name="cifar10-cnn",
    dataset="cifar10",
    build_model=build_model,
    optimizer=optimizer,
    epochs=50,
    per_core_batch=128,
    doc=__doc__,
)
