"""Recipe files whose dataset(seed) returns streamed sources (meshfit.data.streams): a PyDataset, tf.data,
a generator function, Grain; trained from the CLI and Python, resumed after SIGKILL or SIGTERM."""

import json
import os
import signal

import numpy as np
import pytest
from helpers import KILL_AT_CALLBACKS, cli_env, run_meshfit

from meshfit.run import checkpoint_format, rundir
from meshfit.data import splits as data
from meshfit import recipes
from meshfit.errors import MeshfitError

# The data, model and optimizer of the test recipes: bright or dark 8x8 images, logistic regression.
IMAGES = '''def images(seed, n):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    x = np.clip(70 + 110 * labels[:, None, None, None] + rng.normal(0, 30, (n, 8, 8, 1)), 0, 255)
    return x.astype("uint8"), labels.astype("int32")
'''

DENSE_MODEL = '''def build_model(input_shape, num_classes):
    import keras

    return keras.Sequential([keras.Input(input_shape), keras.layers.Rescaling(1 / 127.5, offset=-1),
                             keras.layers.Flatten(), keras.layers.Dropout(0.2),
                             keras.layers.Dense(num_classes, activation="softmax")])


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.Adam(0.01)
'''

# 203 training images in batches of 16: 12 of 16 and a last one of 11, cut to 8 on 8 devices.
# Test batches of 16 (45 images: the last of 13). callbacks() SIGKILLs its process at $KILL_AT.
PYDATASET_RECIPE = '''"""streamy: bright or dark 8x8 images from a PyDataset (a test recipe)."""
import os

import numpy as np

import meshfit

BATCH = 16


''' + IMAGES + '''

def dataset(seed):
    import keras

    class Batches(keras.utils.PyDataset):
        def __init__(self, x, y):
            super().__init__(workers=2)
            self.x, self.y = x, y

        def __len__(self):
            return -(-len(self.x) // BATCH)

        def __getitem__(self, i):
            return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]

    return {"train": Batches(*images(seed, 203)), "test": Batches(*images(seed + 1, 45)),
            "class_names": ["dark", "bright"]}


''' + DENSE_MODEL + '''

''' + KILL_AT_CALLBACKS + '''

RECIPE = meshfit.Recipe(name="streamy", dataset=dataset, build_model=build_model,
                        optimizer=optimizer, epochs=2, callbacks=callbacks)
'''


def final_arrays(run):
    return checkpoint_format.read_arrays(checkpoint_format.latest(os.path.join(run, rundir.CHECKPOINTS)))


def same_arrays(a, b):
    return sorted(a) == sorted(b) and not [k for k in a if not np.array_equal(a[k], b[k])]


@pytest.mark.slow
def test_pydataset_recipe_trains_and_resumes_after_sigkill_bit_identical(tmp_path):
    """On 8 simulated devices the last batch (11) is cut to 8 with one warning; a run SIGKILLed
    mid-epoch 2 resumes to the uninterrupted run's weights (a PyDataset is read by index)."""
    recipe = tmp_path / "streamy.py"
    recipe.write_text(PYDATASET_RECIPE)
    env = cli_env(tmp_path)
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    out = run_meshfit("train", str(recipe), "--out", whole, "--checkpoint-every", "3", "--json",
                      env=env)
    assert out.returncode == 0, out.stderr
    assert "a batch of 11 samples does not split across 8 replicas: using 8 of them" in out.stderr
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert metrics["replicas"] == 8 and metrics["steps_per_epoch"] == 13
    assert metrics["global_batch"] == 16 and metrics["input_shape"] == [8, 8, 1]
    assert metrics["test_samples"] == 45 and metrics["test_accuracy"] >= 0.95, metrics
    assert metrics["class_names"] == ["dark", "bright"]
    assert os.path.isfile(os.path.join(whole, rundir.METRICS))

    step = int(np.random.default_rng().integers(1, 13))
    out = run_meshfit("train", str(recipe), "--out", killed, "--checkpoint-every", "3",
                      env={**env, "KILL_AT": f"1,{step}"})
    assert out.returncode == -9, out.stderr
    out = run_meshfit("train", "--resume", killed, "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert "resuming the recipe's train source" not in out.stderr  # exact: no warning
    resumed = json.loads(out.stdout.strip().splitlines()[-1])
    assert resumed["test_accuracy"] == metrics["test_accuracy"]
    assert same_arrays(final_arrays(whole), final_arrays(killed)), f"killed at step {step}"


def test_pydataset_recipe_trains_on_the_default_engine(tmp_path):
    """One CPU, meshfit's own engine choice (TensorFlow): every sample of the short batch trains."""
    recipe = tmp_path / "streamy.py"
    recipe.write_text(PYDATASET_RECIPE)
    run = str(tmp_path / "run")
    out = run_meshfit("train", str(recipe), "--out", run, "--json",
                      env=cli_env(tmp_path, engine="tensorflow"))
    assert out.returncode == 0, out.stderr
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert metrics["engine"] == "tensorflow" and metrics["replicas"] == 1
    assert metrics["steps_per_epoch"] == 13 and metrics["test_accuracy"] >= 0.95, metrics
    assert "does not split" not in out.stderr
    assert "val_* on the test set each epoch (no validation split or source given)" in out.stdout
    scored = run_meshfit("eval", run, "--json", env=cli_env(tmp_path, engine="tensorflow"))
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout.strip().splitlines()[-1])["test_accuracy"] == pytest.approx(
        metrics["test_accuracy"], abs=1e-6)


# tf.data train batches, shuffled by epoch (a function of the epoch), and a validation generator.
TFDATA_RECIPE = '''"""tfdata: bright or dark 8x8 images from tf.data (a test recipe)."""
import numpy as np

import meshfit


''' + IMAGES + '''

def dataset(seed):
    import tensorflow as tf

    x, y = images(seed, 203)
    vx, vy = images(seed + 1, 37)

    def train(epoch):
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(203, seed=seed + epoch).batch(16)

    def validation():
        for i in range(0, 37, 10):
            yield vx[i:i + 10], vy[i:i + 10]

    return {"train": train, "validation": validation, "class_names": ["dark", "bright"]}


''' + DENSE_MODEL + '''

RECIPE = meshfit.Recipe(name="tfdata", dataset=dataset, build_model=build_model,
                        optimizer=optimizer, epochs=2)
'''


def test_tf_data_recipe_trains_and_resumes_mid_epoch(tmp_path):
    """A function of the epoch returning a tf.data.Dataset: steps counted by one pass; stopped by
    SIGTERM mid-epoch 2 and resumed by reading that epoch again and skipping what was trained,
    with one warning; the same weights as the uninterrupted run (the source is deterministic)."""
    import keras

    from meshfit import TrainingInterrupted
    from meshfit.run.train import train

    pytest.importorskip("tensorflow")
    recipe = tmp_path / "tfdata.py"
    recipe.write_text(TFDATA_RECIPE)

    class StopAt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if (self.epoch, batch) == (1, 5):  # saved and stopped before step 6
                os.kill(os.getpid(), signal.SIGTERM)

    options = dict(simulate_devices=8, engine="jax", verbose=False, tensorboard=False,
                   checkpoint_every="epoch")
    whole = train(str(recipe), out=str(tmp_path / "whole"), **options)
    assert whole["steps_per_epoch"] == 13 and whole["evaluated_on"] == "validation"
    assert whole["validation_samples"] == 37 and whole["validation_accuracy"] >= 0.95, whole
    with pytest.raises(TrainingInterrupted):
        train(str(recipe), out=str(tmp_path / "cut"), callbacks=[StopAt()], **options)
    with pytest.warns(UserWarning, match="reading epoch 2 from its start and skipping its first 6"):
        resumed = train(resume=str(tmp_path / "cut"), **options)
    assert resumed["validation_accuracy"] == whole["validation_accuracy"]
    assert same_arrays(final_arrays(tmp_path / "whole"), final_arrays(tmp_path / "cut"))


def test_grain_recipe_trains_on_eight_devices(tmp_path):
    """A grain.MapDataset of batches, read by index, with a grain test set."""
    grain = pytest.importorskip("grain")
    from meshfit.run.train import train

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 130)
    x = rng.normal(0, 0.3, (130, 4)).astype("float32")
    x[np.arange(130), labels] += 3  # feature k is high for class k

    def dataset(seed):
        def batches(lo, hi):
            return grain.MapDataset.range(lo, hi).map(lambda i: (x[i], labels[i])).batch(20)

        return {"train": batches(0, 100), "test": batches(100, 130), "class_names": ["a", "b", "c"]}

    def build_model(input_shape, num_classes):
        import keras

        return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(num_classes, "softmax")])

    def optimizer(steps_per_epoch, epochs):
        import keras

        return keras.optimizers.Adam(0.1)

    recipe = recipes.Recipe(name="grainy", dataset=dataset, build_model=build_model,
                            optimizer=optimizer, epochs=4)
    metrics = train(recipe, out=str(tmp_path / "run"), simulate_devices=8, engine="jax",
                    verbose=False, tensorboard=False)
    assert metrics["steps_per_epoch"] == 5 and metrics["global_batch"] == 16  # 20 cut to 16
    assert metrics["input_shape"] == [4] and metrics["test_samples"] == 30
    assert metrics["test_accuracy"] >= 0.9, metrics


def _recipe(dataset, **changes):
    return recipes.Recipe(name="bad", dataset=dataset, build_model=lambda *_: None,
                          optimizer=lambda *_: None, epochs=1, **changes)


def _batches():
    yield np.zeros((4, 2, 2, 1), "uint8"), np.zeros(4, "int32")


@pytest.mark.parametrize("returned, changes, message", [
    ({"train": _batches, "classes": ["a", "b"]}, {}, "unknown keys classes"),
    ({"test": _batches, "class_names": ["a", "b"]}, {}, 'has no "train" source'),
    ({"train": _batches}, {}, '"class_names"'),
    ({"train": _batches(), "class_names": ["a", "b"]}, {}, "return the generator function itself"),
    ({"train": 3, "class_names": ["a", "b"]}, {}, "the recipe's train source is a int"),
    ({"train": lambda: [np.zeros(3)], "class_names": ["a", "b"]}, {}, "yield (x, y)"),
    ({"train": _batches, "test": lambda: iter([(np.zeros((2, 1)), np.array([0, 5]))]),
      "class_names": ["a", "b"]}, {}, "labels 0 to 5 but 2 class names"),
    ({"train": _batches, "class_names": ["a", "b"]}, {"validation_split": 0.2},
     "a \"validation\" source"),
])
def test_bad_streamed_sources_are_one_line_errors(returned, changes, message):
    with pytest.raises(MeshfitError) as error:
        data.load(_recipe(lambda seed: returned, **changes), None, 0)
    assert message in str(error.value) and "\n" not in str(error.value)


# A label per position (a language model's next tokens): token sequences of 6, each token the one
# before plus 1 (mod 8), batches of 16; 45 test sequences, the last batch of 13.
SEQUENCE_RECIPE = '''"""next: the next token at every position (a test recipe)."""
import numpy as np

import meshfit


def sequences(seed, n):
    start = np.random.default_rng(seed).integers(0, 8, (n, 1))
    tokens = (start + np.arange(7)) % 8
    return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")


def dataset(seed):
    def batches(x, y):
        return lambda: ((x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16))

    return {"train": batches(*sequences(seed, 160)), "test": batches(*sequences(seed + 1, 45)),
            "class_names": [str(t) for t in range(8)]}


def build_model(input_shape, num_classes):
    import keras

    tokens = keras.Input(input_shape, dtype="int32")
    return keras.Model(tokens, keras.layers.Dense(num_classes)(keras.layers.Embedding(8, 16)(tokens)))


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.Adam(0.05)


def loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


RECIPE = meshfit.Recipe(name="next", dataset=dataset, build_model=build_model, optimizer=optimizer,
                        loss=loss, epochs=3, input_shape=(6,))
'''


def test_a_label_per_position_is_scored_on_every_sequence_once(tmp_path):
    """A test source of 45 sequences x 6 positions: 45 samples (not the 270 labels: Keras was
    asked for 270 / 16 batches of 3 and warned "Your input ran out of data"; with a last batch
    short of 16, its padding rows stayed among the outputs and the score failed), every position
    scored; the lines call them samples, not images."""
    recipe = tmp_path / "next.py"
    recipe.write_text(SEQUENCE_RECIPE)
    run, changes = str(tmp_path / "run"), cli_env(tmp_path, engine="tensorflow")
    out = run_meshfit("train", str(recipe), "--out", run, env=changes)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ran out of data" not in out.stdout + out.stderr, out.stdout + out.stderr
    metrics = json.load(open(os.path.join(run, "metrics.json")))
    assert metrics["test_samples"] == 45 and metrics["test_accuracy"] > 0.9, metrics
    assert "of 16 samples (global batch)" in out.stdout and "(45 samples); wrote" in out.stdout
    scored = run_meshfit("eval", run, env=changes)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert f"test accuracy {metrics['test_accuracy']:.4f}" in scored.stdout
    assert "(45 samples)" in scored.stdout
    # its ONNX copy is checked on int32 token ids (float32 inputs were refused by the copy);
    # meshfit predict, which answers image files, says so in one line (a traceback before)
    exported = run_meshfit("export", run, "--format", "onnx", env=changes)
    assert exported.returncode == 0, exported.stderr[-2000:]
    from PIL import Image

    Image.new("L", (8, 8)).save(tmp_path / "x.png")
    refused = run_meshfit("predict", run, str(tmp_path / "x.png"), env=changes)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "takes inputs of shape (6,), not images" in refused.stderr
