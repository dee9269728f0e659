"""A user's own recipe file: trained from the CLI and Python, copied into the run directory so that
resume, eval and predict work after the original moves, and its callbacks' state checkpointed."""

import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image
from helpers import BRIGHT_OR_DARK_DATASET, KILL_AT_CALLBACKS, cli_env, run_meshfit

from meshfit.data import folder_scan, splits as data
from meshfit import recipes
from meshfit.run import rundir, spec
from meshfit.errors import MeshfitError

# A linear model telling bright from dark 8x8 grey images; data from a callable, in memory.
TINY_RECIPE = '''"""tiny: bright or dark 8x8 images (a test recipe)."""
import numpy as np

import meshfit


''' + BRIGHT_OR_DARK_DATASET + '''

def build_model(input_shape, num_classes):
    import keras

    return keras.Sequential([keras.Input(input_shape), keras.layers.Rescaling(1 / 127.5, offset=-1),
                             keras.layers.Flatten(),
                             keras.layers.Dense(num_classes, activation="softmax")])


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.Adam(0.02)


def callbacks():
    import keras

    # Never improves by 100 after its first epoch: stops at the end of the second.
    return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=100.0)]


RECIPE = meshfit.Recipe(name="tiny", dataset=dataset, build_model=build_model,
                        optimizer=optimizer, epochs=EPOCHS, global_batch=16, callbacks=CALLBACKS)
'''


def write_recipe(folder, epochs=4, callbacks=False):
    path = os.path.join(folder, "tiny.py")
    text = TINY_RECIPE.replace("EPOCHS", str(epochs)).replace(
        "CALLBACKS", "callbacks" if callbacks else "None")
    with open(path, "w") as f:
        f.write(text)
    return path


def test_recipe_file_runs_on_after_the_original_is_moved(tmp_path):
    """Train from the CLI, move the file away: resume, eval and predict (by class name) still work
    from the run's own copy; an edited copy is refused with one line."""
    recipe = write_recipe(tmp_path, epochs=2)
    run, env = str(tmp_path / "run"), cli_env(tmp_path, engine="tensorflow")
    out = run_meshfit("train", recipe, "--out", run, "--epochs", "1", "--json", env=env)
    assert out.returncode == 0, out.stderr
    config = json.load(open(os.path.join(run, rundir.CONFIG)))
    assert config["recipe"] == "tiny" and config["recipe_file"] == rundir.RECIPE
    assert config["recipe_sha256"] == rundir.file_sha256(os.path.join(run, rundir.RECIPE))
    assert open(os.path.join(run, rundir.RECIPE)).read() == open(recipe).read()
    shutil.move(recipe, tmp_path / "elsewhere.py")

    resumed = run_meshfit("train", "--resume", run, "--epochs", "2", "--json", env=env)
    assert resumed.returncode == 0, resumed.stderr
    metrics = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert metrics["epochs"] == 2 and metrics["test_accuracy"] >= 0.9, metrics

    scored = run_meshfit("eval", run, "--json", env=env)
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout.strip().splitlines()[-1])["test_accuracy"] == pytest.approx(
        metrics["test_accuracy"], abs=1e-6)

    Image.fromarray(np.full((8, 8), 230, np.uint8)).save(tmp_path / "bright.png")
    predicted = run_meshfit("predict", run, str(tmp_path / "bright.png"), "--json", env=env)
    assert predicted.returncode == 0, predicted.stderr
    assert json.loads(predicted.stdout)["predictions"][0]["label"] == "1"

    with open(os.path.join(run, rundir.RECIPE), "a") as f:
        f.write("# edited\n")
    refused = run_meshfit("eval", run, env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "was changed after the run started" in refused.stderr.strip().splitlines()[-1]


def test_early_stopping_decides_after_a_resume_as_without_it(tmp_path):
    """A recipe's EarlyStopping keeps its counters through a checkpoint: the run stopped after one
    epoch and resumed stops where the uninterrupted run did (Keras alone would count afresh)."""
    from meshfit.run.train import train

    recipe = write_recipe(tmp_path, epochs=4, callbacks=True)
    whole = train(recipe, out=str(tmp_path / "whole"), simulate_devices=8, engine="jax",
                  verbose=False, tensorboard=False)
    history = json.load(open(tmp_path / "whole" / rundir.HISTORY))
    assert [r["epoch"] for r in history] == [1, 2]  # stopped early, at the end of epoch 2

    train(recipe, out=str(tmp_path / "cut"), epochs=1, simulate_devices=8, engine="jax",
          verbose=False, tensorboard=False)
    resumed = train(resume=str(tmp_path / "cut"), epochs=4, simulate_devices=8, engine="jax",
                    verbose=False, tensorboard=False)
    history = json.load(open(tmp_path / "cut" / rundir.HISTORY))
    assert [r["epoch"] for r in history] == [1, 2]
    assert resumed["test_accuracy"] == pytest.approx(whole["test_accuracy"], abs=1e-6)

    # Stopped after the save at the stop (epoch 2's), before its final files (a Ctrl-C, a kill):
    # resumed from that save, it trains no epoch 3, as the uninterrupted run did not.
    os.remove(tmp_path / "whole" / "metrics.json")
    again = train(resume=str(tmp_path / "whole"), simulate_devices=8, engine="jax", verbose=False,
                  tensorboard=False)
    history = json.load(open(tmp_path / "whole" / rundir.HISTORY))
    assert [r["epoch"] for r in history] == [1, 2]
    assert again["test_accuracy"] == pytest.approx(whole["test_accuracy"], abs=1e-6)


def test_resuming_with_the_recipe_file_runs_only_the_runs_copy(tmp_path):
    """`meshfit train FILE --resume RUN` with the file unchanged does not execute FILE again (its
    hash names it); the run's copy alone trains."""
    from meshfit.run.train import train

    recipe, counter = write_recipe(tmp_path, epochs=2), tmp_path / "executed"
    with open(recipe, "a") as f:
        f.write(f"open({str(counter)!r}, 'a').write('x')\n")
    train(recipe, out=str(tmp_path / "run"), epochs=1, engine="jax", verbose=False,
          tensorboard=False)
    counter.write_text("")
    train(recipe, resume=str(tmp_path / "run"), epochs=2, engine="jax", verbose=False,
          tensorboard=False)
    assert counter.read_text() == "x"


@pytest.mark.parametrize("text, message", [
    ("x = 1\n", "defines no RECIPE = meshfit.Recipe(...)"),
    ("import meshfit\n\nRECIPE = 1 / 0\n", ".py:3 failed: ZeroDivisionError"),
    ("RECIPE = (\n", ".py:1 failed: SyntaxError"),
])
def test_a_broken_recipe_file_is_one_line_naming_the_file(tmp_path, text, message):
    path = tmp_path / "mine.py"
    path.write_text(text)
    with pytest.raises(MeshfitError, match=None) as error:
        recipes.load(str(path))
    assert message in str(error.value) and str(path) in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("fields, message", [
    ("dataset='mnist', build_model=lambda *_: None, optimizer='adam'",
     "Recipe optimizer must be a function optimizer(steps_per_epoch, epochs)"),
    ("dataset='mnist', build_model=keras.Sequential(), optimizer=lambda *_: None",
     "Recipe build_model must be a function build_model(input_shape, num_classes)"),
    ("dataset=((1, 2), (3, 4)), build_model=lambda *_: None, optimizer=lambda *_: None",
     "Recipe dataset must be a built-in name, a folder of images or a function dataset(seed)"),
])
def test_a_result_given_for_a_recipe_function_is_one_line(tmp_path, fields, message):
    """An optimizer object or name, a built model, the dataset function's result: a Python
    traceback deep in training before (exit 1), now one line naming the field."""
    path = tmp_path / "mine.py"
    path.write_text(f"import keras\nimport meshfit\nRECIPE = meshfit.Recipe(name='r', {fields}, epochs=1)\n")
    with pytest.raises(MeshfitError) as error:
        recipes.load(str(path))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert str(error.value).endswith("pass the function itself, not its result")


def test_every_builtin_recipe_printed_is_a_recipe_file(tmp_path):
    for name in recipes.names():
        path = tmp_path / f"{name}.py"
        path.write_text(recipes.source(name))
        loaded = recipes.load(str(path))
        assert loaded.name == name and loaded.file == str(path)
        assert loaded.text == path.read_text()


IMAGES = np.zeros((6, 4, 4, 1), np.uint8)


@pytest.mark.parametrize("y_train, x_test, message", [
    (np.zeros(5, np.int32), IMAGES, "returned 6 training images and 5 labels; return one label per image"),
    (np.eye(2, dtype=np.int32)[[0, 1, 0, 1, 0, 1]], IMAGES, "class labels of shape \\(6, 2\\) \\(one-hot\\?\\)"),
    (np.full(6, 0.5, np.float32), IMAGES, "labels that are not whole numbers for a sparse categorical loss"),
    (np.zeros(6, np.int32), np.zeros((6, 5, 5, 1), np.uint8), "test images of shape \\(5, 5, 1\\) and training"),
])
def test_a_dataset_callables_bad_labels_or_shapes_are_one_line(y_train, x_test, message):
    """Each failed deep in Keras' first step (or evaluation), after the run's start."""
    with pytest.raises(MeshfitError, match=message):
        data._arrays(((IMAGES, y_train), (x_test, np.zeros(6, np.int32))), "sparse_categorical_crossentropy")


def test_whole_number_float_labels_are_classes_under_a_sparse_categorical_loss():
    """Labels read from a CSV file come as floats: classes for the default loss, targets for mse."""
    floats = np.array([0, 2, 1, 0, 1, 2], np.float32)
    classes = data._arrays(((IMAGES, floats), (IMAGES, floats)), "sparse_categorical_crossentropy")
    assert classes.y_train.dtype == np.int32 and classes.class_names == ("0", "1", "2")
    targets = data._arrays(((IMAGES, floats), (IMAGES, floats)), "mse")
    assert targets.y_train.dtype == np.float32 and targets.class_names == ()


def test_validation_split_holds_out_a_seeded_share_of_the_training_data():
    x = np.arange(200, dtype=np.uint8).reshape(200, 1, 1, 1)
    y = np.arange(200, dtype=np.int32)
    (x_train, y_train), (x_val, y_val) = data.split_arrays(x, y, 0.25, seed=3)
    assert len(y_val) == 50 and len(y_train) == 150
    assert set(y_val.tolist()).isdisjoint(y_train.tolist())
    assert np.array_equal(x_val[:, 0, 0, 0], y_val.astype(np.uint8))
    again = data.split_arrays(x, y, 0.25, seed=3)[1][1]
    other = data.split_arrays(x, y, 0.25, seed=4)[1][1]
    assert np.array_equal(again, y_val) and not np.array_equal(other, y_val)


def test_validation_split_is_recorded_and_scored_with_the_test_set(tmp_path):
    """With --validation-split the per-epoch val_* come from held-out training data, the test set
    is scored once at the end, and both land in metrics.json."""
    from meshfit.run.train import train

    recipe = write_recipe(tmp_path, epochs=1)
    metrics = train(recipe, out=str(tmp_path / "run"), validation_split=0.25, simulate_devices=8,
                    engine="jax", verbose=False, tensorboard=False)
    saved, _ = spec.read(str(tmp_path / "run"))
    assert saved.validation_split == 0.25 and saved.evaluated_on == "validation"
    assert metrics["validation_samples"] == 32 and metrics["test_samples"] == 32
    history = json.load(open(tmp_path / "run" / rundir.HISTORY))
    assert history[-1]["val_accuracy"] == pytest.approx(metrics["validation_accuracy"])


# A folder recipe whose callbacks() kills its own process at (epoch, batch) $KILL_AT, for the test.
FOLDER_RECIPE = '''"""pets: a small CNN on a folder of PNGs next to this file (a test recipe)."""
import os

import meshfit


def build_model(input_shape, num_classes):
    import keras
    from keras import layers

    return keras.Sequential([keras.Input(input_shape), layers.Rescaling(1 / 127.5, offset=-1),
                             layers.Conv2D(8, 3, activation="relu"), layers.MaxPooling2D(),
                             layers.Flatten(), layers.Dropout(0.2),
                             layers.Dense(num_classes, activation="softmax")])


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.Adam(0.01)


''' + KILL_AT_CALLBACKS + '''

RECIPE = meshfit.Recipe(name="pets", dataset="pets", image_size=(12, 12), channels=3,
                        build_model=build_model, optimizer=optimizer, epochs=2, global_batch=8,
                        validation_split=0.25, augment="flip-crop", crop_padding=2,
                        callbacks=callbacks)
'''


def write_pets(folder, per_class=32):
    """PNGs of two classes, dark and light, of mixed sizes and modes, in folder/pets/<class>/."""
    rng = np.random.default_rng(0)
    for label, name in enumerate(["dark", "light"]):
        os.makedirs(os.path.join(folder, "pets", name))
        for i in range(per_class):
            base = 60 + 130 * label
            pixels = np.clip(base + rng.normal(0, 25, (14 + i % 5, 13, 3)), 0, 255).astype("uint8")
            image = Image.fromarray(pixels)
            image = image.convert("L") if i % 7 == 0 else image
            image.save(os.path.join(folder, "pets", name, f"{i}.png"))


@pytest.mark.slow
def test_folder_recipe_killed_at_random_resumes_bit_identical(tmp_path):
    """A recipe file reading a folder of PNGs beside it (relative path, flip-crop, validation split),
    SIGKILLed mid-epoch 2 and resumed from its copy after the original moved: the same weights as
    an uninterrupted run."""
    from meshfit.run import checkpoint_format

    write_pets(tmp_path)
    recipe = tmp_path / "pets.py"
    recipe.write_text(FOLDER_RECIPE)
    env = cli_env(tmp_path, engine="tensorflow")
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    out = run_meshfit("train", str(recipe), "--out", whole, "--checkpoint-every", "2", env=env)
    assert out.returncode == 0, out.stderr
    step = int(np.random.default_rng().integers(1, 6))
    out = run_meshfit("train", str(recipe), "--out", killed, "--checkpoint-every", "2",
                      env={**env, "KILL_AT": f"1,{step}"})
    assert out.returncode == -9, out.stderr
    os.rename(recipe, tmp_path / "moved.py")
    out = run_meshfit("train", "--resume", killed, "--json", env=env)
    assert out.returncode == 0, out.stderr
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert metrics["validation_samples"] == 16 and metrics["evaluated_on"] == "validation"
    assert metrics["dataset"] == str(tmp_path / "pets") and metrics["validation_accuracy"] >= 0.9
    a = checkpoint_format.read_arrays(checkpoint_format.latest(os.path.join(whole, "checkpoints")))
    b = checkpoint_format.read_arrays(checkpoint_format.latest(os.path.join(killed, "checkpoints")))
    assert sorted(a) == sorted(b)
    assert not [k for k in a if not np.array_equal(a[k], b[k])]


def test_data_folder_trains_with_validation_curves_and_predicts_by_class_name(tmp_path):
    """`meshfit train --data FOLDER --image-size H W`: no code, a validation split, curves, and a
    run directory whose recipe.py and class names serve predict."""
    write_pets(tmp_path)
    run, env = str(tmp_path / "run"), cli_env(tmp_path, engine="tensorflow")
    out = run_meshfit("train", "--data", str(tmp_path / "pets"), "--image-size", "12", "12",
                      "--epochs", "10", "--global-batch", "8", "--out", run, "--json", env=env)
    assert out.returncode == 0, out.stderr
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert "(no test set, so none is scored)" in out.stdout and "test set scored" not in out.stdout
    assert metrics["class_names"] == ["dark", "light"] and metrics["input_shape"] == [12, 12, 3]
    assert metrics["evaluated_on"] == "validation" and metrics["validation_samples"] == 12  # 20% of each class
    assert metrics["validation_accuracy"] >= 0.9, metrics
    history = json.load(open(os.path.join(run, rundir.HISTORY)))
    assert len(history) == 10 and all("val_accuracy" in record for record in history)
    assert os.path.getsize(os.path.join(run, rundir.CURVES)) > 0
    assert recipes.load_file(os.path.join(run, rundir.RECIPE)).image_size == (12, 12)

    Image.fromarray(np.full((20, 20, 3), 200, np.uint8)).save(tmp_path / "bright.png")
    predicted = run_meshfit("predict", run, str(tmp_path / "bright.png"), "--json", env=env)
    assert predicted.returncode == 0, predicted.stderr
    assert json.loads(predicted.stdout)["predictions"][0]["label"] == "light"


def test_data_needs_an_image_size_and_no_recipe(tmp_path):
    write_pets(tmp_path, per_class=2)
    env = cli_env(tmp_path, engine="tensorflow")
    for args, message in ((["--data", str(tmp_path / "pets")], "--data needs --image-size H W"),
                          (["fashion-mnist-cnn", "--data", str(tmp_path / "pets"), "--image-size",
                            "8", "8"], "one of them"),
                          (["--image-size", "8", "8"], "go with --data FOLDER")):
        out = run_meshfit("train", *args, env=env)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert message in out.stderr.strip().splitlines()[-1]


def test_early_stopping_restores_the_same_best_weights_after_a_resume(tmp_path):
    """EarlyStopping(restore_best_weights=True) keeps its best weights (arrays) through a
    checkpoint: a run stopped mid-epoch 2 and resumed ends with the uninterrupted run's weights,
    both the restored best (model.keras) and the last epoch's (the final checkpoint)."""
    import signal

    import keras

    from meshfit.run import checkpoint_format
    from meshfit import TrainingInterrupted
    from meshfit.run.train import train

    recipe = write_recipe(tmp_path, epochs=3, callbacks=True)
    text = open(recipe).read().replace(  # epoch 1 is the best; never stops early
        "patience=1, min_delta=100.0)", "patience=5, min_delta=100.0, restore_best_weights=True)")
    open(recipe, "w").write(text)

    class StopAt(keras.callbacks.Callback):  # SIGTERM at epoch 2, step 3: save and stop there
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if (self.epoch, batch) == (1, 3):
                os.kill(os.getpid(), signal.SIGTERM)

    options = dict(simulate_devices=8, engine="jax", verbose=False, tensorboard=False,
                   checkpoint_every="epoch")
    train(recipe, out=str(tmp_path / "whole"), **options)
    with pytest.raises(TrainingInterrupted):
        train(recipe, out=str(tmp_path / "cut"), callbacks=[StopAt()], **options)
    train(resume=str(tmp_path / "cut"), **options)
    for run in ("whole", "cut"):
        assert [r["epoch"] for r in json.load(open(tmp_path / run / rundir.HISTORY))] == [1, 2, 3]
    weights = [keras.saving.load_model(tmp_path / run / rundir.MODEL).get_weights()
               for run in ("whole", "cut")]
    assert all(np.array_equal(a, b) for a, b in zip(*weights))
    last = [checkpoint_format.read_arrays(checkpoint_format.latest(tmp_path / run / rundir.CHECKPOINTS))
            for run in ("whole", "cut")]
    assert not [k for k in last[0] if not np.array_equal(last[0][k], last[1][k])]
    assert not np.array_equal(last[0]["model/00000"], weights[0][0])  # the best is not the last


def test_folder_recipe_holds_out_a_share_and_evaluates_moved_and_on_another_folder(tmp_path, capsys):
    """A recipe file over a folder that sets no validation_split holds out 20% as `--data` does
    (val_* curves); `meshfit eval` scores its run after the file moved away, and on another
    folder with the run's class names (other classes: one line, exit 2). In this process."""
    from meshfit import cli
    from helpers import connect_eight_devices

    write_pets(tmp_path, per_class=10)
    recipe = tmp_path / "pets.py"
    recipe.write_text(FOLDER_RECIPE.replace("validation_split=0.25, ", "").replace(
        "epochs=2", "epochs=1"))
    run, devices = str(tmp_path / "run"), ["--simulate-devices", "8", "--engine", "jax"]
    try:
        assert cli.main(["train", str(recipe), "--out", run, "--no-tensorboard", *devices]) == 0
        config = json.load(open(os.path.join(run, rundir.CONFIG)))
        assert config["validation_split"] == 0.2 and config["evaluated_on"] == "validation"
        history = json.load(open(os.path.join(run, rundir.HISTORY)))
        assert "val_accuracy" in history[-1], history
        os.rename(recipe, tmp_path / "moved.py")
        capsys.readouterr()

        assert cli.main(["eval", run, "--json", *devices]) == 0
        scores = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert scores["split"] == "validation" and scores["samples"] == 4  # 2 of 10 per class

        write_pets(tmp_path / "other", per_class=3)
        assert cli.main(["eval", run, "--data", str(tmp_path / "other" / "pets"), "--json",
                         *devices]) == 0
        scores = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert scores["split"] == "test" and scores["samples"] == 6
        assert scores["data"] == str(tmp_path / "other" / "pets")

        for name in ("cats", "dogs"):
            os.makedirs(tmp_path / "animals" / name)
            Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "animals" / name / "0.png")
        assert cli.main(["eval", run, "--data", str(tmp_path / "animals"), *devices]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cats, dogs" in err[0] and "dark, light" in err[0], err
    finally:
        connect_eight_devices()


def test_a_folder_scored_by_name_is_labelled_with_the_runs_classes(tmp_path):
    """eval --data maps class folders to the run's label order by name; fewer classes are fine."""
    write_pets(tmp_path, per_class=2)
    os.makedirs(tmp_path / "pets" / "medium")
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "pets" / "medium" / "0.png")
    scored = data.other_folder(str(tmp_path / "pets"), ("light", "medium", "dark", "x"), (8, 8, 3))
    assert scored.test.class_names == scored.class_names == ("light", "medium", "dark", "x")
    assert list(scored.test.labels) == [2, 2, 0, 0, 1] and scored.validation is None
    with pytest.raises(MeshfitError, match="not images"):
        data.other_folder(str(tmp_path / "pets"), ("dark", "light", "medium"), (784,))
    # new photos of a single class are scored too (training on such a folder is refused)
    shutil.rmtree(tmp_path / "pets" / "dark"), shutil.rmtree(tmp_path / "pets" / "light")
    one = data.other_folder(str(tmp_path / "pets"), ("dark", "medium"), (8, 8, 3))
    assert list(one.test.labels) == [1]
    with pytest.raises(MeshfitError, match="single class folder"):
        folder_scan.scan(tmp_path / "pets")
