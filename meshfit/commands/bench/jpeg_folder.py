"""`meshfit bench --make-jpeg-folder DIR`: CIFAR-10 images as a folder of JPEGs, the test folder
of the input benchmark (meshfit.commands.bench.inputs)."""

from __future__ import annotations

import os

from meshfit.data import datasets, image_files
from meshfit.errors import MeshfitError

JPEG_FOLDER_IMAGES = 30_000  # images in `meshfit bench --make-jpeg-folder`'s folder
JPEG_QUALITY = 90


def write_jpeg_folder(dest: str, data_dir: str | None = None, count: int = JPEG_FOLDER_IMAGES,
                      image_size: tuple[int, int] = (160, 160)) -> int:
    """Write the first `count` CIFAR-10 training images, upscaled (bilinear) to image_size =
    (height, width) pixels, as JPEGs (quality 90) in dest/<class name>/<index>.jpg; returns the
    count.

    CIFAR-10 is read as `meshfit train` reads it (data_dir, $MESHFIT_DATA, ...; no download).
    """
    import concurrent.futures

    from PIL import Image

    if os.path.isdir(dest) and os.listdir(dest):
        raise MeshfitError(f"{dest} is not empty; give a new folder for the JPEGs")
    data = datasets.load("cifar10", data_dir, download=False)
    count = min(count, len(data.x_train))
    if count < 1:
        raise MeshfitError(f"the JPEG folder needs at least 1 image, got {count}")
    height, width = image_files.check_image_size(image_size, 3)
    for name in data.class_names:
        os.makedirs(os.path.join(dest, name), exist_ok=True)

    def write(i: int) -> None:
        image = Image.fromarray(data.x_train[i]).resize((width, height), Image.Resampling.BILINEAR)
        image.save(os.path.join(dest, data.class_names[data.y_train[i]], f"{i:05d}.jpg"),
                   quality=JPEG_QUALITY)

    with concurrent.futures.ThreadPoolExecutor(image_files.default_workers()) as pool:
        list(pool.map(write, range(count), chunksize=256))
    return count
