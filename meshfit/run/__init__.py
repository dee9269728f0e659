"""One training run, from settings to results: its settings (options), the run before the engine
is chosen (train), its durable record in config.json (spec), the run directory (rundir), a
checkpoint's files, read back without Keras (checkpoint_format), its device arrays sharded through
orbax-checkpoint (sharded_arrays), `meshfit eval` (evaluate), the files of a finished run
(results), and loading models, rebuilt from a run's recipe where they need it (models).

The run after the engine is chosen lives in keras_side/, imported after connect(): the model
built, restored, fit, scored and written (fitting, fit_and_score, scores), meshfit's callbacks,
and checkpoints and exact resume (checkpoints, the callback; checkpoint_save; checkpoint_restore).
"""

from meshfit.parallel import engine as _engine


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
