"""Several training steps per dispatch: one compiled on-device loop instead of k Python calls.

Keras 3.15's `steps_per_execution` on JAX still calls the jitted one-step function k times from
Python (keras/src/backend/jax/trainer.py, `_make_function`), so a small model on a TPU or GPU
waits on Python and launch overhead between steps. Here the k steps are one XLA program: the k
batches are stacked on the device and `jax.lax.scan` runs the model's own stateless `train_step`
over them, carrying the weights, optimizer and metric state, so one dispatch trains k steps.

It runs inside Keras `fit`, which keeps callbacks, epochs, validation and logs. `Strategy.fit`
installs it on JAX with the compiled `steps_per_execution`, so with meshfit this is all it takes:

    model.compile(..., steps_per_execution=8)    # inside strategy.scope()
    strategy.fit(model, x, y, batch_size=1024, epochs=5)

With plain `model.fit`, call `meshfit.fit.jax_loop.install(model, steps=8)` after `compile`. Callbacks'
batch hooks then run every k steps (as with Keras' `steps_per_execution`). JAX engine only for
the compiled loop; on TensorFlow `install` sets Keras' own `steps_per_execution`, which is
already an in-graph loop there. The k batches come from Keras' iterator (already on the devices
when the input pipeline keeps the data there) and are stacked on the device for the loop.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import keras
from jax.sharding import NamedSharding, PartitionSpec

from meshfit.fit import declined_jit, keras_internals
from meshfit.parallel import heartbeat
from meshfit.parallel.planning import check_steps_per_dispatch


def make_multi_step(model, steps: int, state_placements: Any = None, stacked: bool = False) -> Callable:
    """A jitted `fn(state, batches) -> (logs, state)` that runs `steps` train steps in one program.

    state: the model's JAX training state, the tuple Keras' JAX `train_function` takes:
      (trainable, non-trainable, optimizer, metrics variable values).
    batches: a sequence of `steps` batches, each `(x, y)` or `(x, y, sample_weight)` of equal
      shapes; they are stacked on the device and scanned over in order. stacked=True: one such
      batch structure whose arrays have the `steps` batches stacked on a leading axis already
      (as Keras 3.16's iterator gives them, keras_internals.stacks_dispatch_batches).
    state_placements: the JAX placements (jax.sharding.Sharding) the new state must keep (Keras'
      DataParallel replicates variables); None lets XLA choose.
    Returns the last step's logs (Keras metrics are running means, so these are the epoch's so
    far) and the new state. The input state's buffers are donated.
    """
    check_steps_per_dispatch(steps)

    def run(state, batches):
        if stacked:
            together = batches
        elif len(batches) != steps:
            raise ValueError(f"expected {steps} batches, got {len(batches)}")
        else:
            together = jax.tree.map(lambda *parts: jnp.stack(parts), *batches)
        stacked_batches = _keep_batch_sharded(together)

        def one_step(carry, batch):
            logs, new_state = model.train_step(carry, batch)
            return new_state, logs

        # One XLA program for the k steps: no Python or launch overhead between them.
        state, logs = jax.lax.scan(one_step, state, stacked_batches)
        # Keras' metrics are running means: the last step's logs are the epoch's so far.
        return jax.tree.map(lambda t: t[-1], logs), state

    out_shardings = None if state_placements is None else (None, state_placements)
    return jax.jit(run, donate_argnums=0, out_shardings=out_shardings)


def training_state(model, batch) -> tuple:
    """The model's JAX training state, after building what `fit` builds first for `batch`.

    batch: one `(x, y)` batch; it fixes the shapes that the metrics and optimizer are built for.
    """
    model._symbolic_build(data_batch=batch)  # as Keras' fit does before its first step
    return tuple([v.value for v in group] for group in _state_variables(model))


def set_training_state(model, state) -> None:
    """Write a training state (as `make_multi_step` returns it) back into the model's variables."""
    for variables, values in zip(_state_variables(model), state):
        for variable, value in zip(variables, values):
            variable.assign(value)


def _state_variables(model) -> tuple:
    return (model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
            model.metrics_variables)


def install(model, steps: int = 1) -> None:
    """Train `model` `steps` steps per dispatch from now on in `fit` (call after `compile`).

    On JAX the compiled on-device loop becomes the model's `train_function`; epochs whose step
    count is not a multiple of `steps`, or a last batch of another size, finish with ordinary
    single steps. Choose `steps` dividing the epoch's steps (see `meshfit.parallel.planning.dividing_steps`): like Keras'
    `steps_per_execution`, a call takes up to `steps` batches from the iterator.
    With steps=1 it is Keras' step, except that the state is kept on its devices' placements: on one
    device Keras' `DataParallel` leaves fresh variables uncommitted, and its jitted step then
    compiles again at the second step and after every metrics reset.
    On other engines Keras' own `steps_per_execution` is set (an in-graph loop on TensorFlow).
    """
    check_steps_per_dispatch(steps)
    model.steps_per_execution = steps
    model.train_function = None
    # A model that Keras' own layers keep op by op takes Keras' function, which meshfit compiles
    # where it traces and runs op by op where it does not (meshfit.fit.declined_jit).
    if keras.backend.backend() == "jax" and not declined_jit.declining_layers(model):
        model.train_function = _TrainFunction(model, steps)


class _TrainFunction:
    """Keras' JAX `train_function(state, iterator)`, running k steps per call on the device."""

    _meshfit_counted = True  # it reports its own progress (heartbeat.advance)

    def __init__(self, model, steps: int):
        self.model = model
        self.steps = steps
        self._placements = None
        self._multi = None
        self._single = None
        # Keras 3.16 stacks each dispatch's k batches itself (then an epoch's last few as a list).
        self._stacked = steps > 1 and keras_internals.stacks_dispatch_batches()

    def _compile(self, state) -> None:
        self._placements = jax.tree.map(lambda a: a.sharding, state)
        self._single = jax.jit(self.model.train_step, donate_argnums=0,
                               out_shardings=(None, self._placements))
        if self.steps > 1:
            self._multi = make_multi_step(self.model, self.steps, self._placements, self._stacked)

    def __call__(self, state, iterator):
        if self._single is None:
            self._compile(state)
        if not all(a.committed for a in jax.tree.leaves(state)):
            state = jax.device_put(state, self._placements)  # one compiled program, not two
        heartbeat.advance()  # for meshfit launch's watchdog: reading batches may wait for other hosts
        if self._stacked:
            together = next(iterator)  # its StopIteration ends the epoch
            if not isinstance(together, list) and _leading_rows(together) == self.steps:
                heartbeat.advance(self.steps)
                return self._multi(state, together)
            batches = list(together) if isinstance(together, list) else _unstacked(together)
        else:
            batches = []
            for batch in iterator:
                batches.append(batch)
                if len(batches) == self.steps:
                    break
            if not batches:
                raise StopIteration
        heartbeat.advance(len(batches))  # and so may the dispatch (no device sync here)
        # A short dispatch (an epoch's end) or a cut batch runs as single steps: the k-step
        # program keeps its one shape and compiles once.
        if self._multi is not None and len(batches) == self.steps and _same_shapes(batches):
            logs, state = self._multi(state, batches)
        else:
            for batch in batches:
                logs, state = self._single(state, batch)
        return logs, state


def _leading_rows(stacked) -> int:
    return jax.tree.leaves(stacked)[0].shape[0]


def _unstacked(stacked) -> list:
    """The batches stacked on the leading axis of `stacked`, one by one."""
    return [jax.tree.map(lambda t, i=i: t[i], stacked) for i in range(_leading_rows(stacked))]


def _same_shapes(batches) -> bool:
    shapes = [jax.tree.map(lambda t: tuple(t.shape), b) for b in batches]
    return all(s == shapes[0] for s in shapes)


def _keep_batch_sharded(stacked):
    """Under a Keras distribution, shard the stacked batches along the batch axis (axis 1)."""
    distribution = keras.distribution.distribution()
    if distribution is None or not hasattr(distribution, "batch_dim_name"):
        return stacked
    mesh = distribution.device_mesh.backend_mesh
    spec = PartitionSpec(None, distribution.batch_dim_name)
    return jax.tree.map(
        lambda t: jax.lax.with_sharding_constraint(t, NamedSharding(mesh, spec)) if t.ndim >= 2 else t,
        stacked)
