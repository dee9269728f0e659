"""Micro-batches on JAX (meshfit.fit.jax_microbatch): each device's share of the batch in K slices,
the gradient summed over them, one optimizer step: the same training as whole batches."""

import numpy as np
import pytest

from meshfit.errors import MeshfitError
from meshfit.fit import jax_microbatch

BATCH = 64  # 8 per device on the 8 simulated devices; in 2 slices: 4 per device at a time

SEEN_SHAPES, SEEN_SHARDINGS = [], []


def probe_layer():
    """A layer adding the rows of each batch it trains on to a non-trainable weight (threaded
    through the slices), and recording, while traced, the batch's shape and its sharding."""
    import jax
    import keras

    class RowProbe(keras.layers.Layer):
        def build(self, shape):
            self.rows = self.add_weight(shape=(), initializer="zeros", trainable=False, name="rows")

        def call(self, x, training=False):
            if training and isinstance(x, jax.core.Tracer):
                SEEN_SHAPES.append(tuple(x.shape))
                jax.debug.inspect_array_sharding(x, callback=SEEN_SHARDINGS.append)
            if training:
                self.rows.assign_add(keras.ops.cast(keras.ops.shape(x)[0], "float32"))
            return x

    return RowProbe()


def model_with_probe(strategy, steps_per_execution=1):
    import keras
    from keras import layers

    keras.utils.set_random_seed(0)
    with strategy.scope():
        probe = probe_layer()
        model = keras.Sequential([
            keras.Input((8, 8, 1)), layers.Rescaling(1 / 255), probe, layers.Conv2D(4, 3, activation="relu"),
            layers.Flatten(), layers.Dense(10, kernel_regularizer="l2"), layers.Activation("softmax")])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=steps_per_execution)
    return model, probe


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, 8, 8, 1)).astype("uint8"), rng.integers(0, 10, n).astype("int32"),
            rng.uniform(0.5, 2.0, n).astype("float32"))


def train(strategy, micro_batches, steps_per_execution=1, batches=3, extra_rows=0):
    x, y, w = data(batches * BATCH + extra_rows)
    model, probe = model_with_probe(strategy, steps_per_execution)
    initial = [v.numpy() for v in model.trainable_weights]
    SEEN_SHAPES.clear()
    SEEN_SHARDINGS.clear()
    history = strategy.fit(model, x, y, sample_weight=w, batch_size=BATCH, epochs=2, shuffle=False,
                           micro_batches=micro_batches, report=False).history
    moved = max(np.abs(a.numpy() - b).max() for a, b in zip(model.trainable_weights, initial))
    loop = getattr(model.train_function, "__wrapped__", model.train_function)  # jax_loop's, timed
    return {"weights": [v.numpy() for v in model.trainable_weights], "history": history, "loop": loop,
            "rows": float(probe.rows.numpy()), "moved": moved, "installed": jax_microbatch.installed(model),
            "shapes": list(SEEN_SHAPES), "shardings": list(SEEN_SHARDINGS)}


def assert_same_training(whole, sliced):
    assert whole["moved"] > 1e-3  # the steps changed the weights: the comparison means something
    for a, b in zip(whole["weights"], sliced["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(whole["history"][key], sliced["history"][key], rtol=1e-5, err_msg=key)
    assert whole["rows"] == sliced["rows"]  # the non-trainable update saw every row once


def test_two_slices_per_device_train_like_whole_batches(strategy):
    whole, sliced = train(strategy, 1), train(strategy, 2)
    assert (whole["installed"], sliced["installed"]) == (1, 2)
    assert_same_training(whole, sliced)
    assert whole["rows"] == 2 * 3 * BATCH
    # Each slice is every device's own half-share: 32 rows over the 8 devices, 4 on each.
    assert set(sliced["shapes"]) == {(BATCH // 2, 8, 8, 1)} and set(whole["shapes"]) == {(BATCH, 8, 8, 1)}
    for sharding in sliced["shardings"]:
        assert len(sharding.device_set) == 8 and not sharding.is_fully_replicated
        assert sharding.shard_shape((BATCH // 2, 8, 8, 1)) == (BATCH // 16, 8, 8, 1)


def test_slices_inside_the_multi_step_loop(strategy):
    """jax_loop scans the installed step: 3 batches per epoch, 2 per dispatch, then 1 single step;
    with a short last batch (16 rows: 2 per device, too few for 4 slices each) trained whole."""
    from meshfit.fit import jax_loop

    whole, sliced = (train(strategy, k, steps_per_execution=2, extra_rows=16) for k in (1, 4))
    assert isinstance(sliced["loop"], jax_loop._TrainFunction) and sliced["loop"]._multi is not None
    assert_same_training(whole, sliced)
    assert whole["rows"] == 2 * (3 * BATCH + 16)
    assert (BATCH // 4, 8, 8, 1) in sliced["shapes"] and (16, 8, 8, 1) in sliced["shapes"]


def test_a_model_that_cannot_train_in_slices_is_refused_or_trained_whole(strategy):
    import keras

    from meshfit.fit import tf_microbatch

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                                  keras.layers.BatchNormalization(name="norm")])
    with pytest.raises(MeshfitError, match="micro-batches would change what norm computes.*use micro_batches=1"):
        strategy.fit(model, np.zeros((16, 4)), np.zeros((16, 4)), batch_size=16, micro_batches=2)
    with pytest.warns(UserWarning, match="norm computes .*: training whole batches, not 2 micro-batches"):
        assert tf_microbatch.plan_micro_batches(model, 16, 2, "jax", whole_if_unsliceable=True) == 1


@pytest.mark.slow
def test_a_run_resumed_on_half_the_devices_in_two_micro_batches_is_the_same_run(data_dir, tmp_path):
    """What `meshfit launch --elastic --keep-batch per-core` does after losing half the devices:
    an 8-device run of fashion-mnist-cnn (no dropout: every step is deterministic), its steps
    after its step-4 checkpoint redone on 4 devices with --micro-batches 2 (each device again 2
    rows at a time), ends with the uninterrupted run's weights."""
    import json
    import os
    import shutil

    from helpers import N_TRAIN, run_meshfit
    from test_checkpoints import final_arrays

    from meshfit.run import checkpoint_format
    from meshfit.run.train import train

    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    steps = N_TRAIN // 16
    train("fashion-mnist-cnn", data_dir=data_dir, out=whole, epochs=1, global_batch=16, engine="jax",
          simulate_devices=8, checkpoint_every="4", verbose=False)
    shutil.copytree(whole, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", f"ckpt-{steps:08d}"))  # stopped after step 4
    out = run_meshfit("train", "--resume", resumed, "--simulate-devices", "4", "--micro-batches", "2",
                      env={"MESHFIT_OFFLINE": "1", "XLA_FLAGS": ""})
    assert out.returncode == 0, out.stderr
    assert "epoch 1 step 4" in out.stdout and "gradients summed over 2 per-device micro-batches" in out.stdout
    resumption = json.loads(open(os.path.join(resumed, "config.json")).read())["resumed"][-1]
    assert (resumption["replicas"], resumption["micro_batches"]) == (4, 2)
    original = checkpoint_format.read_arrays(os.path.join(whole, "checkpoints", f"ckpt-{steps:08d}"))
    again = checkpoint_format.read_arrays(os.path.join(resumed, "checkpoints", f"ckpt-{steps:08d}"))
    start = checkpoint_format.read_arrays(os.path.join(whole, "checkpoints", "ckpt-00000004"))
    keys = [k for k in original if k.startswith("model/")]
    assert keys and max(np.abs(original[k] - start[k]).max() for k in keys) > 1e-3  # steps 5-8 trained
    for key in keys:
        np.testing.assert_allclose(again[key], original[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_slices_need_less_temporary_memory_and_move_no_rows_between_devices(strategy):
    """The point of slicing: the compiled step's temporary memory (XLA's own analysis) shrinks,
    and the per-device cut is local (no all-to-all or permute of the batch)."""
    import functools

    import jax
    import keras
    from jax.sharding import NamedSharding, PartitionSpec

    from meshfit.fit import jax_loop

    with strategy.scope():
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
                                  keras.layers.Flatten(), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.zeros((256, 8, 8, 1), "float32"), np.zeros(256, "int32")
    state = jax_loop.training_state(model, (x[:64], y[:64]))
    mesh = keras.distribution.distribution().device_mesh.backend_mesh
    batch = jax.device_put((x, y), NamedSharding(mesh, PartitionSpec("batch")))
    compiled = {k: jax.jit(functools.partial(jax_microbatch.sliced_train_step, model, k) if k > 1
                           else model.train_step).lower(state, batch).compile() for k in (1, 4)}
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    assert temp[4] < temp[1] / 2, temp  # 221 KB -> 47 KB measured (XLA CPU, JAX 0.10.2)
    text = compiled[4].as_text()
    assert "all-to-all" not in text and "collective-permute" not in text
    # The report's FLOPs (MFU) count the whole step, not one slice of it (XLA counts a loop's body once)
    from meshfit.watch.keras_side import report

    whole = report.count_train_step_flops(model, 256)
    jax_microbatch.install(model, 4)
    assert whole and report.count_train_step_flops(model, 256) == whole
