"""Recipe files with models as Keras examples write them: custom keras.ops layers, a subclassed
Distiller with its own compile and compute_loss, a layer without get_config. Each trains on
simulated devices (keras imported at the file's top gets JAX), then eval, predict and export
rebuild the model from the run's recipe copy (meshfit.run.models)."""

import json
import os

import numpy as np
import pytest
from PIL import Image
from helpers import cli_env, run_meshfit

from meshfit.serve import export, inference
from meshfit import recipes
from meshfit.run import rundir
from meshfit.errors import MeshfitError
from meshfit.run.evaluate import evaluate
from meshfit.run.train import train

# Bright or dark 8x8 grey images, in memory; shared by the image recipes below.
IMAGES = '''
def dataset(seed):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 160)
    x = np.clip(70 + 110 * labels[:, None, None, None] + rng.normal(0, 30, (160, 8, 8, 1)), 0, 255)
    return (x[:128].astype("uint8"), labels[:128]), (x[128:].astype("uint8"), labels[128:])


def optimizer(steps_per_epoch, epochs):
    return keras.optimizers.Adam(LEARNING_RATE)
'''

VIT = '''"""vit: a tiny vision transformer with custom keras.ops layers (a test recipe)."""
import keras
import numpy as np
from keras import layers, ops

import meshfit

LEARNING_RATE = 0.01


class Patches(layers.Layer):
    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size

    def call(self, images):
        patches = ops.image.extract_patches(images, size=self.patch_size)
        return ops.reshape(patches, (ops.shape(images)[0], -1, patches.shape[-1]))

    def get_config(self):
        return {**super().get_config(), "patch_size": self.patch_size}


class PatchEncoder(layers.Layer):
    def __init__(self, num_patches, projection_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_patches, self.projection_dim = num_patches, projection_dim
        self.projection = layers.Dense(projection_dim)
        self.position_embedding = layers.Embedding(num_patches, projection_dim)

    def call(self, patches):
        positions = ops.expand_dims(ops.arange(0, self.num_patches), 0)
        return self.projection(patches) + self.position_embedding(positions)

    def get_config(self):
        return {**super().get_config(), "num_patches": self.num_patches,
                "projection_dim": self.projection_dim}
''' + IMAGES + '''

def build_model(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    x = PatchEncoder(4, 16)(Patches(4)(layers.Rescaling(1 / 255)(inputs)))
    x = x + layers.MultiHeadAttention(num_heads=2, key_dim=8)(x, x)
    x = layers.GlobalAveragePooling1D()(layers.LayerNormalization()(x))
    return keras.Model(inputs, layers.Dense(num_classes, activation="softmax")(x))


RECIPE = meshfit.Recipe(name="vit", dataset=dataset, build_model=build_model,
                        optimizer=optimizer, epochs=2, global_batch=32)
'''

# keras.io's knowledge distillation example: the teacher is fitted in prepare(), the Distiller
# (no get_config: it takes two models) compiles with its own signature.
DISTILLER = '''"""distill: a student distilled from a teacher (a test recipe)."""
import keras
import numpy as np
from keras import layers, ops

import meshfit

LEARNING_RATE = 0.1


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher, self.student = teacher, student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
        self.alpha, self.temperature = alpha, temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1)) * self.temperature ** 2
        return self.alpha * self.student_loss_fn(y, y_pred) + (1 - self.alpha) * distillation_loss


    def call(self, x):
        return self.student(x)
''' + IMAGES + '''

def classifier(input_shape, num_classes, hidden):
    return keras.Sequential([keras.Input(input_shape), layers.Rescaling(1 / 127.5, offset=-1),
                             layers.GlobalAveragePooling2D(), *hidden, layers.Dense(num_classes)])


def build_model(input_shape, num_classes):
    teacher = classifier(input_shape, num_classes, [layers.Dense(8, activation="tanh")])
    return Distiller(classifier(input_shape, num_classes, []), teacher)


def prepare(model, dataset):
    x, y = dataset.train
    model.teacher.compile(optimizer=keras.optimizers.Adam(0.02), loss=logits_loss())
    model.teacher.fit(x, y, epochs=10, batch_size=32, verbose=0)
    model.teacher.trainable = False


def logits_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compile(model, optimizer):
    model.compile(optimizer=optimizer, metrics=[keras.metrics.SparseCategoricalAccuracy()],
                  student_loss_fn=logits_loss(), distillation_loss_fn=keras.losses.KLDivergence(),
                  alpha=0.5, temperature=2)


RECIPE = meshfit.Recipe(name="distill", dataset=dataset, build_model=build_model,
                        optimizer=optimizer, epochs=2, global_batch=16, prepare=prepare,
                        compile=compile, loss=logits_loss)
'''

# Token sequences of 8 ids from 20, streamed: class 1 has more ids above 10.
TEXT = '''"""text: an Embedding and a custom TransformerBlock on token ids (a test recipe)."""
import keras
import numpy as np
from keras import layers

import meshfit


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim, self.num_heads, self.ff_dim = embed_dim, num_heads, ff_dim
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                     layers.Dense(embed_dim)])
        self.norm1, self.norm2 = layers.LayerNormalization(), layers.LayerNormalization()

    def call(self, inputs):
        x = self.norm1(inputs + self.att(inputs, inputs))
        return self.norm2(x + self.ffn(x))

    def get_config(self):
        return {**super().get_config(), "embed_dim": self.embed_dim, "num_heads": self.num_heads,
                "ff_dim": self.ff_dim}


def sequences(n, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = np.where(rng.random((n, 8)) < 0.1 + 0.8 * y[:, None], rng.integers(10, 20, (n, 8)),
                 rng.integers(0, 10, (n, 8)))
    return x.astype("int32"), y


def dataset(seed):
    (x, y), (xt, yt) = sequences(128, 0), sequences(32, 1)
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 128, 32)]
    return {"train": lambda: iter(batches), "test": lambda: iter([(xt, yt)]),
            "class_names": ["low", "high"]}


def build_model(input_shape, num_classes):
    inputs = keras.Input(input_shape, dtype="int32")
    x = TransformerBlock(16, 2, 16)(layers.Embedding(20, 16)(inputs))
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, layers.Dense(num_classes, activation="softmax")(x))


def optimizer(steps_per_epoch, epochs):
    return keras.optimizers.Adam(0.01)


RECIPE = meshfit.Recipe(name="text", dataset=dataset, build_model=build_model,
                        optimizer=optimizer, epochs=2)
'''


def train_run(tmp_path, text, devices, *extra):
    """Write the recipe `text`, train it with `meshfit train FILE --simulate-devices N` in a fresh
    process (the engine is chosen there); return (run, metrics)."""
    recipe, run = tmp_path / "recipe.py", str(tmp_path / "run")
    recipe.write_text(text)
    out = run_meshfit("train", str(recipe), "--simulate-devices", str(devices), "--out", run,
                      "--json", "--no-tensorboard", *extra, env=cli_env(tmp_path))
    assert out.returncode == 0, out.stderr
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    config = json.load(open(os.path.join(run, rundir.CONFIG)))
    assert (config["engine"], config["replicas"]) == (metrics["engine"], metrics["replicas"]) == (
        "jax", devices)  # keras imported at the file's top: still JAX, never 1 replica silently
    return run, metrics


def check_eval_and_export(run, metrics):
    """`meshfit eval` scores what training did; `meshfit export --format keras` writes a float32
    copy that the run's recipe loads (in this process: the CLI calls these functions)."""
    assert evaluate(run)["test_accuracy"] == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    assert export.export_keras(run) == os.path.join(run, "model-float32.keras")


def bright_image(tmp_path):
    path = str(tmp_path / "bright.png")
    Image.fromarray(np.full((8, 8), 230, np.uint8)).save(path)
    return path


def test_vit_with_custom_layers_and_keras_at_the_top_trains_on_eight_devices(tmp_path):
    """The file imports keras at its top and defines keras.ops layers: it trains on JAX with 8
    replicas, and eval, predict (through its ONNX export) and export load its layers."""
    run, metrics = train_run(tmp_path, VIT, 8)
    assert metrics["test_accuracy"] >= 0.9, metrics
    check_eval_and_export(run, metrics)
    predicted = run_meshfit("predict", run, bright_image(tmp_path), "--json", env=cli_env(tmp_path))
    assert predicted.returncode == 0 and not predicted.stderr.strip(), predicted.stderr
    result = json.loads(predicted.stdout)
    assert result["backend"] == "onnxruntime" and result["predictions"][0]["label"] == "1"


def test_several_devices_with_keras_backend_tensorflow_are_refused_in_one_line(tmp_path):
    """KERAS_BACKEND=tensorflow (one device in meshfit) and --simulate-devices 4: exit 2 and one
    line naming the fix, before the recipe file runs; never a run on 1 replica."""
    recipe = tmp_path / "vit.py"
    recipe.write_text(VIT)
    out = run_meshfit("train", str(recipe), "--simulate-devices", "4", "--out",
                      str(tmp_path / "run"), env={**cli_env(tmp_path), "KERAS_BACKEND": "tensorflow"})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "meshfit: error: KERAS_BACKEND=tensorflow is set, which trains on one CPU device")
    assert "KERAS_BACKEND=jax" in out.stderr and not os.path.exists(tmp_path / "run")


def test_distiller_with_its_own_compile_trains_evaluates_predicts_and_resumes(tmp_path):
    """A subclassed model without get_config, compiled by the recipe's compile(): saved as its
    weights, rebuilt by build_model for eval, predict and export; --resume extends the run."""
    run, metrics = train_run(tmp_path, DISTILLER, 4)
    assert metrics["test_accuracy"] >= 0.9, metrics
    assert evaluate(run)["test_accuracy"] == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    with pytest.raises(MeshfitError, match="cannot save model Distiller .*use --format onnx"):
        export.export_keras(run)  # a .keras file of its own needs a config; ONNX needs none
    predictor = inference.load_predictor(run, backend="keras")
    assert predictor.predict_files([bright_image(tmp_path)]).argmax() == 1
    resumed = train(resume=run, epochs=3, simulate_devices=8, verbose=False, tensorboard=False)
    assert resumed["epochs"] == 3 and resumed["test_accuracy"] >= 0.9, resumed


def test_text_transformer_on_token_ids_evaluates_and_predicts(tmp_path):
    """An Embedding and a custom TransformerBlock on streamed integer sequences: eval, export
    and a prediction from the run directory."""
    run, metrics = train_run(tmp_path, TEXT, 2)
    assert metrics["test_accuracy"] >= 0.8, metrics
    check_eval_and_export(run, metrics)
    predictor = inference.load_predictor(run, backend="keras")
    high, low = np.full((1, 8), 15, "int32"), np.full((1, 8), 5, "int32")
    assert np.argmax(predictor.predict(np.concatenate([high, low])), axis=-1).tolist() == [1, 0]


def test_a_model_keras_cannot_save_without_a_recipe_file_is_refused_before_training(tmp_path):
    """A Recipe given in Python (no file to rebuild from) whose model has no get_config: one
    line after building it, before config.json is written and training starts."""
    import dataclasses

    path = tmp_path / "distill.py"
    path.write_text(DISTILLER)
    recipe = dataclasses.replace(recipes.load_file(path), text=None, file=None)
    with pytest.raises(MeshfitError, match="cannot save model Distiller .*get_config") as error:
        train(recipe, out=str(tmp_path / "run"), verbose=False, tensorboard=False)
    assert "\n" not in str(error.value)
    assert not os.path.exists(tmp_path / "run" / rundir.CONFIG)



def test_a_model_with_its_own_compile_signature_and_no_recipe_compile_is_one_line(tmp_path):
    """keras-io's Distiller compiles with (optimizer, metrics, student_loss_fn, ...): a recipe file
    without Recipe(compile=...) is refused in one line saying what to add, before training."""
    path = tmp_path / "distill.py"
    path.write_text(DISTILLER.replace("compile=compile, ", ""))
    out = run_meshfit("train", str(path), "--out", str(tmp_path / "run"), "--simulate-devices", "2",
                      env=cli_env(tmp_path), timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "meshfit: error: Distiller.compile() has its own arguments (optimizer, metrics, student_loss_fn, "
        "distillation_loss_fn, alpha, temperature) and no 'loss'; say how to compile it in the recipe: "
        "meshfit.Recipe(..., compile=lambda model, optimizer: model.compile(optimizer=optimizer, ...))")
