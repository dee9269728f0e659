"""Model outputs over a run's evaluation batches, every sample exactly once: the batches of
meshfit.data (padded to one shape), the padding dropped, optionally averaged over views of each
image (test-time augmentation: its mirror image, translations); on several hosts gathered on
every process (meshfit.fit.hosts).
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from meshfit.data.arrays import EvalBatches, tta_views
from meshfit.fit import hosts
from meshfit.parallel import cluster
from meshfit.watch import progress


def predict(model, data, global_batch: int | None = None, tta_flip: bool = False,
            advance: Callable[[float], None] | None = None, tta_translate: int = 0) -> np.ndarray:
    """Model outputs for every sample (N rows) of `data`: an arrays.EvalBatches (or any object
    with its iterate, trim and len, such as folders.FolderEvalBatches), or images with
    `global_batch`.

    tta_flip: average the outputs for each image and its mirror image (for a model whose outputs
    are probabilities, the average probabilities); tta_translate: also for its translations by
    that many pixels (see meshfit.data.arrays.tta_views).
    advance: called with 1 as each batch is taken (a meshfit.watch.progress.task bar's).
    """
    batches = data if hasattr(data, "iterate") else EvalBatches(data, global_batch)

    def each(flip: bool = False):
        if advance is None:
            return batches.iterate(flip=flip)
        return progress.counted(batches.iterate(flip=flip), advance)

    views = tta_views(tta_flip, tta_translate)
    outputs = []
    for flip, shift, _ in views:
        # A translated view is mirrored after its translation, as airbench takes it.
        images = each(flip) if not shift else (tuple(_translated(x, shift, flip) for x in batch)
                                              for batch in each())
        outputs.append(np.asarray(_predict(model, images, steps=len(batches))))
    if len(views) > 1:
        outputs = [sum(weight * out for (_, _, weight), out in zip(views, outputs))]
    return batches.trim(outputs[0])


def _translated(images, shift: int, flip: bool = False):
    """Images (N, H, W, C) moved `shift` pixels down and right (up and left when negative), the
    uncovered border filled by reflection (a crop of the reflect-padded images, as airbench's
    multi-crop takes it), then mirrored left-right if `flip`. Device arrays (EvalBatches on the
    device) stay on their devices."""
    if not isinstance(images, np.ndarray):
        return _translate_on_device()(images, shift, flip)
    return np.ascontiguousarray(_view(np, images, shift, flip))


def _view(xp, images, shift: int, flip: bool):
    """_translated's crop with the array module `xp` (NumPy, or jax.numpy under jit)."""
    pad = abs(shift)
    start = pad - shift  # crop start in the padded image: 0 moves content down-right by `pad`
    padded = xp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="reflect")
    view = padded[:, start:start + images.shape[1], start:start + images.shape[2]]
    return view[:, :, ::-1] if flip else view


@functools.cache
def _translate_on_device():
    """_translated for JAX arrays, compiled (jax imported here: the TensorFlow engine's arrays
    are NumPy's, and it need not load JAX)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(functools.partial(_view, jnp), static_argnums=(1, 2))


def _predict(model, batches, steps: int):
    """`model.predict` over `steps` batches; on several hosts hosts.predict_across_hosts, since
    Keras' own predict cannot gather the outputs of a multi-host mesh."""
    if cluster.multi_process():
        return hosts.predict_across_hosts(model, batches)
    return model.predict(batches, steps=steps, verbose=0)
