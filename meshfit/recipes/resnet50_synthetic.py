"""resnet50-synthetic: ResNet-50 on random 224x224 images, for train-step throughput.

Model: `keras.applications.ResNet50(weights=None)`, 1000 classes, behind a float32 normalization
by the ImageNet mean/std (raw 0-255 pixels in) and ahead of a float32 softmax. Keras' ResNet-50 is
v1 (a block's stride is in its first 1x1 conv); MLPerf's v1.5 strides in the 3x3 conv, which
costs more FLOPs per image: compare samples/s with MLPerf figures with that in mind.
Data: the "synthetic" dataset, random uint8 images and random labels. Convention for synthetic
datasets: the image shape is `RECIPE.input_shape` and the number of classes is the model's output
width, `model.output_shape[-1]` (1000 here: `build_model` defaults to NUM_CLASSES).
Training: SGD with momentum 0.9 at learning rate 0.1, per-core batch 256, mixed bfloat16, no
schedule (the labels are random: this recipe measures speed, not accuracy); 1 epoch of 100 steps.
Use: `meshfit bench resnet50-synthetic` (train-step time, samples/s and MFU).
Target: >= 5,000 img/s on one H100. Measured there (BENCHMARKS.md section 5): 5,278 img/s, MFU
11.9%, median of 3 runs; plain Keras 5,327 img/s. Not yet measured on a TPU.
"""

from meshfit import Recipe

INPUT_SHAPE = (224, 224, 3)
NUM_CLASSES = 1000
IMAGENET_MEAN = (123.675, 116.28, 103.53)  # 0-255 pixel units, per RGB channel
IMAGENET_STD = (58.395, 57.12, 57.375)


def build_model(input_shape=INPUT_SHAPE, num_classes=NUM_CLASSES):
    """Keras' ResNet-50 with random weights, taking raw pixels and giving probabilities."""
    import keras
    import numpy as np
    from keras import layers

    inputs = keras.Input(input_shape)
    x = layers.Normalization(mean=IMAGENET_MEAN, variance=np.square(IMAGENET_STD),
                             dtype="float32")(inputs)
    resnet = keras.applications.ResNet50(weights=None, input_tensor=x, classes=num_classes,
                                         classifier_activation=None)
    outputs = layers.Activation("softmax", dtype="float32")(resnet.output)
    return keras.Model(inputs, outputs, name="resnet50_synthetic")


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)


RECIPE = Recipe(
    name="resnet50-synthetic",
    dataset="synthetic",
    build_model=build_model,
    optimizer=optimizer,
    epochs=1,
    steps_per_epoch=100,
    per_core_batch=256,
    precision="bfloat16",
    input_shape=INPUT_SHAPE,
    doc=__doc__,
)
