"""`meshfit bench`: timing tools, each measurement in a fresh process.

step.py (train-step time per engine, path, precision, batch and steps per dispatch: plain Keras
against meshfit; its worker chooses the engine, then keras_side/timing.py times it), inputs.py
(the input pipeline alone on an image folder, against Keras' image_dataset_from_directory),
table.py (the results as a table, bench.csv, bench.json and bench.png), jpeg_folder.py (the JPEG
test folder of `--make-jpeg-folder`), worker.py (how a measurement runs in its own process and
hands its rows back) and command.py (the command's flags and what each runs).
"""

from meshfit.parallel import engine as _engine


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
