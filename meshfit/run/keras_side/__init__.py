"""The Keras side of run/: a run's steps after `meshfit.connect()` has chosen the engine, imported
only then (run.train.keras_side()). The model built, restored and announced (fitting), its fit
with the run's callbacks, then the score and the files written (fit_and_score), scores (scores),
a recipe's callbacks through resume (callbacks), and checkpoints: the callback that saves during
fit and stops on a signal (checkpoints), one written and committed (checkpoint_save), one loaded
into a model (checkpoint_restore).

The folder is the engine line (tests/test_imports.py): each module here imports Keras at its top,
and no module of run/ outside it does.
"""

from meshfit.parallel import engine as _engine


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
