"""Any data source through Strategy.fit (meshfit.fit.sources): 1,003 samples in batches of 64, whose
last batch (43) does not split 8 ways, from numpy arrays, tf.data, a PyDataset, a generator and
Grain datasets; on 8 simulated devices, on one, on the TensorFlow engine and on 2 processes.

On one host the short batch is computed whole on every device (meshfit.fit.hooks), so every
source trains on all 1,003 samples and ends with the weights one device gets. On 2 processes,
where each feeds its own rows, it is cut to 40: the weights of the first 1,000 samples.
"""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
from helpers import ONE_CPU, environment, run_meshfit

from meshfit.data import rows
from meshfit.fit.strategy import Strategy
from meshfit.errors import MeshfitError

SAMPLES, BATCH, FEATURES, CLASSES = 1003, 64, 4, 3
KEPT = 1000  # on 2 processes x 4 devices: 15 batches of 64 and the last 43 cut to 40

rng = np.random.default_rng(0)
X = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
Y = rng.integers(0, CLASSES, SAMPLES)
INITIAL = [rng.normal(size=(FEATURES, CLASSES)).astype("float32"), np.zeros(CLASSES, "float32")]


class SeenSamples(keras.metrics.Metric):
    """Rows trained on (or evaluated) since the last reset, i.e. in this epoch."""

    def __init__(self, name="seen", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(keras.ops.sum(keras.ops.ones_like(y_pred[:, 0])))  # traced, not a constant

    def result(self):
        return keras.ops.convert_to_tensor(self.count)


def tiny_model(strategy, inputs=None):
    """A softmax regression from the same initial weights every time."""
    with strategy.scope():
        features = keras.Input((FEATURES,), name="features")
        model = keras.Model(features, keras.layers.Dense(CLASSES, activation="softmax")(features))
        model.set_weights(INITIAL)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                      metrics=[SeenSamples()])
    return model


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return -(-SAMPLES // BATCH)

    def __getitem__(self, i):
        return X[i * BATCH:(i + 1) * BATCH], Y[i * BATCH:(i + 1) * BATCH]


def generator(x=X, y=Y, batch=BATCH):
    for start in range(0, len(x), batch):
        yield x[start:start + batch], y[start:start + batch]


def make_source(kind):
    if kind == "tf.data":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    if kind == "PyDataset":
        return Batches()
    if kind == "generator":
        return generator()
    grain = pytest.importorskip("grain")
    batches = grain.MapDataset.range(SAMPLES).map(lambda i: (X[i], Y[i])).batch(BATCH)
    return batches if kind == "grain.MapDataset" else batches.to_iter_dataset()


KINDS = ["tf.data", "PyDataset", "generator", "grain.MapDataset", "grain.IterDataset"]


class EpochWeights(keras.callbacks.Callback):
    """The model's weights at the end of each epoch."""

    def on_train_begin(self, logs=None):
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(self.model.get_weights())


def fit(strategy, model, x, y=None, **kwargs):
    """Strategy.fit: its history, its warnings' messages and the weights after each epoch."""
    weights = EpochWeights()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = strategy.fit(model, x, y, shuffle=False, report=False, callbacks=[weights], **kwargs)
    return history.history, [str(w.message) for w in caught], weights.weights


def one_device(strategy):
    """The first of the 8 simulated devices alone, as a Strategy."""
    return Strategy(dataclasses.replace(strategy.info, devices=strategy.info.devices[:1], devices_per_host=1),
                    "jax", "float32")


@pytest.fixture(scope="module")
def one_device_weights():
    """Weights after each of 2 epochs of the arrays on one device: the reference."""
    from helpers import connect_eight_devices

    one = one_device(connect_eight_devices())
    try:
        history, messages, weights = fit(one, tiny_model(one), X, Y, batch_size=BATCH, epochs=2)
    finally:
        connect_eight_devices()
    assert history["seen"] == [SAMPLES, SAMPLES]
    assert not any("split" in m for m in messages)
    return weights


def assert_same_weights(a, b):
    for u, v in zip(a, b, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["arrays"] + KINDS)
def test_every_source_trains_every_sample_on_eight_devices(strategy, one_device_weights, kind):
    epochs = 1 if kind == "generator" else 2  # a generator is read once
    model = tiny_model(strategy)
    if kind == "arrays":
        history, messages, weights = fit(strategy, model, X, Y, batch_size=BATCH, epochs=epochs)
    else:
        history, messages, weights = fit(strategy, model, make_source(kind), epochs=epochs)
    assert history["seen"] == [SAMPLES] * epochs
    assert all(np.isfinite(history["loss"]))
    assert not any("split" in m for m in messages)  # a short last batch is normal: no warning
    assert not any("ran out of data" in m for m in messages)  # the source's end is the epoch's end
    assert not np.allclose(weights[0][0], INITIAL[0])
    for epoch in range(epochs):  # the same samples in the same batches as on one device
        assert_same_weights(weights[epoch], one_device_weights[epoch])


def test_validation_sources_score_every_sample(strategy):
    import tensorflow as tf

    model = tiny_model(strategy)
    validation = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    history, _, _ = fit(strategy, model, Batches(), epochs=2, validation_data=validation)
    assert history["val_seen"] == [SAMPLES, SAMPLES]
    history, _, _ = fit(strategy, model, X, Y, batch_size=BATCH, validation_data=generator(X[:99], Y[:99]))
    assert history["val_seen"] == [99]


def test_weighted_batches_with_dict_inputs(strategy):
    """(x, y, sample_weight) batches whose x is a dict train as the same arrays do."""
    weights = np.random.default_rng(1).uniform(0, 2, SAMPLES).astype("float32")
    from_arrays, from_stream = tiny_model(strategy), tiny_model(strategy)
    fit(strategy, from_arrays, {"features": X}, Y, batch_size=BATCH, sample_weight=weights)
    stream = (({"features": X[i:i + BATCH]}, Y[i:i + BATCH], weights[i:i + BATCH])
              for i in range(0, SAMPLES, BATCH))
    history, _, _ = fit(strategy, from_stream, stream)
    assert history["seen"] == [SAMPLES]
    assert_same_weights(from_stream.get_weights(), from_arrays.get_weights())


def test_fewer_samples_than_replicas_train(strategy):
    x, y = X[:965], Y[:965]  # 15 batches of 64, then 5: fewer than the 8 replicas
    history, messages, _ = fit(strategy, tiny_model(strategy), generator(x, y))
    assert history["seen"] == [965]
    history, messages, _ = fit(strategy, tiny_model(strategy), X[:3], Y[:3], batch_size=BATCH)
    assert history["seen"] == [3]
    assert sum("a batch of 3 samples does not split across 8 devices" in m for m in messages) == 1


def test_a_batch_size_that_does_not_split_is_named_once(strategy):
    history, messages, _ = fit(strategy, tiny_model(strategy), generator(batch=60), epochs=1)
    assert history["seen"] == [SAMPLES]
    assert sum("a batch of 60 samples does not split across 8 devices" in m for m in messages) == 1


def test_a_dataset_that_repeats_for_ever_needs_its_steps(strategy):
    """Keras read such an epoch (or validation) for ever, with no word; Strategy.fit and plain
    fit in the scope refuse it in one line naming the step count to pass."""
    import tensorflow as tf

    endless = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH).repeat()
    model = tiny_model(strategy)
    with pytest.raises(MeshfitError, match="repeats for ever.*pass steps_per_epoch"):
        strategy.fit(model, endless)
    with strategy.scope(), pytest.raises(MeshfitError, match="repeats for ever.*pass validation_steps"):
        model.fit(X, Y, validation_data=endless, verbose=0)
    history, _, _ = fit(strategy, model, endless, epochs=2, steps_per_epoch=4,
                        validation_data=endless, validation_steps=2)
    assert history["seen"] == [4 * BATCH, 4 * BATCH]


def test_a_generator_without_steps_trains_one_epoch_only(strategy):
    with pytest.raises(MeshfitError, match="can be read only once.*pass steps_per_epoch"):
        strategy.fit(tiny_model(strategy), generator(), epochs=2)

    def forever():
        while True:
            yield from generator()

    history, _, _ = fit(strategy, tiny_model(strategy), forever(), epochs=2, steps_per_epoch=16)
    assert history["seen"] == [SAMPLES, SAMPLES]


def test_unreadable_sources_are_one_line_errors(strategy):
    with pytest.raises(MeshfitError, match="cannot read a set; pass numpy arrays"):
        strategy.fit(tiny_model(strategy), {1, 2})
    with pytest.raises(MeshfitError, match="pass no y or sample_weight"):
        strategy.fit(tiny_model(strategy), Batches(), Y)


def test_splittable_rows():
    assert rows.splittable_rows(43, 8) == 40
    assert rows.splittable_rows(64, 8) == 64
    assert rows.splittable_rows(5, 8) == 0
    assert rows.splittable_rows(10, 1, micro_batches=3) == 10
    assert rows.splittable_rows(2, 1, micro_batches=3) == 0


ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import meshfit
    strategy = meshfit.connect(engine="tensorflow", verbose=False)
    import test_sources as t
    seen = {}
    for kind in t.KINDS:
        history = strategy.fit(t.tiny_model(strategy), t.make_source(kind), shuffle=False, report=False)
        seen[kind] = history.history["seen"]
    seen["arrays"] = strategy.fit(t.tiny_model(strategy), t.X, t.Y, batch_size=t.BATCH,
                                  report=False).history["seen"]
    # 3 micro-batches: batches of 10, 10 and 2, which is too short for them
    seen["sliced"] = strategy.fit(t.tiny_model(strategy), t.generator(t.X[:22], t.Y[:22], batch=10),
                                  micro_batches=3, report=False).history["seen"]
    # with a validation split only the training half is cut: all 11 held out are scored (cutting
    # the 22 first left 20, so 10 were held out)
    seen["split"] = strategy.fit(t.tiny_model(strategy), t.X[:22], t.Y[:22], batch_size=10,
                                 micro_batches=3, validation_split=0.5, report=False).history["val_seen"]
    print(json.dumps({"engine": strategy.engine, "seen": seen}))
""")


def test_every_source_trains_on_the_tensorflow_engine():
    tests = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, tests], capture_output=True, text=True,
                         timeout=300, env=environment(ONE_CPU))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["engine"] == "tensorflow"
    assert result["seen"] == {**{kind: [SAMPLES] for kind in KINDS + ["arrays"]}, "sliced": [20], "split": [11]}


LAUNCH_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import meshfit
    strategy = meshfit.connect(verbose=False)
    import jax
    import numpy as np
    import test_sources as t
    seen = {}
    for kind in ("generator", "PyDataset"):
        model = t.tiny_model(strategy)
        seen[kind] = strategy.fit(model, t.make_source(kind), shuffle=False, report=False).history["seen"]
        if jax.process_index() == 0:
            np.savez(f"{sys.argv[2]}/{kind}.npz", *model.get_weights())
    print(json.dumps({"replicas": strategy.replicas, "seen": seen}))
""")


@pytest.mark.slow
def test_two_processes_cut_streams_to_the_first_thousand_samples(strategy, tmp_path):
    script = tmp_path / "fit_streams.py"
    script.write_text(LAUNCH_SCRIPT)
    out = run_meshfit("launch", "--processes", "2", "--devices-per-process", "4", "--timeout", "240", "--",
                      sys.executable, str(script), os.path.dirname(__file__), str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if '"seen"' in line]
    assert len(results) == 2
    for result in results:
        assert result == {"replicas": 8, "seen": {"generator": [KEPT], "PyDataset": [KEPT]}}
    _, _, cut = fit(strategy, tiny_model(strategy), X[:KEPT], Y[:KEPT], batch_size=BATCH)
    for kind in ("generator", "PyDataset"):
        saved = np.load(tmp_path / f"{kind}.npz")
        assert_same_weights([saved[k] for k in saved.files], cut[0])
