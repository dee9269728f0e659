"""What a run shows while and after it trains: the per-epoch report (throughput, MFU), progress
bars, TensorBoard logs, profiles, and pictures for notebooks (figures). progress and figures run
before the engine is chosen; report, progress_bar, tensorboard and profiling are Keras callbacks
and import Keras at their top.
"""

from meshfit.parallel import engine as _engine


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
