"""JAX: one train step's gradient summed over K micro-batches of every device's share of the batch.

For memory, not speed: a device holds the activations of B/(D*K) rows at a time instead of B/D
(D devices on the batch axis), so a run can keep its global batch on fewer devices without each
device needing more memory (`meshfit launch --elastic --keep-batch per-core`), or train a global
batch larger than its devices hold. Each device cuts its own shard in K parts (the batch reshaped
(B, ...) -> (D, K, B/(D*K), ...), slice i = [:, i]), so a slice stays sharded over the same
devices and no row moves. The slices run in a `jax.lax.scan` (one slice's activations live at a
time), each slice's gradient weighted by its share 1/K, so the sum is the whole batch's gradient
(up to float summation order) and the optimizer steps once per batch: the same run. Non-trainable
updates and metrics go through the slices in order; random layers (Dropout) draw per slice: the
same distribution, other numbers than a whole batch's.

What it costs, from the compiled step (8 simulated CPU devices, a small CNN, batch 256, K=4):
temporary memory 221 KB -> 47 KB, no rows moved between devices (no all-to-all or permute), but
the gradient's all-reduce runs once per slice on XLA's CPU backend (the sum is kept replicated),
K times a step's gradient traffic: use it where memory, not bandwidth, is short.

A batch that does not split in D*K equal parts (a short last batch) trains whole. Models whose
layers mix samples within a batch (batch normalization) or with their own train_step are not
sliced (meshfit.fit.tf_microbatch.check). `install` works under Keras' own train function and
meshfit's k-step loop (meshfit.fit.jax_loop), which both call the model's `train_step`.
"""

from __future__ import annotations

import functools

import jax
import keras
from jax.sharding import NamedSharding, PartitionSpec


def install(model, micro_batches: int) -> None:
    """Make the model's JAX train step sum its gradient over `micro_batches` slices per device of
    each batch (takes effect when Keras or jax_loop next builds the train function); 1 restores
    Keras' own step."""
    model.__dict__.pop("train_step", None)
    if micro_batches > 1:
        object.__setattr__(model, "train_step", functools.partial(sliced_train_step, model, micro_batches))
    object.__setattr__(model, "_meshfit_micro_batches", micro_batches)
    model.train_function = None


def installed(model) -> int:
    """The slices per batch installed on the model (1 when none were)."""
    return model.__dict__.get("_meshfit_micro_batches", 1)


def sliced_train_step(model, slices: int, state, data):
    """Keras' stateless JAX `train_step(state, data) -> (logs, state)`, its gradient accumulated
    over `slices` per-device slices of the batch (see the module)."""
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    rows = next(t for t in jax.tree.leaves(data) if t is not None).shape[0]
    mesh, axis, devices = _batch_axis()
    if rows % (devices * slices):  # e.g. a short last batch: whole, as Keras trains it
        return type(model).train_step(model, state, data)
    parts = jax.tree.map(lambda t: _per_device_slices(t, devices, slices, mesh, axis), data)
    grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)

    def one_slice(carry, part):
        total, non_trainable, metrics_variables = carry
        part = jax.tree.map(lambda t: _constrain(t, mesh, PartitionSpec(axis)), part)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(part)
        (_, (loss, y_pred, non_trainable, metrics_variables)), grads = grad_fn(
            trainable, non_trainable, metrics_variables, x, y, sample_weight, training=True,
            optimizer_variables=optimizer_variables)
        _, metrics_variables = model._update_metrics_variables(  # the loss and metrics, as Keras'
            metrics_variables, loss, x, y, y_pred, sample_weight)
        # Each slice's mean loss weighted by its share of the batch (1/K, equal slices): the
        # sum is the gradient of the whole batch's mean loss.
        total = jax.tree.map(lambda t, g: t + g / slices, total, grads)
        return (total, non_trainable, metrics_variables), None

    zeros = jax.tree.map(jax.numpy.zeros_like, trainable)
    (grads, non_trainable, metrics_variables), _ = jax.lax.scan(
        one_slice, (zeros, non_trainable, metrics_variables), parts)
    trainable, optimizer_variables = model.optimizer.stateless_apply(optimizer_variables, grads,
                                                                     trainable)
    with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, metrics_variables))):
        logs = model.get_metrics_result()
    return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


def _batch_axis():
    """(JAX mesh, its batch axis name, the devices along it) of the Keras distribution; (None,
    None, 1) without one."""
    distribution = keras.distribution.distribution()
    if distribution is None or not hasattr(distribution, "batch_dim_name"):
        return None, None, 1
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    return mesh.backend_mesh, distribution.batch_dim_name, sizes[distribution.batch_dim_name]


def _per_device_slices(t, devices: int, slices: int, mesh, axis):
    """(B, ...) -> (K, B/K, ...) where [i] holds slice i of every device's shard, in device order:
    sharded on axis 1 like the batch, so each device keeps its own rows."""
    rest = t.shape[1:]
    cut = t.reshape(devices, slices, t.shape[0] // (devices * slices), *rest).swapaxes(0, 1)
    return _constrain(cut.reshape(slices, t.shape[0] // slices, *rest), mesh, PartitionSpec(None, axis))


def _constrain(t, mesh, spec: PartitionSpec):
    """`t` laid out by `spec` on `mesh` (no mesh, or too few axes: as it is)."""
    if mesh is None or t.ndim < len(spec):
        return t
    return jax.lax.with_sharding_constraint(t, NamedSharding(mesh, spec))
