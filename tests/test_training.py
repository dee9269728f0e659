"""`meshfit train` / `meshfit eval` (meshfit.run.train) on small generated data."""

import glob
import json
import os

import numpy as np
import pytest
from helpers import N_TEST, N_TRAIN, cli_env, read_scalars, run_meshfit
from PIL import Image

from meshfit.data import datasets
from meshfit.errors import MeshfitError


def test_parse_checkpoint_every():
    from meshfit.run.spec import parse_every

    assert parse_every("200") == (200, None, True)
    assert parse_every("60s") == (None, 60.0, True)
    assert parse_every("5m") == (None, 300.0, True)
    assert parse_every("epoch") == (None, None, True)
    assert parse_every("off") == (None, None, False)
    for bad in ("0", "-3", "10x", "1.5"):
        with pytest.raises(MeshfitError, match="--checkpoint-every"):
            parse_every(bad)


def test_synthetic_recipe_points_to_bench():
    from meshfit.run.train import train

    with pytest.raises(MeshfitError, match="meshfit bench resnet50-synthetic"):
        train("resnet50-synthetic")


@pytest.fixture(scope="module")
def cli_run(data_dir, tmp_path_factory):
    """One `meshfit train` on the default CPU engine (tensorflow), its run directory and output."""
    tmp = tmp_path_factory.mktemp("cli")
    run = tmp / "run"
    out = run_meshfit("train", "--data-dir", data_dir, "--out", str(run), "--epochs", "2",
                      "--global-batch", "32", "--micro-batches", "2", "--json", "--profile", "2:5",
                      "--log-every", "2", env=cli_env(tmp, "tensorflow"))
    assert out.returncode == 0, out.stderr
    return run, out


def test_train_writes_the_run_directory(cli_run):
    run, out = cli_run
    for name in ("model.keras", "config.json", "history.json", "metrics.json", "curves.png"):
        assert (run / name).is_file(), name
    metrics = json.loads((run / "metrics.json").read_text())
    assert json.loads(out.stdout.strip().splitlines()[-1]) == metrics  # --json: the last line
    for key in ("test_accuracy", "test_loss", "train_accuracy", "train_seconds", "compile_seconds",
                "samples_per_second", "platform", "device_kind", "replicas", "precision", "engine",
                "epochs"):
        assert metrics[key] is not None, key
    assert metrics["engine"] == "tensorflow" and metrics["replicas"] == 1 and metrics["epochs"] == 2
    assert metrics["micro_batches"] == 2  # each batch of 32 trained as two slices of 16
    assert "gradients summed over 2 cache-sized micro-batches" in out.stdout
    assert 0.0 <= metrics["test_accuracy"] <= 1.0
    config = json.loads((run / "config.json").read_text())
    assert config["recipe"] == "fashion-mnist-cnn" and config["global_batch"] == 32
    assert config["micro_batches"] == 2
    assert config["steps_per_epoch"] == N_TRAIN // 32 and config["seed"] == 0
    assert config["class_names"][0] == "T-shirt/top" and config["input_shape"] == [28, 28, 1]
    assert config["command"].startswith("meshfit train")
    history = json.loads((run / "history.json").read_text())
    assert [r["epoch"] for r in history] == [1, 2]
    assert history[-1]["val_accuracy"] == metrics["test_accuracy"]
    assert sum(1 for line in out.stdout.splitlines() if line.startswith("epoch ")) == 2


def test_train_writes_tensorboard_scalars_and_a_profile(cli_run):
    run, _ = cli_run
    scalars = read_scalars(run / "tensorboard")
    steps = N_TRAIN // 32
    assert [step for step, _ in scalars["train/loss"]] == list(range(2, 2 * steps + 1, 2))
    for tag in ("epoch/loss", "epoch/val_loss", "epoch/val_accuracy", "epoch/learning_rate",
                "speed/samples_per_second", "speed/ms_per_step"):
        assert [step for step, _ in scalars[tag]] == [steps, 2 * steps], tag
    history = json.loads((run / "history.json").read_text())
    assert [v for _, v in scalars["epoch/val_accuracy"]] == pytest.approx([r["val_accuracy"] for r in history])
    assert scalars["epoch/learning_rate"][0][1] == pytest.approx(3e-3)
    traces = glob.glob(str(run / "tensorboard" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert traces and os.path.getsize(traces[0]) > 0


def test_monitoring_is_on_process_0_only_and_tensorboard_can_be_off(tmp_path):
    from meshfit.run.keras_side.fit_and_score import monitoring

    on = monitoring(str(tmp_path), True, False, None, 32, 4, True, 10, (2, 3))
    assert [type(c).__name__ for c in on.before + on.after] == ["Profile", "TensorBoardLog"]
    off = monitoring(str(tmp_path), True, False, None, 32, 4, False, 10, None)
    assert off.before == off.after == []
    assert monitoring(str(tmp_path), False, True, None, 32, 4, True, 10, (2, 3)).after == []


def test_bad_profile_steps_are_a_one_line_error(tmp_path):
    out = run_meshfit("train", "--profile", "7:5", "--out", str(tmp_path / "run"),
                      env=cli_env(tmp_path), timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0
    assert "--profile '7:5'" in out.stderr and "START:STOP" in out.stderr
    assert not (tmp_path / "run").exists()


def test_curves_png_is_a_real_plot(cli_run):
    run, _ = cli_run
    with Image.open(run / "curves.png") as image:
        assert image.format == "PNG" and image.size == (1000, 400)
        pixels = np.asarray(image.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20  # lines, text and axes, not blank


def test_eval_matches_metrics_json(cli_run, tmp_path):
    run, _ = cli_run
    out = run_meshfit("eval", str(run), "--json", env=cli_env(tmp_path, "tensorflow"))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    metrics = json.loads((run / "metrics.json").read_text())
    assert result["samples"] == N_TEST
    assert result["test_accuracy"] == metrics["test_accuracy"]
    assert result["test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-5)


def test_train_on_eight_devices(strategy, data_dir, tmp_path, capsys):
    from meshfit.run.evaluate import evaluate
    from meshfit.run.train import train

    metrics = train(data_dir=data_dir, out=str(tmp_path / "run"), epochs=1, global_batch=64,
                    engine="jax", simulate_devices=8, checkpoint_every="off")
    assert metrics["replicas"] == 8 and metrics["engine"] == "jax"
    assert metrics["steps_per_epoch"] == N_TRAIN // 64
    assert "replicas         8" in capsys.readouterr().out
    assert [step for step, _ in read_scalars(tmp_path / "run" / "tensorboard")["epoch/val_loss"]] == [2]
    again = evaluate(str(tmp_path / "run"))
    assert again["test_accuracy"] == metrics["test_accuracy"]
    assert again["test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-5)


def test_batch_that_does_not_split_is_a_one_line_error(tmp_path):
    out = run_meshfit("train", "--global-batch", "100", "--simulate-devices", "8", "--no-batch-rounding",
                      env={**cli_env(tmp_path), "XLA_FLAGS": ""}, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "global batch 100 does not split evenly across 8 replicas" in out.stderr


def test_bad_micro_batch_count_is_a_one_line_error(tmp_path):
    out = run_meshfit("train", "--micro-batches", "0", env=cli_env(tmp_path), timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "micro-batches must be a whole number of at least 1" in out.stderr


def test_image_folder_of_pngs_trains_on_eight_devices(strategy, tmp_path):
    """A user's own folder of PNGs (one sub-folder per class) trains through meshfit."""
    from meshfit.fit.predict import predict
    from meshfit.recipes import fashion_mnist_cnn

    rng = np.random.default_rng(0)
    for label, name in enumerate(["dark", "light"]):
        os.makedirs(tmp_path / "pets" / name)
        for i in range(40):
            base = 60 + 130 * label
            pixels = np.clip(base + rng.normal(0, 25, (20 + i % 5, 18, 3)), 0, 255).astype("uint8")
            Image.fromarray(pixels).save(tmp_path / "pets" / name / f"{i}.png")
    data = datasets.image_folder(tmp_path / "pets", (16, 16), validation_split=0.25, seed=0)
    assert data.class_names == ("dark", "light") and data.x_train.shape[1:] == (16, 16, 3)

    with strategy.scope():
        model = fashion_mnist_cnn.build_model(data.input_shape, data.num_classes)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    strategy.fit(model, data.x_train, data.y_train, batch_size=16, epochs=8, report=False)
    probabilities = predict(model, data.x_test, global_batch=16)  # 20 images: padded for 8 devices
    accuracy = float((probabilities.argmax(1) == data.y_test).mean())
    assert accuracy >= 0.9, accuracy


@pytest.mark.parametrize("shape, flat", [((1, 1, 1), 64), ((8, 8, 3), 2 * 2 * 64), ((9, 30, 1), 3 * 8 * 64),
                                         ((10, 10, 1), 1 * 1 * 64), ((28, 28, 1), 5 * 5 * 64)])
def test_the_folder_cnn_takes_images_of_any_size(shape, flat):
    """`--data --image-size 8 8` (8x8 digits) ended in Keras' error at the build: under 10 pixels
    a side its convolutions and poolings are padded; from 10 on it is unchanged."""
    from meshfit.recipes import image_folder

    model = image_folder.build_cnn(shape, num_classes=3)
    assert model.get_layer(index=5).output.shape == (None, flat)  # Flatten's features
    assert model.predict(np.zeros((2,) + shape, np.uint8), verbose=0).shape == (2, 3)


def test_steps_per_dispatch_divide_the_epoch_and_default_by_platform():
    from meshfit.parallel.planning import plan_steps_per_dispatch

    assert plan_steps_per_dispatch("gpu", "jax", 48) == 24  # 2 calls per epoch, so compile is timed apart
    assert plan_steps_per_dispatch("gpu", "jax", 390) == 30  # at most 32, dividing 390
    assert plan_steps_per_dispatch("cpu", "jax", 48) == 1
    assert plan_steps_per_dispatch("cpu", "jax", 48, 5) == 4
    with pytest.raises(MeshfitError, match="steps per dispatch must be a whole number of at least 1"):
        plan_steps_per_dispatch("gpu", "jax", 48, 0)
