"""A run's data: its train/validation/test splits (splits), the built-in datasets (datasets; their
canonical files read and written: file_formats; their arrays kept unpacked: unpacked), batches of
in-memory arrays (arrays), image folders (their files and classes: folder_scan; an image file
decoded: image_files; batches streamed from disk: folders), a recipe's own streams (streams) and
the rows of a batch (rows).
Batch order and augmentation are a pure function of seed, epoch and step. No module here imports
Keras at its top: recipes load data before connect().
"""

from meshfit.parallel import engine as _engine

FOLDER_VALIDATION_SPLIT = 0.2  # share of a folder's images held out when its recipe sets none


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
