"""The Keras side of `meshfit bench`: the timing of a train step (timing), imported by the
worker process (step.measure) only once it has chosen the engine.

The folder is the engine line (tests/test_imports.py): each module here imports Keras at its top,
and no module of commands/ outside it does.
"""

from meshfit.parallel import engine as _engine


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
