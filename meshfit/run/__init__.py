"""One training run, from settings to results: its settings (options), the run (train), its
durable record in config.json (spec), the run directory (rundir), checkpoints and exact resume
(checkpoints; device arrays sharded through orbax-checkpoint in sharded_arrays), meshfit's
callbacks, scoring (evaluate), the files of a finished run (results), and models rebuilt from a
run's recipe (models).
"""
