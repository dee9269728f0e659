"""What a run shows while and after it trains: progress bars for long work (progress), pictures
for notebooks (figures), the ledger of where wall time goes (goodput), the peak FLOP/s behind MFU
(peak) and the figures kept between runs (kept), all before the engine is chosen; and in
keras_side/, the Keras callbacks, imported after connect(): the per-epoch report (throughput,
MFU), the bar of fit, TensorBoard logs and profiles.
"""

from meshfit.parallel import engine as _engine


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
