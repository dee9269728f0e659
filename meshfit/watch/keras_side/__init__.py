"""The Keras side of watch/: the Keras callbacks that show a run, imported only once
`meshfit.connect()` has chosen the engine. The epoch report (report: samples/s, MFU, the XLA FLOP
count, the discovery text), the bar of fit (progress_bar), TensorBoard logs (tensorboard) and
profiles (profiling).

The folder is the engine line (tests/test_imports.py): each module here imports Keras at its top,
and no module of watch/ outside it does.
"""

from meshfit.parallel import engine as _engine


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
