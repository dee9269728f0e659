"""What a run shows while and after it trains: the per-epoch report (throughput, MFU), progress
bars, TensorBoard logs, profiles, and pictures for notebooks (figures). progress and figures run
before the engine is chosen; report, progress_bar, tensorboard and profiling are Keras callbacks
and import Keras at their top.
"""
