"""One training run, from settings to results: its settings (options), the run before the engine
is chosen (train) and after it (fitting: build, restore, fit, score, write), its durable record in
config.json (spec), the run directory (rundir), checkpoints and exact resume (checkpoints, the
callback; a checkpoint's files: checkpoint_format; written: checkpoint_save; loaded into a model:
checkpoint_restore; device arrays sharded through orbax-checkpoint in sharded_arrays), meshfit's
callbacks, scores (scores) and `meshfit eval` (evaluate), the files of a finished run (results),
and loading models, rebuilt from a run's recipe where they need it (models).
"""

from meshfit.parallel import engine as _engine


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
