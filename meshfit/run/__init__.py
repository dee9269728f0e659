"""One training run, from settings to results: the run (train), its durable record in config.json
(spec), the run directory (rundir), checkpoints and exact resume, meshfit's callbacks, and models
rebuilt from a run's recipe (models).
"""
