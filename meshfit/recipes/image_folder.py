"""image-folder: an image classifier for a folder with one sub-folder of images per class.

What `meshfit train --data FOLDER --image-size H W` trains, with no code: the folder is streamed
from disk batch by batch (meshfit.data.folders), a share of it is held out for validation (or its
train/ and test/ or val/ sub-folders are used as given), precision and batch are planned for the
devices. Models, from scratch (no weight downloads):
  cnn               images up to 64 pixels a side: Conv(32) -> MaxPool -> Conv(64) -> MaxPool ->
                    Flatten -> Dropout .3 -> Dense(classes)
  mobilenetv3small  larger images: keras.applications.MobileNetV3Small
  efficientnetb0    keras.applications.EfficientNetB0 (slower, more accurate on large folders)
Adam at 1e-3. `meshfit train --data` writes the recipe it trains into the run directory
(recipe.py), a file to start a recipe of one's own from.
Measured: see BENCHMARKS.md ("Image folders").
"""

from __future__ import annotations

import json
import os

from meshfit import Recipe
from meshfit.data.folder_scan import check_folder  # noqa: F401 (--data FOLDER checked before connecting)
from meshfit.errors import MeshfitError

MODELS = ("cnn", "mobilenetv3small", "efficientnetb0")
SMALL_IMAGE = 64  # pixels: images up to this size a side get the small CNN by default
DEFAULT_EPOCHS = 10


def default_model(image_size: tuple[int, int]) -> str:
    """The small CNN for small images, MobileNetV3Small for larger ones."""
    return "cnn" if max(image_size) <= SMALL_IMAGE else "mobilenetv3small"


GREY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F")  # Pillow modes without colour


def guess_channels(folder: str, sample: int = 32) -> int:
    """1 when the first `sample` images found under `folder` are all grey, else 3 (RGB)."""
    from PIL import Image

    modes = []
    for root, folders, files in os.walk(folder):
        folders.sort()
        for name in sorted(files)[:sample - len(modes)]:
            try:
                with Image.open(os.path.join(root, name)) as image:
                    modes.append(image.mode)
            except Exception:  # not an image: the data loader skips or reports it
                continue
        if len(modes) >= sample:
            break
    return 1 if modes and set(modes) <= set(GREY_MODES) else 3


def build_cnn(input_shape, num_classes=10):
    import keras
    from keras import layers

    # Unpadded, the two 3x3 convolutions and 2x2 poolings leave nothing of an image under 10
    # pixels a side (Keras' error at the build: 8x8 digits, --image-size 8 8); such an image is
    # padded instead, so every size trains (1x1 included).
    padding = "same" if min(input_shape[:2]) < 10 else "valid"
    return keras.Sequential([
        keras.Input(input_shape),
        layers.Rescaling(1 / 255),
        layers.Conv2D(32, 3, activation="relu", padding=padding),
        layers.MaxPooling2D(padding=padding),
        layers.Conv2D(64, 3, activation="relu", padding=padding),
        layers.MaxPooling2D(padding=padding),
        layers.Flatten(),
        layers.Dropout(0.3),
        layers.Dense(num_classes),
        layers.Activation("softmax", dtype="float32"),
    ], name="image_folder_cnn")


def build_application(name: str):
    """A builder for keras.applications model `name`, from scratch, taking 0-255 pixels."""
    def build(input_shape, num_classes=10):
        import keras

        if name == "mobilenetv3small":
            return keras.applications.MobileNetV3Small(
                input_shape=input_shape, weights=None, classes=num_classes,
                include_preprocessing=True)
        return keras.applications.EfficientNetB0(input_shape=input_shape, weights=None,
                                                 classes=num_classes)
    return build


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.Adam(learning_rate=1e-3)


def recipe(folder: str, image_size: tuple[int, int], *, channels: int = 3, model: str | None = None,
           epochs: int = DEFAULT_EPOCHS, validation_split: float | None = None,
           steps_per_epoch: int | None = None, name: str = "image-folder") -> Recipe:
    """The recipe for `folder` at image_size (height, width) pixels (see the module docstring);
    validation_split None: the folder default (meshfit.data.splits.default_validation_split)."""
    height, width = (int(s) for s in image_size)
    if height < 1 or width < 1:
        raise MeshfitError(f"--image-size needs two positive pixel counts, got {height} {width}")
    model = (model or default_model((height, width))).lower()
    if model not in MODELS:
        raise MeshfitError(f"unknown model {model!r}; choose one of: {', '.join(MODELS)}")
    if model != "cnn" and min(height, width) < 32:
        raise MeshfitError(f"{model} needs images of at least 32x32 pixels; use --model cnn or a "
                           "larger --image-size")
    build = build_cnn if model == "cnn" else build_application(model)
    return Recipe(name=name, dataset=folder, build_model=build, optimizer=optimizer, epochs=epochs,
                  steps_per_epoch=steps_per_epoch, image_size=(height, width), channels=channels,
                  validation_split=validation_split, doc=__doc__)


def recipe_file_text(command: str, folder: str, image_size: tuple[int, int], **options) -> str:
    """The text of a recipe file equal to recipe(folder, image_size, **options)."""
    arguments = "".join(f", {key}={value!r}" for key, value in options.items() if value is not None)
    return (f'"""Written by `{command}`.\n\nThe recipe trained in this run directory; copy and edit '
            f'it to make it your own:\nmeshfit train this_file.py\n"""\n\n'
            f"from meshfit.recipes import image_folder\n\n"
            f"RECIPE = image_folder.recipe({json.dumps(folder)}, {tuple(image_size)!r}{arguments})\n")
