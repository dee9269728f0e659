"""What a run shows while and after it trains: the per-epoch report (throughput, MFU), progress
bars, TensorBoard logs, profiles, and pictures for notebooks (figures).
"""
