"""Cache-sized micro-batches on the TensorFlow engine (meshfit.fit.tf_microbatch)."""

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from helpers import ONE_CPU, environment

from meshfit import recipes
from meshfit.fit import sources, tf_microbatch
from meshfit.errors import MeshfitError


def test_plan_slices_the_fashion_cnn_batch_to_fit_the_cache(strategy):
    with strategy.scope():
        model = recipes.get("fashion-mnist-cnn").build_model((28, 28, 1), 10)
    per_sample = 26 * 26 * 64 * 4  # the conv output, float32
    assert tf_microbatch.activation_bytes_per_sample(model) == per_sample
    slices = tf_microbatch.cache_sized(model, 1000)
    assert slices == 20  # the fewest equal slices of at most 16 MiB: 50 samples, 8.7 MB
    assert 1000 // slices * per_sample <= tf_microbatch.ACTIVATION_BUDGET_BYTES
    assert 1000 // 10 * per_sample > tf_microbatch.ACTIVATION_BUDGET_BYTES  # fewer would not fit
    assert tf_microbatch.cache_sized(model, 32) == 1  # small batches fit whole
    assert tf_microbatch.cache_sized(model, 64, budget_bytes=1) == 2  # never below MIN_SLICE samples
    assert tf_microbatch.cache_sized(model, 61, budget_bytes=1) == 1  # no equal slices of 32 or more


def test_plan_keeps_whole_batches_where_slicing_would_change_the_model(strategy):
    with strategy.scope():
        cifar = recipes.get("cifar10-cnn").build_model((32, 32, 3), 10)  # batch normalization
        mlp = recipes.get("mnist-mlp-bf16").build_model((28, 28, 1), 10)
    assert tf_microbatch.batch_coupled_layers(cifar)
    assert tf_microbatch.cache_sized(cifar, 4096) == 1
    with pytest.raises(MeshfitError, match="use micro_batches=1"):
        tf_microbatch.check(cifar, 2)
    assert tf_microbatch.cache_sized(mlp, 128) == 1  # 2 KB per sample: the batch fits the cache whole
    with strategy.scope():
        keras.config.set_dtype_policy("mixed_bfloat16")
        try:
            half = recipes.get("fashion-mnist-cnn").build_model((28, 28, 1), 10)
        finally:
            keras.config.set_dtype_policy("float32")
    assert tf_microbatch.cache_sized(half, 1000) == 1  # bfloat16 ran faster in whole batches

    class OwnStep(keras.Sequential):
        def train_step(self, data):
            return {}

    own = OwnStep([keras.Input((28, 28, 1)), keras.layers.Conv2D(64, 3)])
    assert tf_microbatch.cache_sized(own, 1000) == 1
    with pytest.raises(MeshfitError, match="own train_step"):
        tf_microbatch.check(own, 4)
    with pytest.raises(MeshfitError, match="at least 1 or 'auto'"):
        tf_microbatch.check(own, 0)


def test_cache_sized_micro_batches_are_for_the_tensorflow_engine(strategy):
    with strategy.scope():
        model = recipes.get("fashion-mnist-cnn").build_model((28, 28, 1), 10)
    assert tf_microbatch.plan_micro_batches(model, 1000, "auto", strategy.engine) == 1  # whole batches on JAX
    assert tf_microbatch.plan_micro_batches(model, 1000, 4, strategy.engine) == 4  # asked: sliced (for memory)


SAME_STEP_SCRIPT = textwrap.dedent("""
    import json, warnings
    import numpy as np
    import meshfit
    from meshfit.fit import tf_microbatch

    strategy = meshfit.connect(engine="tensorflow", verbose=False)
    import keras
    import tensorflow as tf

    class SliceProbe(keras.layers.Layer):
        # adds the square of each batch it sees: 10 whole -> 100; slices of 3, 3, 4 -> 34
        def build(self, shape):
            self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False, name="seen")

        def call(self, x, training=False):
            if training:
                self.seen.assign_add(tf.cast(tf.shape(x)[0] ** 2, "float32"))
            return x

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (25, 12, 12, 1)).astype("uint8")
    y = rng.integers(0, 4, 25).astype("int32")
    weights = rng.uniform(0.5, 2.0, 25).astype("float32")
    runs = {}
    for slices in (1, 3):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            probe = SliceProbe()
            model = keras.Sequential([keras.Input((12, 12, 1)), keras.layers.Rescaling(1 / 255),
                                      keras.layers.Conv2D(8, 3), probe, keras.layers.MaxPooling2D(),
                                      keras.layers.Activation("relu"), keras.layers.Flatten(),
                                      keras.layers.Dense(4, kernel_regularizer="l2"),
                                      keras.layers.Activation("softmax")])
            model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
        initial = model.trainable_weights[0].numpy()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = strategy.fit(model, x, y, sample_weight=weights, batch_size=10, epochs=2,
                                   shuffle=False, micro_batches=slices, report=False)
        runs[slices] = {"weights": [w.numpy().tolist() for w in model.trainable_weights],
                        "change": float(np.abs(model.trainable_weights[0].numpy() - initial).max()),
                        "history": history.history, "seen": float(probe.seen.numpy()),
                        "installed": tf_microbatch.installed(model),
                        "warnings": [str(w.message) for w in caught]}
    print(json.dumps(runs))
""")


def test_sliced_step_trains_exactly_like_the_whole_batch(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SAME_STEP_SCRIPT], capture_output=True, text=True,
                          env=environment(ONE_CPU), timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    whole, sliced = runs["1"], runs["3"]
    assert whole["installed"] == 1 and sliced["installed"] == 3
    # 25 samples, batch 10: two batches of 10, then 5, which still has one sample per slice
    assert whole["seen"] == 2 * (2 * 10 ** 2 + 5 ** 2)
    assert sliced["seen"] == 2 * (2 * (3 ** 2 + 3 ** 2 + 4 ** 2) + (1 + 2 ** 2 + 2 ** 2))
    assert not any("dropping" in w for w in sliced["warnings"])
    for a, b in zip(whole["weights"], sliced["weights"]):
        np.testing.assert_allclose(a, b, atol=2e-5)
    assert whole["change"] > 1e-3 and sliced["change"] > 1e-3  # both trained
    for key in ("loss", "accuracy"):
        assert whole["history"][key] == pytest.approx(sliced["history"][key], abs=1e-5), key


def test_a_last_batch_shorter_than_the_slices_is_dropped_with_a_warning(strategy):
    x, y = np.zeros((22, 4)), np.zeros(22)
    with pytest.warns(UserWarning, match="dropping the last 2 of 22 samples .* 3 micro-batches"):
        kept_x, kept_y, _ = sources.trim_last_batch([x, y, None], 10, strategy.replicas, micro_batches=3)
    assert len(kept_x) == len(kept_y) == 20
    kept_x, _ = sources.trim_last_batch([np.zeros((28, 4)), None], 10, strategy.replicas, micro_batches=3)
    assert len(kept_x) == 28  # 8 left: enough for the slices, and one per replica


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_the_tensorflow_pipeline_over_a_stream_has_no_autotuning_thread(micro_batches):
    """The tf.data pipeline Keras' TensorFlow fit reads meshfit's batches through is not
    autotuned: the autotuning thread's sleep (up to 60 s) was waited out when fit's iterator was
    destroyed, 9-58 s at the end of 8 of 14 runs (meshfit.fit.sources.without_autotune)."""
    batches = ((np.full((6, 4), i, "float32"), np.zeros(6, "float32")) for i in range(4))
    dataset = sources.SplitBatches(batches, 1, micro_batches).get_tf_dataset()
    assert dataset.options().autotune.enabled is False
    assert [float(x[0, 0]) for x, _ in dataset] == [0.0, 1.0, 2.0, 3.0]  # every batch, in order
    import tensorflow as tf  # a tf.data.Dataset of the user's own keeps its options

    own = tf.data.Dataset.from_tensor_slices((np.zeros((12, 4), "float32"), np.zeros(12))).batch(6)
    assert sources.SplitBatches(own, 1).get_tf_dataset().options().autotune.enabled is not False
