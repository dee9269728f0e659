"""A run's data: its train/validation/test splits (splits), the built-in datasets (datasets), batches
of in-memory arrays (arrays), image folders streamed from disk (folders) and a recipe's own streams
(streams). Batch order and augmentation are a pure function of seed, epoch and step.
"""
