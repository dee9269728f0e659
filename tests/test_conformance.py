"""Conformance: models as keras.io writes them train, evaluate and predict on 8 devices as on one.

meshfit's promise is that a Keras user adds `strategy = meshfit.connect()`, builds and compiles
inside `with strategy.scope():`, and their unchanged `model.fit/evaluate/predict` runs on every
device. Each family below is a tiny version of a keras.io example written as its author wrote it
(custom `keras.ops` layers, subclassed models with their own compile/compute_loss/train_step,
dict inputs and outputs, an LSTM, BatchNormalization, Dropout, PyDataset and tf.data input). Each
is trained from the same initial weights and seed on one device and on the 8 simulated devices
with plain `model.fit` (default verbose, shuffle=False, 2 epochs) on an odd number of samples:
the last training batch (140 = 4 x 32 + 12 after validation_split=0.2 of 175) and the validation
remainder (35 = 32 + 3) do not split 8 ways, so they exercise meshfit's whole-batch placement.
The suite requires, to float rounding (RTOL):

- the same per-epoch history (loss, metrics, val_*) on 1 and 8 devices: a dropped, padded or
  double-counted sample, or another Dropout mask, moves it well beyond rounding (the last test
  shows that dropping a short last batch fails the comparison);
- the same per-batch loss seen by a callback reading `float(logs["loss"])` every batch;
- the same `evaluate` on 35 samples, and `predict` on 1, 3 and 35 samples returning every sample
  with the same outputs (to PREDICT_RTOL: see there);
- Keras' progress output and meshfit's per-epoch line under the default verbose.

Dropout draws the same masks on 1 and 8 devices: Keras seeds JAX's threefry, whose bits do not
depend on how the batch is sharded (jax_threefry_partitionable, the default). No family hit a
Keras limitation on JAX with data parallelism, so none is marked as one.

The CNN and the ViT also run through the CLI from a recipe file written from this file's own
code: `meshfit train FILE.py --simulate-devices 8`, then `meshfit eval RUN` and `meshfit predict
RUN FILES`. The Distiller and a text transformer go through the CLI in tests/test_custom_models.py
(train on 4 and 2 devices, eval, predict, export, and the Distiller's resume), so four families
in all.
"""

import contextlib
import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import keras
import numpy as np
import pytest
from helpers import cli_env, connect_eight_devices, run_meshfit
from keras import layers, ops
from test_sources import one_device

SAMPLES, BATCH, EPOCHS = 175, 32, 2  # validation_split=0.2: 140 train (4 x 32 + 12), 35 val (32 + 3)
EVAL = 35  # evaluate and predict: 32 + 3, the validation shapes and predict's 3 (no more compilations)
VALIDATION_SPLIT = 0.2
RTOL, ATOL = 1e-4, 1e-6  # float rounding: the 8 devices sum the batch in another order
# After 10 Adam steps the weights carry that rounding, amplified where a difference of nearly equal
# numbers is taken (BatchNormalization's variance E[x^2] - E[x]^2): a single sample's outputs show
# it unaveraged (conv1d_batchnorm: 1.2e-4 relative). Losses and metrics are held to RTOL.
PREDICT_RTOL, PREDICT_ATOL = 1e-3, 1e-5

rng = np.random.default_rng(0)


def images(n, size=16, channels=1, classes=10, seed=0):
    """n images of pixel values 0..255 whose brightness depends on their class, and the labels."""
    r = np.random.default_rng(seed)
    y = r.integers(0, classes, n)
    x = r.normal(255 * y[:, None, None, None] / classes, 60, (n, size, size, channels))
    return np.clip(x, 0, 255).round().astype("float32"), y


def tokens(n, length=16, vocabulary=50, seed=0):
    """n integer sequences whose token mix depends on a binary label, and the labels."""
    r = np.random.default_rng(seed)
    y = r.integers(0, 2, n)
    x = r.integers(1, vocabulary // 2, (n, length)) + y[:, None] * r.integers(0, vocabulary // 2, (n, length))
    return x.astype("int32"), y


# ------------------------------------------------------------------------------ custom layers
# As in keras.io's image_classification_with_vision_transformer and mlp_image_classification.

class Patches(layers.Layer):
    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size

    def call(self, images):
        patches = ops.image.extract_patches(images, size=self.patch_size)
        batch, rows, columns, channels = ops.shape(patches)
        return ops.reshape(patches, (batch, rows * columns, channels))


class PatchEncoder(layers.Layer):
    def __init__(self, num_patches, projection_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_patches = num_patches
        self.projection = layers.Dense(units=projection_dim)
        self.position_embedding = layers.Embedding(input_dim=num_patches, output_dim=projection_dim)

    def call(self, patch):
        positions = ops.expand_dims(ops.arange(start=0, stop=self.num_patches, step=1), axis=0)
        return self.projection(patch) + self.position_embedding(positions)


class MLPMixerLayer(layers.Layer):
    def __init__(self, num_patches, hidden_units, dropout_rate, **kwargs):
        super().__init__(**kwargs)
        self.mlp1 = keras.Sequential([layers.Dense(num_patches, activation="gelu"),
                                      layers.Dense(num_patches), layers.Dropout(dropout_rate)])
        self.mlp2 = keras.Sequential([layers.Dense(num_patches, activation="gelu"),
                                      layers.Dense(hidden_units), layers.Dropout(dropout_rate)])
        self.normalize = layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs):
        x = self.normalize(inputs)
        x_channels = ops.transpose(x, axes=(0, 2, 1))  # token mixing across the patches
        mlp1_outputs = ops.transpose(self.mlp1(x_channels), axes=(0, 2, 1))
        x = mlp1_outputs + inputs
        return x + self.mlp2(self.normalize(x))  # channel mixing


# As in keras.io's text_classification_with_transformer.
class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.dropout1(self.att(inputs, inputs), training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = self.pos_emb(ops.arange(start=0, stop=ops.shape(x)[-1], step=1))
        return self.token_emb(x) + positions


# As in keras.io's knowledge_distillation (Keras 3, any backend).
class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False,
                     training=True):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1)) * (self.temperature ** 2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


# As in keras.io's "Customizing what happens in fit() with JAX": a stateless train_step.
class CustomModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y,
                                 training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training)
        return self.loss_fn(y, y_pred), (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        import jax

        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        logs, metrics_variables = self.update_metrics(metrics_variables, loss, y, y_pred)
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables,
                      metrics_variables)

    def test_step(self, state, data):
        trainable_variables, non_trainable_variables, metrics_variables = state
        x, y = data
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=False)
        loss = self.loss_fn(y, y_pred)
        logs, metrics_variables = self.update_metrics(metrics_variables, loss, y, y_pred)
        return logs, (trainable_variables, non_trainable_variables, metrics_variables)

    def update_metrics(self, metrics_variables, loss, y, y_pred):
        loss_tracker_vars = metrics_variables[:len(self.loss_tracker.variables)]
        mae_metric_vars = metrics_variables[len(self.loss_tracker.variables):]
        loss_tracker_vars = self.loss_tracker.stateless_update_state(loss_tracker_vars, loss)
        mae_metric_vars = self.mae_metric.stateless_update_state(mae_metric_vars, y, y_pred)
        logs = {self.loss_tracker.name: self.loss_tracker.stateless_result(loss_tracker_vars),
                self.mae_metric.name: self.mae_metric.stateless_result(mae_metric_vars)}
        return logs, loss_tracker_vars + mae_metric_vars

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


# ---------------------------------------------------------------------------------- families

@dataclass
class Family:
    """build() makes and compiles the model (inside a strategy's scope); data() returns
    ((x, y) training, (x, y) evaluation); fit: more `fit` arguments."""

    build: Callable[[], Any]
    data: Callable[[], tuple]
    fit: dict = field(default_factory=lambda: {"validation_split": VALIDATION_SPLIT})


def cnn_model(input_shape, num_classes):
    return keras.Sequential([
        keras.Input(shape=input_shape),
        layers.Rescaling(1.0 / 255),
        layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(num_classes, activation="softmax"),
    ])


def cnn():
    model = cnn_model((16, 16, 1), 10)
    model.compile(loss="sparse_categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def vit_model(input_shape, num_classes):
    inputs = keras.Input(shape=input_shape)
    patches = Patches(4)(layers.Rescaling(1.0 / 255)(inputs))
    encoded = PatchEncoder(patches.shape[1], 16)(patches)
    x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
    attention = layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=0.1)(x1, x1)
    x2 = layers.Add()([attention, encoded])
    x3 = layers.Dense(16, activation="gelu")(layers.LayerNormalization(epsilon=1e-6)(x2))
    encoded = layers.Add()([layers.Dropout(0.1)(x3), x2])
    representation = layers.Flatten()(layers.LayerNormalization(epsilon=1e-6)(encoded))
    outputs = layers.Dense(num_classes, activation="softmax")(layers.Dropout(0.5)(representation))
    return keras.Model(inputs=inputs, outputs=outputs)


def vit():
    model = vit_model((16, 16, 3), 10)
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=0.001, weight_decay=0.0001),
                  loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    return model


def mlp_mixer():
    inputs = keras.Input(shape=(16, 16, 3))
    x = layers.Dense(units=16)(Patches(4)(layers.Rescaling(1.0 / 255)(inputs)))
    x = keras.Sequential([MLPMixerLayer(16, 16, 0.2) for _ in range(2)])(x)
    representation = layers.Dropout(rate=0.2)(layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inputs=inputs, outputs=layers.Dense(10)(representation))
    model.compile(optimizer=keras.optimizers.Adam(0.005),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")])
    return model


def small_convnet(name, width, input_shape, num_classes):
    return keras.Sequential([
        keras.Input(shape=input_shape),
        layers.Rescaling(1.0 / 255),
        layers.Conv2D(width, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.GlobalMaxPooling2D(),
        layers.Dense(num_classes),
    ], name=name)


def distiller_model(input_shape, num_classes):
    teacher = small_convnet("teacher", 16, input_shape, num_classes)
    student = small_convnet("student", 4, input_shape, num_classes)
    teacher.trainable = False  # trained before, in keras.io's example
    return Distiller(student=student, teacher=teacher)


def compile_distiller(model, optimizer):
    model.compile(optimizer=optimizer, metrics=[keras.metrics.SparseCategoricalAccuracy()],
                  student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10)


def distiller():
    model = distiller_model((16, 16, 1), 10)
    compile_distiller(model, keras.optimizers.Adam())
    model.build((None, 16, 16, 1))
    return model


def regression(n, seed):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 8)).astype("float32")
    return x, (x @ r.normal(size=(8, 1)) + 0.1 * r.normal(size=(n, 1))).astype("float32")


def stateless_train_step():
    inputs = keras.Input(shape=(8,))
    model = CustomModel(inputs, layers.Dense(1)(layers.Dense(16, activation="relu")(inputs)))
    model.compile(optimizer="adam")
    return model


def text_model(input_shape, num_classes):
    inputs = layers.Input(shape=input_shape)
    x = TokenAndPositionEmbedding(input_shape[0], 50, 16)(inputs)
    x = TransformerBlock(16, 2, 16)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dense(8, activation="relu")(layers.Dropout(0.1)(x))
    outputs = layers.Dense(num_classes, activation="softmax")(layers.Dropout(0.1)(x))
    return keras.Model(inputs=inputs, outputs=outputs)


def text_transformer():
    model = text_model((16,), 2)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def bidirectional_lstm():
    inputs = keras.Input(shape=(None,), dtype="int32")
    x = layers.Embedding(50, 8)(inputs)
    x = layers.Bidirectional(layers.LSTM(8))(x)
    model = keras.Model(inputs, layers.Dense(1, activation="sigmoid")(x))
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return model


def series(n, seed, length=32):
    r = np.random.default_rng(seed)
    y = r.integers(0, 2, n)
    t = np.linspace(0, 4 * np.pi, length)
    x = np.sin(t[None] * (1 + y[:, None])) + 0.5 * r.normal(size=(n, length))
    return x[..., None].astype("float32"), y


def conv1d_classifier():
    input_layer = keras.layers.Input((32, 1))
    x = input_layer
    for _ in range(2):
        x = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(x)
        x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    gap = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.models.Model(inputs=input_layer, outputs=keras.layers.Dense(2, activation="softmax")(gap))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return model


def segmentation_data(n, seed):
    x, _ = images(n, channels=3, seed=seed)
    return x, (x[..., 0] > 128).astype("int32") + (x[..., 1] > 200)


def unet():
    inputs = keras.Input(shape=(16, 16, 3))
    skip = layers.Conv2D(8, 3, padding="same", activation="relu")(layers.Rescaling(1.0 / 255)(inputs))
    x = layers.MaxPooling2D(2)(skip)
    x = layers.Conv2D(16, 3, padding="same", activation="relu")(x)
    x = layers.Conv2DTranspose(8, 2, strides=2, padding="same")(x)
    x = layers.concatenate([x, skip])
    outputs = layers.Conv2D(3, 1, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="rmsprop", loss="sparse_categorical_crossentropy")
    return model


def autoencoder_data(n, seed):
    x = images(n, seed=seed)[0]
    return x, x / 255


def autoencoder():
    inputs = layers.Input(shape=(16, 16, 1))
    x = layers.Rescaling(1.0 / 255)(inputs)
    x = layers.Conv2D(8, (3, 3), activation="relu", padding="same")(x)
    x = layers.MaxPooling2D((2, 2), padding="same")(x)
    x = layers.Conv2DTranspose(8, (3, 3), strides=2, activation="relu", padding="same")(x)
    x = layers.Conv2D(1, (3, 3), activation="sigmoid", padding="same")(x)
    model = keras.Model(inputs, x)
    model.compile(optimizer="adam", loss="binary_crossentropy")
    return model


def tickets(n, seed):
    r = np.random.default_rng(seed)
    title, body = tokens(n, 8, seed=seed)[0], tokens(n, 16, seed=seed + 1)[0]
    tags = r.integers(0, 2, (n, 4)).astype("float32")
    return ({"title": title, "body": body, "tags": tags},
            {"priority": r.random((n, 1)).astype("float32"), "department": r.integers(0, 3, n)})


def multi_io():
    title_input = keras.Input(shape=(None,), name="title")
    body_input = keras.Input(shape=(None,), name="body")
    tags_input = keras.Input(shape=(4,), name="tags")
    title_features = layers.LSTM(8)(layers.Embedding(50, 8)(title_input))
    body_features = layers.GlobalAveragePooling1D()(layers.Embedding(50, 8)(body_input))
    x = layers.concatenate([title_features, body_features, tags_input])
    priority_pred = layers.Dense(1, name="priority")(x)
    department_pred = layers.Dense(3, name="department")(x)
    model = keras.Model(inputs={"title": title_input, "body": body_input, "tags": tags_input},
                        outputs={"priority": priority_pred, "department": department_pred})
    model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
                  loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
                        "department": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
                  loss_weights={"priority": 1.0, "department": 0.2})
    return model


def dense_net(dropout=0.0):
    inputs = keras.Input(shape=(8,), name="digits")
    x = layers.Dense(16, activation="relu", name="dense_1")(inputs)
    x = layers.Dropout(dropout)(x) if dropout else x
    x = layers.Dense(16, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(3, activation="softmax", name="predictions")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model


def features(n, seed):
    x, _ = regression(n, seed)
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0)


class ExamplesBatches(keras.utils.PyDataset):
    """The training guide's PyDataset: batches sliced from arrays, in order."""

    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return int(np.ceil(len(self.x) / float(self.batch_size)))

    def __getitem__(self, idx):
        low = idx * self.batch_size
        high = min(low + self.batch_size, len(self.x))
        return self.x[low:high], self.y[low:high]


VALIDATION = EVAL  # the held-out samples of validation_data


def from_pydataset(x, y):
    """Train from a PyDataset, validate on a tf.data.Dataset."""
    import tensorflow as tf

    val = features(VALIDATION, 7)
    return ExamplesBatches(x, y, BATCH), {
        "validation_data": tf.data.Dataset.from_tensor_slices(val).batch(BATCH)}


def from_tf_data(x, y):
    """Train from a tf.data.Dataset, validate on a PyDataset."""
    import tensorflow as tf

    val = features(VALIDATION, 7)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), {
        "validation_data": ExamplesBatches(*val, BATCH)}


def pair(make, **kwargs):
    """data() for a generator of (x, y): SAMPLES to train on and EVAL to evaluate."""
    return lambda: (make(SAMPLES, seed=0, **kwargs), make(EVAL, seed=1, **kwargs))


FAMILIES = {
    "cnn": Family(cnn, pair(images)),
    "vit": Family(vit, pair(images, channels=3)),
    "mlp_mixer": Family(mlp_mixer, pair(images, channels=3)),
    "distiller": Family(distiller, pair(images)),
    "stateless_train_step": Family(stateless_train_step, pair(regression)),
    "text_transformer": Family(text_transformer, pair(tokens)),
    "bidirectional_lstm": Family(bidirectional_lstm, pair(tokens)),
    "conv1d_batchnorm": Family(conv1d_classifier, pair(series)),
    "unet": Family(unet, pair(segmentation_data)),
    "autoencoder": Family(autoencoder, pair(autoencoder_data)),
    "multi_input_output": Family(multi_io, pair(tickets)),
    "pydataset": Family(dense_net, pair(features), {"source": from_pydataset}),
    "tf_data": Family(dense_net, pair(features), {"source": from_tf_data}),
    "dropout_uneven_split": Family(lambda: dense_net(dropout=0.3), pair(features),
                                   {"validation_split": 0.15}),  # 148 train (4 x 32 + 20), 27 val
}


# ---------------------------------------------------------------------------------- the runs

@pytest.fixture(scope="module")
def eight():
    return connect_eight_devices()


def train_and_use(strategy, family, initial, data, fit_in_scope):
    """Build (from `initial` weights, or as seed 1 makes them when None), fit with default
    verbose and seed 2, evaluate, predict; also returns the initial weights."""
    (x, y), (x_eval, y_eval) = data
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = family.build()
        if initial is None:
            initial = model.get_weights()
        model.set_weights(initial)
    kwargs = dict(family.fit)
    source = kwargs.pop("source", None)
    if source is not None:
        x, more = source(x, y)
        y = None
        kwargs.update(more)
    else:
        kwargs["batch_size"] = BATCH
    batch_losses = []
    read_loss = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_losses.append(float(logs["loss"])))
    keras.utils.set_random_seed(2)
    with strategy.scope() if fit_in_scope else contextlib.nullcontext():
        history = model.fit(x, y, epochs=EPOCHS, shuffle=False, callbacks=[read_loss], **kwargs)
        scores = model.evaluate(x_eval, y_eval, batch_size=BATCH, return_dict=True)
        predictions = [model.predict(take(x_eval, n)) for n in (1, 3, EVAL)]
    return history.history, batch_losses, scores, predictions, initial


def take(x, n):
    return keras.tree.map_structure(lambda a: a[:n], x)


def assert_close(a, b, what, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a, "float64"), np.asarray(b, "float64"), rtol=rtol,
                               atol=atol, err_msg=what)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_evaluates_and_predicts_on_eight_devices_as_on_one(eight, name, capsys):
    family = FAMILIES[name]
    data = family.data()
    try:
        single = train_and_use(one_device(eight), family, None, data, fit_in_scope=True)
    finally:
        connect_eight_devices()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "a batch of 12 samples does not split"
        several = train_and_use(eight, family, single[-1], data, fit_in_scope=False)
    output = capsys.readouterr().out
    (h1, b1, s1, p1, _), (h8, b8, s8, p8, _) = single, several

    assert set(h1) == set(h8) and h1, (h1, h8)
    for key in h1:
        assert len(h1[key]) == EPOCHS
        assert_close(h8[key], h1[key], f"{name}: history[{key!r}] on 8 devices vs 1")
    assert "val_loss" in h1
    assert len(b1) == len(b8) == EPOCHS * steps(family, data)
    assert_close(b8, b1, f"{name}: per-batch losses on 8 devices vs 1")
    assert set(s1) == set(s8)
    for key in s1:
        assert_close(s8[key], s1[key], f"{name}: evaluate()[{key!r}] on 8 devices vs 1")
    for n, a, b in zip((1, 3, EVAL), p1, p8):
        for u, v in zip(keras.tree.flatten(a), keras.tree.flatten(b), strict=True):
            assert u.shape[0] == v.shape[0] == n
            assert_close(v, u, f"{name}: predict() on {n} samples on 8 devices vs 1", PREDICT_RTOL,
                         PREDICT_ATOL)
    # Default verbose: Keras' progress and meshfit's per-epoch report, on 1 and on 8 devices.
    assert output.count("Epoch 2/2") == 2, output[-2000:]
    assert len(re.findall(r"^epoch 2/2  .*loss .* ms/step", output, re.M)) == 2, output[-2000:]


def steps(family, data):
    samples = len(keras.tree.flatten(data[0][0])[0])
    train = int(np.floor(samples * (1.0 - family.fit.get("validation_split", 0.0))))  # as Keras
    return -(-train // BATCH)


def test_the_comparison_sees_the_last_partial_batch_dropped(eight):
    """The tolerance is float rounding, not more: training without the epoch's last 2 samples
    (what cutting the batch that does not split 8 ways would do) fails the history comparison."""
    family = Family(dense_net, pair(features), {"validation_data": features(VALIDATION, 7)})
    (x, y), evaluation = family.data()
    try:
        whole, cut = (train_and_use(one_device(eight), family, None, ((x[:n], y[:n]), evaluation),
                                    True)[0] for n in (5 * BATCH + 2, 5 * BATCH))  # the histories
    finally:
        connect_eight_devices()
    for key in ("loss", "val_loss"):
        with pytest.raises(AssertionError):
            assert_close(cut[key], whole[key], key)


# ------------------------------------------------------------------------------- the CLI runs
# A recipe file per family, written from this file's own classes and functions (inspect), as a
# user would: keras imported at the top, custom layers and models defined in the file.

@dataclass
class CliFamily:
    objects: list  # classes and functions the recipe file defines, in order
    build_model: str
    data: str  # an expression of n and seed: (x, y) with pixel values 0..255
    recipe: str = ""  # more Recipe(...) arguments


CLI_FAMILIES = {
    "cnn": CliFamily([images, cnn_model], "cnn_model", "images(n, seed=seed)"),
    "vit": CliFamily([images, Patches, PatchEncoder, vit_model], "vit_model",
                     "images(n, channels=3, seed=seed)"),
}

RECIPE = '''"""NAME: a conformance recipe (tests/test_conformance.py)."""
import keras
import numpy as np
from keras import layers, ops

import meshfit


OBJECTS


def dataset(seed):
    (x, y), (x_test, y_test) = [DATA for n, seed in ((SAMPLES, 0), (EVAL, 1))]
    return (x.astype("uint8"), y), (x_test.astype("uint8"), y_test)


def optimizer(steps_per_epoch, epochs):
    return keras.optimizers.Adam()


RECIPE = meshfit.Recipe(name="NAME", dataset=dataset, build_model=BUILD, optimizer=optimizer,
                        epochs=1, global_batch=BATCH, validation_split=VALIDATION_SPLIT, MORE)
'''


def recipe_text(name):
    import inspect

    family = CLI_FAMILIES[name]
    values = {"NAME": name, "DATA": family.data, "BUILD": family.build_model, "SAMPLES": SAMPLES,
              "EVAL": EVAL, "BATCH": BATCH, "VALIDATION_SPLIT": VALIDATION_SPLIT,
              "MORE": family.recipe, "OBJECTS": "\n\n".join(inspect.getsource(o) for o in family.objects)}
    return re.sub("|".join(values), lambda m: str(values[m.group()]), RECIPE)


def write_inputs(folder, name, count=3):
    """The first `count` test samples of a CLI family as PNG files."""
    from PIL import Image

    x, _ = eval(CLI_FAMILIES[name].data, globals(), {"n": EVAL, "seed": 1})
    paths = []
    for i, sample in enumerate(x[:count].astype("uint8")):
        paths.append(str(folder / f"{name}-{i}.png"))
        Image.fromarray(sample[..., 0] if sample.shape[-1] == 1 else sample).save(paths[-1])
    return paths, x[:count]


@pytest.mark.slow  # three meshfit processes: about 40 s on 2 idle cores
@pytest.mark.parametrize("name", list(CLI_FAMILIES))
def test_recipe_file_trains_on_eight_devices_then_evaluates_and_predicts(tmp_path, name):
    recipe = tmp_path / f"{name}.py"
    recipe.write_text(recipe_text(name))
    run, env = str(tmp_path / "run"), cli_env(tmp_path)
    trained = run_meshfit("train", str(recipe), "--simulate-devices", "8", "--epochs", "1", "--out",
                          run, "--json", env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    metrics = json.loads(trained.stdout.strip().splitlines()[-1])
    assert metrics["replicas"] == 8 and np.isfinite(metrics["test_loss"]), metrics
    assert "oneDNN custom operations" not in trained.stderr  # TensorFlow, seeded by Keras on JAX too, loads quietly

    scored = run_meshfit("eval", run, "--json", env=env)
    assert scored.returncode == 0, scored.stderr[-3000:]
    scores = json.loads(scored.stdout.strip().splitlines()[-1])
    assert scores["samples"] == EVAL
    assert scores["test_accuracy"] == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    assert scores["test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-4)

    paths, _ = write_inputs(tmp_path, name)
    predicted = run_meshfit("predict", run, *paths, "--json", env=env)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    rows = json.loads(predicted.stdout)["predictions"]
    assert [r["image"] for r in rows] == paths
    for row in rows:
        assert row["index"] == int(np.argmax(row["probabilities"]))
