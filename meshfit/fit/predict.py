"""Model outputs over a run's evaluation batches, every sample exactly once: the batches of
meshfit.data (padded to one shape), the padding dropped, optionally averaged with the mirror
images' outputs; on several hosts gathered on every process (meshfit.fit.hosts).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from meshfit.data.arrays import EvalBatches
from meshfit.fit import hosts
from meshfit.parallel import cluster
from meshfit.watch import progress


def predict(model, data, global_batch: int | None = None, tta_flip: bool = False,
            advance: Callable[[float], None] | None = None) -> np.ndarray:
    """Model outputs for every sample (N rows) of `data`: an arrays.EvalBatches (or any object
    with its iterate, trim and len, such as folders.FolderEvalBatches), or images with
    `global_batch`.

    tta_flip: average the outputs for each image and its mirror image (for a model whose outputs
    are probabilities, the average probabilities).
    advance: called with 1 as each batch is taken (a meshfit.watch.progress.task bar's).
    """
    batches = data if hasattr(data, "iterate") else EvalBatches(data, global_batch)

    def each(flip: bool = False):
        if advance is None:
            return batches.iterate(flip=flip)
        return progress.counted(batches.iterate(flip=flip), advance)

    outputs = _predict(model, each(), steps=len(batches))
    if tta_flip:
        mirrored = _predict(model, each(flip=True), steps=len(batches))
        outputs = (outputs + mirrored) / 2
    return batches.trim(np.asarray(outputs))


def _predict(model, batches, steps: int):
    """`model.predict` over `steps` batches; on several hosts hosts.predict_across_hosts, since
    Keras' own predict cannot gather the outputs of a multi-host mesh."""
    if cluster.multi_process():
        return hosts.predict_across_hosts(model, batches)
    return model.predict(batches, steps=steps, verbose=0)
