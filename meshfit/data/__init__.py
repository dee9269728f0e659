"""A run's data: its train/validation/test splits (splits), the built-in datasets (datasets), batches
of in-memory arrays (arrays), image folders streamed from disk (folders), a recipe's own streams
(streams) and the rows of a batch (rows). Batch order and augmentation are a pure function of
seed, epoch and step. No module here imports Keras at its top: recipes load data before connect().
"""
