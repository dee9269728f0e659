"""TensorFlow: one train step's gradient summed over cache-sized slices of its batch (CPU); and
how many slices a model trains in on either engine (plan_micro_batches, check; the JAX step is
meshfit.fit.jax_microbatch).

On a CPU a train step over a large batch is bound by memory traffic, not arithmetic: at batch
1000 the tutorial Fashion-MNIST CNN's conv output is 173 MB, and every op around it (bias, pool,
ReLU and their gradients) streams it through DRAM. Cut into 20 slices of 50, whose largest
activation (8.7 MB) stays in cache, the step ran 1.59x and the whole tutorial run 1.35x as fast
on a 2-vCPU Xeon (BENCHMARKS.md). Each slice's loss is weighted by its share of the batch, so the
summed gradient is the whole batch's gradient (up to float rounding) and the optimizer still takes
one step per batch: the run is the same run.

Models with layers that mix samples inside a batch (batch normalization) keep whole batches,
because slicing would change what those layers compute. So do models with their own train_step,
and, by default (see cache_sized), models computing in 16-bit floats.
"""

from __future__ import annotations

import math
import warnings

import keras
import numpy as np

from meshfit.errors import MeshfitError
from meshfit.fit import keras_internals
from meshfit.parallel import planning

ACTIVATION_BUDGET_BYTES = 16 * 2**20  # largest activation of one slice; measured, see cache_sized()
MIN_SLICE = 32  # smaller slices are slower again (25-sample slices: ~80 against 61-74 ms/step)
_BATCH_COUPLED = ("BatchNormalization", "SyncBatchNormalization")


def batch_coupled_layers(model) -> list[str]:
    """Names of the layers whose output for one sample depends on the others in its batch."""
    return [layer.name for layer in _layers(model) if type(layer).__name__ in _BATCH_COUPLED]


def activation_bytes_per_sample(model) -> int | None:
    """Bytes of the model's largest layer output for one sample, None when no shape is known."""
    largest = None
    for layer in _layers(model):
        try:
            outputs = layer.output
        except (AttributeError, ValueError):  # never called symbolically, or called several times
            continue
        for out in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
            shape = getattr(out, "shape", None)
            if shape is None or any(d is None for d in shape[1:]):
                continue
            size = math.prod(shape[1:]) * np.dtype(out.dtype).itemsize
            largest = size if largest is None else max(largest, size)
    return largest


def cache_sized(model, global_batch: int, budget_bytes: int = ACTIVATION_BUDGET_BYTES) -> int:
    """Slices per batch (1 = whole batches) so that one slice's largest activation fits the budget.

    The fewest slices that fit, each of at least MIN_SLICE samples and all of one size; 1 when the
    model mixes samples within a batch, has its own train_step, or its shapes are unknown, and
    when it computes in 16-bit floats: whole bfloat16 Fashion-MNIST runs were 6-8% faster
    unsliced (their tensors are half the size, and oneDNN's bfloat16 kernels like big batches).
    The 16 MiB budget: on the 2-vCPU Xeon of BENCHMARKS.md, Fashion-MNIST slices of 50 and 100
    samples (8.7 and 17.3 MB conv outputs) ran about equally fast, 250 (43 MB) about 1.3x and
    whole batches of 1000 about 1.5x slower.
    """
    if _must_train_whole(model) or model.dtype_policy.compute_dtype != "float32":
        return 1
    per_sample = activation_bytes_per_sample(model)
    if not per_sample or global_batch * per_sample <= budget_bytes:
        return 1
    counts = [k for k in range(2, global_batch // MIN_SLICE + 1) if global_batch % k == 0]
    fitting = [k for k in counts if global_batch // k * per_sample <= budget_bytes]
    return fitting[0] if fitting else (counts[-1] if counts else 1)


def plan_micro_batches(model, global_batch: int | None, asked: int | str, engine: str,
                       whole_if_unsliceable: bool = False) -> int:
    """Slices per batch for `model` on `engine`: 'auto' plans cache-sized slices on TensorFlow
    when the global batch is known (else 1; on JAX always 1: the cache gain was measured on
    TensorFlow only); a number is checked (see check). whole_if_unsliceable: a model that cannot
    train in slices trains whole batches, with one warning, instead of failing (a resumed run:
    `meshfit launch --elastic --keep-batch per-core` asks its smaller generations for slices)."""
    if asked == "auto":
        return cache_sized(model, global_batch) if engine == "tensorflow" and global_batch else 1
    planning.check_micro_batches(asked)
    reason = _must_train_whole(model) if whole_if_unsliceable and asked > 1 else None
    if reason:
        warnings.warn(f"{reason}: training whole batches, not {asked} micro-batches per batch",
                      stacklevel=2)
        return 1
    return check(model, asked)


def check(model, micro_batches: int) -> int:
    """`micro_batches` checked: a positive int, above 1 only for models that may train in slices
    (model None: the number alone)."""
    planning.check_micro_batches(micro_batches)
    reason = _must_train_whole(model) if model is not None and micro_batches > 1 else None
    if reason:
        raise MeshfitError(f"{reason}; use micro_batches=1")
    return micro_batches


def _must_train_whole(model) -> str | None:
    """Why the model cannot be trained in slices of its batches, or None when it can."""
    coupled = batch_coupled_layers(model)
    if coupled:
        return f"micro-batches would change what {coupled[0]} computes (it normalizes over the whole batch)"
    if not _default_train_step(model):
        return f"{type(model).__name__} has its own train_step, which meshfit cannot slice"
    return None


def install(model, micro_batches: int) -> None:
    """Make the model's TensorFlow train step sum its gradient over `micro_batches` slices of each
    batch.

    Takes effect when Keras next builds the train function (call before `fit`); 1 restores
    Keras' own step.
    """
    model.__dict__.pop("train_step", None)
    if micro_batches > 1:
        object.__setattr__(model, "train_step",
                           lambda data: _sliced_train_step(model, data, micro_batches))
    object.__setattr__(model, "_meshfit_micro_batches", micro_batches)
    model.train_function = None


def installed(model) -> int:
    """The slices per batch installed on the model (1 when none were)."""
    return model.__dict__.get("_meshfit_micro_batches", 1)


def _sliced_train_step(model, data, slices: int):
    """Keras' TensorFlow train step, its gradient accumulated over `slices` slices of the batch.

    The slices run in a tf.while_loop with two in flight (one's forward pass overlaps the other's
    backward pass: 64 against 78 ms/step for one at a time). Unrolled in the graph they ran ~10%
    faster but compiled in 5-9 s instead of ~1.3 s.
    """
    import tensorflow as tf

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    batch = tf.shape(next(t for t in keras.tree.flatten(x) if t is not None))[0]
    tf.debugging.assert_greater_equal(batch, slices, message=(
        f"a batch has fewer samples than its {slices} micro-batches; use micro_batches=1 or "
        "drop the short last batch"))
    weights = model.trainable_weights
    unused = set()

    def body(i, total):
        start, stop = i * batch // slices, (i + 1) * batch // slices
        xs, ys, ws = (keras.tree.map_structure(lambda t: None if t is None else t[start:stop], part)
                      for part in (x, y, sample_weight))
        with tf.GradientTape() as tape:
            y_pred = model(xs, training=True) if model._call_has_training_arg else model(xs)
            loss = model._compute_loss(x=xs, y=ys, y_pred=y_pred, sample_weight=ws, training=True)
            model._loss_tracker.update_state(keras_internals.unscale_loss_for_distribution(loss),
                                             sample_weight=stop - start)
            # Weighted by its share of the batch, so the slices' gradients sum to the whole batch's.
            share = tf.cast(stop - start, loss.dtype) / tf.cast(batch, loss.dtype)
            scaled = model.optimizer.scale_loss(loss) * share
        grads = tape.gradient(scaled, weights)
        unused.update(j for j, g in enumerate(grads) if g is None)
        model.compute_metrics(xs, ys, y_pred, sample_weight=ws)
        return i + 1, [t if g is None else t + tf.convert_to_tensor(g) for t, g in zip(total, grads)]

    zeros = [tf.zeros(w.shape, w.dtype) for w in weights]
    _, total = tf.while_loop(lambda i, _: i < slices, body, (tf.constant(0), zeros),
                             parallel_iterations=2)  # two in flight: 64 vs 78 ms/step one at a time
    model.optimizer.apply_gradients(
        [(None if j in unused else t, w) for j, (t, w) in enumerate(zip(total, weights))])
    return model.get_metrics_result()


def _default_train_step(model) -> bool:
    """True when the model trains with its Keras backend's own train_step."""
    owner = next(c for c in type(model).__mro__ if "train_step" in c.__dict__)
    return keras_internals.is_backend_class(owner)


def _layers(model) -> list:
    return list(model._flatten_layers(include_self=False, recursive=True))
