"""The divergence guard of meshfit's training runs: weights holding NaN or inf are never saved.

A run whose loss diverged goes on training NaN weights to the end, and its checkpoints, saved
every 60 s and each epoch, would replace the good ones it keeps (the newest 3) within minutes:
the work before the divergence lost. So before each save, and once training ends, one
computation asks whether every trainable variable is finite; if one is not, the run stops with
TrainingDiverged, its committed checkpoints as they were. Trainable variables only: a NaN
gradient reaches them at the step it appears (the optimizer's slots and batch statistics follow
them), while a non-trainable one may hold an infinity by design (a running minimum starting at
inf). A mixed-float16 run's loss scaling skips the steps whose gradients overflow, so its weights
stay finite and it is never stopped for them.

This module imports Keras at the top: import it after `meshfit.connect()`.
"""

from __future__ import annotations

import keras
import numpy as np

from meshfit.errors import TrainingDiverged
from meshfit.run import rundir


def _finite_flags(values: list) -> object:
    """One boolean per value: all its elements finite."""
    return keras.ops.stack([keras.ops.all(keras.ops.isfinite(v)) for v in values])


if keras.backend.backend() == "jax":
    import jax

    # One compiled program over every variable (one dispatch; on several processes a collective
    # whose answer every process holds whole), not a dispatch and a fetch per variable.
    _finite_flags = jax.jit(_finite_flags)


def non_finite(model) -> str | None:
    """The path of the first trainable floating variable holding NaN or inf, else None. On
    several processes every process calls it at the same point."""
    variables = [v for v in model.trainable_variables if "float" in str(v.dtype)]
    if not variables:
        return None
    flags = np.asarray(keras.ops.convert_to_numpy(_finite_flags([v.value for v in variables])))
    bad = np.flatnonzero(~flags)
    return variables[bad[0]].path if len(bad) else None


def check(model, global_step: int, steps_per_epoch: int, checkpoints: str,
          writer: bool = True) -> None:
    """Raise TrainingDiverged when the model's weights are not finite after `global_step`;
    checkpoints: the run's checkpoint folder, whose newest committed checkpoint the line names
    on the process that writes them (`writer`; the others may not see that folder)."""
    path = non_finite(model)
    if path is None:
        return
    epoch = global_step // steps_per_epoch + (1 if global_step % steps_per_epoch else 0)
    saved = rundir.list_checkpoints(checkpoints) if writer else []
    if not writer:
        kept = "the run's committed checkpoints are kept, nothing after them was saved"
    elif saved:
        kept = f"the checkpoints up to {saved[-1]} are kept, nothing after them was saved"
    else:
        kept = "no checkpoint of it was saved"
    raise TrainingDiverged(
        f"training diverged: {path} holds NaN or inf after step {global_step} (epoch {epoch}); "
        f"{kept}; lower the learning rate, or look for NaN or inf in the data, and train again",
        global_step, path)
