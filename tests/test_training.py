"""`meshfit train` / `meshfit eval` and the input pipeline, on small generated data."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import meshfit
from meshfit import datasets
from meshfit.errors import MeshfitError

N_TRAIN, N_TEST = 128, 37  # 37: not a multiple of any batch used here


def write_fashion(root, n_train=N_TRAIN, n_test=N_TEST, seed=0):
    """A tiny Fashion-MNIST in the canonical layout under root/fashion-mnist/."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "fashion-mnist")
    os.makedirs(folder, exist_ok=True)
    labels = [rng.integers(0, 10, n, dtype=np.uint8) for n in (n_train, n_test)]
    # Class-dependent brightness, so a trained model does better than chance.
    images = [np.clip(rng.normal(20 * y[:, None, None], 40, (len(y), 28, 28)), 0, 255).astype(np.uint8)
              for y in labels]
    for name, array in zip(datasets.IDX_FILES, (images[0], labels[0], images[1], labels[1])):
        datasets.write_idx(os.path.join(folder, name), array)
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_fashion(str(tmp_path_factory.mktemp("data")))


def cli_env(tmp_path, engine=None):
    """Subprocess environment: no downloads, no real ~/.keras; one CPU device for tensorflow."""
    env = {**os.environ, "MESHFIT_OFFLINE": "1", "HOME": str(tmp_path),
           "MESHFIT_CACHE": str(tmp_path / "cache")}
    env.pop("MESHFIT_DATA", None)
    if engine == "tensorflow":
        env.pop("KERAS_BACKEND", None)  # let meshfit choose: tensorflow on a single CPU
        env["XLA_FLAGS"] = ""
    return env


def run_cli(*args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "meshfit", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture
def strategy():
    """The 8 simulated devices, made the active Keras distribution again for each test."""
    return meshfit.connect(simulate=8, engine="jax", verbose=False)


# -------------------------------------------------------------------------------------- pipeline

@pytest.mark.parametrize("on_device", [True, False])
def test_each_epoch_is_a_permutation_fixed_by_seed_and_epoch(strategy, on_device):
    from meshfit.pipeline import TrainBatches

    x = np.arange(103, dtype=np.uint8).reshape(103, 1, 1, 1)
    y = np.arange(103, dtype=np.int32)
    batches = TrainBatches(x, y, global_batch=16, seed=5, on_device=on_device)
    assert len(batches) == 103 // 16  # the last partial batch is dropped
    epoch0 = np.concatenate([np.asarray(batches.batch(0, s)[1]) for s in range(len(batches))])
    assert len(set(epoch0.tolist())) == len(epoch0) == 6 * 16  # no sample twice
    assert sorted(batches.order(0).tolist()) == list(range(103))  # every sample in the order
    assert not np.array_equal(batches.order(0), batches.order(1))
    again = TrainBatches(x, y, global_batch=16, seed=5, on_device=on_device)
    np.testing.assert_array_equal(again.order(3), batches.order(3))
    other_seed = TrainBatches(x, y, global_batch=16, seed=6, on_device=on_device)
    assert not np.array_equal(other_seed.order(0), batches.order(0))
    images, labels = (np.asarray(a) for a in batches.batch(1, 2))
    np.testing.assert_array_equal(images.reshape(-1), labels)  # images travel with their labels


def test_start_mid_epoch_equals_the_tail_of_a_full_epoch(strategy):
    from meshfit.pipeline import TrainBatches

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (70, 8, 8, 3), dtype=np.uint8)
    y = rng.integers(0, 10, 70).astype(np.int32)
    batches = TrainBatches(x, y, global_batch=8, seed=1, augment="flip-crop")
    steps = len(batches)
    full = [batches.batch(e, s) for e in (2, 3) for s in range(steps)]
    started = batches.iterate(2, 3)
    tail = [next(started) for _ in range(len(full) - 3)]
    for (xa, ya), (xb, yb) in zip(full[3:], tail):
        np.testing.assert_array_equal(np.asarray(xa), np.asarray(xb))
        np.testing.assert_array_equal(np.asarray(ya), np.asarray(yb))


@pytest.mark.parametrize("padding, flips", [(4, "random"), (2, "alternate")])
def test_device_batches_are_sharded_and_equal_to_host_batches(strategy, padding, flips):
    from meshfit import pipeline

    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (50, 12, 12, 3), dtype=np.uint8)
    y = np.arange(50, dtype=np.int32)
    settings = dict(seed=2, augment="flip-crop", crop_padding=padding, flips=flips)
    device = pipeline.TrainBatches(x, y, 16, on_device=True, **settings)
    host = pipeline.TrainBatches(x, y, 16, on_device=False, **settings)
    images, labels = device.batch(1, 2)
    assert {s.data.shape[0] for s in images.addressable_shards} == {2}  # 16 over 8 devices
    host_images, host_labels = host.batch(1, 2)
    np.testing.assert_array_equal(np.asarray(images), host_images)
    np.testing.assert_array_equal(np.asarray(labels), host_labels)
    # Every augmented image is a 12x12 crop of its reflect-padded original, maybe mirrored.
    changed = 0
    size = 2 * padding + 1
    for image, label in zip(host_images, host_labels):
        padded = np.pad(x[label], ((padding, padding), (padding, padding), (0, 0)), mode="reflect")
        crops = [padded[r:r + 12, c:c + 12] for r in range(size) for c in range(size)]
        assert any(np.array_equal(image, c) or np.array_equal(image, c[:, ::-1]) for c in crops)
        changed += not np.array_equal(image, x[label])
    assert changed > 8  # the augmentation really moves and flips images


def test_alternate_flips_mirror_each_image_every_other_epoch():
    from meshfit import pipeline

    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (40, 6, 6, 1), dtype=np.uint8)
    y = np.arange(40, dtype=np.int32)
    batches = pipeline.TrainBatches(x, y, 8, seed=5, augment="flip-crop", crop_padding=0,
                                    flips="alternate", on_device=False)

    def mirrored(epoch):
        state = {}
        for step in range(len(batches)):
            images, labels = batches.batch(epoch, step)
            for image, label in zip(images, labels):
                assert np.array_equal(image, x[label]) or np.array_equal(image, x[label][:, ::-1])
                state[int(label)] = not np.array_equal(image, x[label])
        return np.array([state[i] for i in range(40)])

    epochs = [mirrored(e) for e in range(3)]
    assert 10 < epochs[0].sum() < 30  # about half of the images start mirrored
    np.testing.assert_array_equal(epochs[1], ~epochs[0])
    np.testing.assert_array_equal(epochs[2], epochs[0])


def test_bad_augmentation_settings_are_clear_errors():
    from meshfit.pipeline import TrainBatches

    x, y = np.zeros((16, 8, 8, 3), np.uint8), np.zeros(16, np.int32)
    with pytest.raises(MeshfitError, match="unknown flips 'sometimes'"):
        TrainBatches(x, y, 8, augment="flip-crop", flips="sometimes", on_device=False)
    with pytest.raises(MeshfitError, match="crop padding 8 does not fit 8x8 images"):
        TrainBatches(x, y, 8, augment="flip-crop", crop_padding=8, on_device=False)


@pytest.mark.parametrize("on_device", [True, False])
def test_evaluation_covers_every_sample_once(strategy, on_device):
    import keras

    from meshfit import pipeline

    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (N_TEST, 4, 4, 1), dtype=np.uint8)
    batches = pipeline.EvalBatches(x, batch=16, on_device=on_device)
    assert len(batches) == 3  # 16 + 16 + 5 real samples (and 11 padding)
    seen = np.concatenate([np.asarray(b[0]) for b in batches.iterate()])
    np.testing.assert_array_equal(batches.trim(seen), x)
    mirrored = np.concatenate([np.asarray(b[0]) for b in batches.iterate(flip=True)])
    np.testing.assert_array_equal(batches.trim(mirrored), x[:, :, ::-1])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Flatten(),
                                  keras.layers.Dense(3)])
    outputs = pipeline.predict(model, batches)
    assert outputs.shape == (N_TEST, 3)
    kernel, bias = model.get_weights()  # (Keras' own predict fails here: 37 does not split by 8)
    np.testing.assert_allclose(outputs, x.reshape(N_TEST, -1) @ kernel + bias, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------------------- train

def test_parse_checkpoint_every():
    from meshfit.training import parse_every

    assert parse_every("200") == (200, None, True)
    assert parse_every("60s") == (None, 60.0, True)
    assert parse_every("5m") == (None, 300.0, True)
    assert parse_every("epoch") == (None, None, True)
    assert parse_every("off") == (None, None, False)
    for bad in ("0", "-3", "10x", "1.5"):
        with pytest.raises(MeshfitError, match="--checkpoint-every"):
            parse_every(bad)


def test_synthetic_recipe_points_to_bench():
    from meshfit.training import train

    with pytest.raises(MeshfitError, match="meshfit bench resnet50-synthetic"):
        train("resnet50-synthetic")


@pytest.fixture(scope="module")
def cli_run(data_dir, tmp_path_factory):
    """One `meshfit train` on the default CPU engine (tensorflow), its run directory and output."""
    tmp = tmp_path_factory.mktemp("cli")
    run = tmp / "run"
    out = run_cli("train", "--data-dir", data_dir, "--out", str(run), "--epochs", "2",
                  "--batch-size", "32", "--micro-batches", "2", "--json", env=cli_env(tmp, "tensorflow"))
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


def test_curves_png_is_a_real_plot(cli_run):
    run, _ = cli_run
    with Image.open(run / "curves.png") as image:
        assert image.format == "PNG" and image.size == (1000, 400)
        pixels = np.asarray(image.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20  # lines, text and axes, not blank


def test_eval_matches_metrics_json(cli_run, tmp_path):
    run, _ = cli_run
    out = run_cli("eval", str(run), "--json", env=cli_env(tmp_path, "tensorflow"))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    metrics = json.loads((run / "metrics.json").read_text())
    assert result["samples"] == N_TEST
    assert result["test_accuracy"] == metrics["test_accuracy"]
    assert result["test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-5)


def test_train_on_eight_devices(strategy, data_dir, tmp_path, capsys):
    from meshfit.training import evaluate, train

    metrics = train(data_dir=data_dir, out=str(tmp_path / "run"), epochs=1, batch_size=64,
                    engine="jax", simulate_devices=8, checkpoint_every="off")
    assert metrics["replicas"] == 8 and metrics["engine"] == "jax"
    assert metrics["steps_per_epoch"] == N_TRAIN // 64
    assert "replicas         8" in capsys.readouterr().out
    again = evaluate(str(tmp_path / "run"))
    assert again["test_accuracy"] == metrics["test_accuracy"]
    assert again["test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-5)


def test_batch_that_does_not_split_is_a_one_line_error(tmp_path):
    out = run_cli("train", "--batch-size", "100", "--simulate-devices", "8", "--no-batch-rounding",
                  env={**cli_env(tmp_path), "XLA_FLAGS": ""}, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "global batch 100 does not split evenly across 8 replicas" in out.stderr


def test_bad_micro_batch_count_is_a_one_line_error(tmp_path):
    out = run_cli("train", "--micro-batches", "0", env=cli_env(tmp_path), timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "micro-batches must be a whole number of at least 1" in out.stderr


def test_image_folder_of_pngs_trains_on_eight_devices(tmp_path):
    """A user's own folder of PNGs (one sub-folder per class) trains through meshfit."""
    from meshfit import pipeline
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

    strategy = meshfit.connect(simulate=8, engine="jax", verbose=False)
    with strategy.scope():
        model = fashion_mnist_cnn.build_model(data.input_shape, data.num_classes)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    strategy.fit(model, data.x_train, data.y_train, batch_size=16, epochs=8, report=False)
    probabilities = pipeline.predict(model, data.x_test, batch=16)  # 20 images: padded for 8 devices
    accuracy = float((probabilities.argmax(1) == data.y_test).mean())
    assert accuracy >= 0.9, accuracy


def test_steps_per_dispatch_divide_the_epoch_and_default_by_platform():
    from types import SimpleNamespace

    from meshfit.training import choose_steps_per_dispatch

    gpu, cpu = SimpleNamespace(platform="gpu", engine="jax"), SimpleNamespace(platform="cpu", engine="jax")
    assert choose_steps_per_dispatch(gpu, 48) == 24  # 2 calls per epoch, so compile is timed apart
    assert choose_steps_per_dispatch(gpu, 390) == 30  # at most 32, dividing 390
    assert choose_steps_per_dispatch(cpu, 48) == 1
    assert choose_steps_per_dispatch(cpu, 48, 5) == 4
    with pytest.raises(MeshfitError, match="steps per dispatch must be a whole number of at least 1"):
        choose_steps_per_dispatch(gpu, 48, 0)
