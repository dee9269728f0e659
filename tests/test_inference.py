"""CPU inference: `meshfit predict`, `meshfit export`, ONNX Runtime against Keras."""

import contextlib
import json
import shutil
import warnings

import numpy as np
import pytest
from helpers import BRIGHT_OR_DARK_DATASET, run_meshfit
from PIL import Image

from meshfit import MeshfitError
from meshfit.serve import export, inference
from meshfit.run import models, rundir
from meshfit.recipes import cifar10_cnn, fashion_mnist_cnn, mnist_mlp_bf16

CLASS_NAMES = ["plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
ONE_DEVICE = {"XLA_FLAGS": ""}  # the CLI on one CPU device, not the tests' 8 simulated ones


@contextlib.contextmanager
def policy(name):
    """Build models under dtype policy `name` on the CPU, outside any distribution."""
    import keras

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        with models.on_cpu(keras):
            yield keras
    finally:
        keras.config.set_dtype_policy(previous)


def randomize_batchnorm(model, seed):
    """Non-trivial BatchNorm statistics, so that exports must carry them."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        if "moving_variance" in v.path:
            v.assign(rng.uniform(0.5, 2.0, v.shape).astype("float32"))
        elif "moving_mean" in v.path:
            v.assign(rng.normal(0.0, 0.1, v.shape).astype("float32"))


def make_confident(model, images):
    """Rescale and center the last Dense layer on `images`, so that its answers are confident
    and differ from image to image (a random CNN otherwise gives every image the same class)."""
    import keras

    features = np.asarray(keras.Model(model.inputs[0], model.layers[-3].output)(images))
    dense = model.layers[-2]
    kernel, _ = dense.get_weights()
    logits = features @ kernel
    scale = 5 / logits.std(0).mean()
    dense.set_weights([kernel * scale, -logits.mean(0) * scale])


def smooth_images(n, seed, size=32):
    """n smooth random RGB images (uint8, NHWC): 4x4 random colours upsampled, bilinear."""
    small = np.random.default_rng(seed).integers(0, 256, (n, 4, 4, 3), dtype=np.uint8)
    return np.stack([np.asarray(Image.fromarray(s).resize((size, size), Image.Resampling.BILINEAR))
                     for s in small])


@pytest.fixture(scope="module")
def cifar_run(tmp_path_factory):
    """A run directory (model.keras + config.json) of the CIFAR-10 CNN, three PNGs and the
    Keras probabilities for them."""
    run = tmp_path_factory.mktemp("run")
    with policy("float32") as keras:
        keras.utils.set_random_seed(0)
        model = cifar10_cnn.build_model()
        randomize_batchnorm(model, seed=0)
        make_confident(model, smooth_images(16, seed=1).astype("float32"))
        model.save(run / "model.keras")
        images = smooth_images(3, seed=2)
        expected = np.asarray(model.predict_on_batch(images.astype("float32")))
    (run / "config.json").write_text(json.dumps({
        "recipe": "cifar10-cnn", "dataset": "cifar10", "class_names": CLASS_NAMES,
        "input_shape": [32, 32, 3]}))
    paths = []
    for i, image in enumerate(images):
        paths.append(str(run / f"image{i}.png"))
        Image.fromarray(image).save(paths[-1])
    return run, paths, expected


def test_cli_predict_prints_the_class_keras_gives(cifar_run):
    run, paths, expected = cifar_run
    # as a user runs it (the suite quiets TensorFlow for itself)
    out = run_meshfit("predict", str(run), *paths, "--json", env={**ONE_DEVICE, "TF_CPP_MIN_LOG_LEVEL": None})
    assert out.returncode == 0, out.stderr
    # the export to ONNX in this first predict runs in TensorFlow: none of its C++ log lines
    assert not [line for line in out.stderr.splitlines() if ".cc:" in line], out.stderr
    result = json.loads(out.stdout)
    assert len(set(expected.argmax(1))) == 3  # each image has its own answer
    assert result["backend"] == "onnxruntime"
    assert (run / "model.onnx").is_file()  # exported on first predict and cached
    for row, p in zip(result["predictions"], expected):
        assert row["label"] == CLASS_NAMES[int(np.argmax(p))]
        np.testing.assert_allclose(row["probabilities"], p, atol=export.ONNX_TOLERANCE)
        np.testing.assert_allclose([t["probability"] for t in row["top_k"]],
                                   np.sort(p)[::-1][:3], atol=export.ONNX_TOLERANCE)


def test_cli_predict_top_k_text_and_show_picture(cifar_run, tmp_path):
    run, paths, expected = cifar_run
    picture = tmp_path / "out.png"
    out = run_meshfit("predict", str(run), *paths[:2], "--top-k", "4", "--show", str(picture),
                      env=ONE_DEVICE)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 * (1 + 4) + 1
    assert lines[-1] == f"answered on the CPU by ONNX Runtime ({run / 'model.onnx'})"
    for block, path, p in zip((lines[:5], lines[5:10]), paths, expected):
        order = np.argsort(-p)[:4]
        assert block[0].startswith(f"{path}: {CLASS_NAMES[order[0]]} (")
        assert [line.split()[0] for line in block[1:]] == [CLASS_NAMES[i] for i in order]
        assert float(block[1].split()[1]) == pytest.approx(p[order[0]], abs=1e-4)
    with Image.open(picture) as im:
        assert im.format == "PNG"
        pixels = np.asarray(im.convert("RGB"))
    assert pixels.shape[0] > 100 and pixels.std() > 10  # a drawn picture, not a blank canvas


def test_onnx_runtime_equals_keras(cifar_run):
    run, _, _ = cifar_run
    fast = inference.load_predictor(run, backend="onnx")
    slow = inference.load_predictor(run, backend="keras")
    assert (fast.backend, slow.backend) == ("onnxruntime", "keras")
    assert fast.class_names == slow.class_names == tuple(CLASS_NAMES)
    x = smooth_images(16, seed=3)
    p_fast, p_slow = fast.predict(x), slow.predict(x)
    assert p_fast.shape == (16, 10) and p_fast.dtype == np.float32
    np.testing.assert_allclose(p_fast, p_slow, atol=export.ONNX_TOLERANCE)
    assert len(set(p_fast.argmax(1))) > 1  # the images get different answers
    np.testing.assert_allclose(fast.predict(x[0]), p_slow[:1], atol=export.ONNX_TOLERANCE)  # one (H, W, C) image


def test_changed_keras_model_makes_the_onnx_copy_stale(cifar_run, tmp_path):
    run, _, _ = cifar_run
    inference.load_predictor(run, backend="onnx")  # the cached copy exists and is current
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    assert inference.load_predictor(copy, backend="onnx", export=False).backend == "onnxruntime"
    with policy("float32"):
        model = cifar10_cnn.build_model()
        model.save(copy / "model.keras")
    with pytest.raises(MeshfitError, match="no up-to-date ONNX copy"):
        inference.load_predictor(copy, backend="onnx", export=False)


def test_mixed_bfloat16_model_exports_as_float32(tmp_path):
    source = str(tmp_path / "mlp.keras")
    with policy("mixed_bfloat16"):
        model = mnist_mlp_bf16.build_model()
        assert model.layers[2].compute_dtype == "bfloat16"
        model.save(source)
        x = np.random.default_rng(4).integers(0, 256, (8, 28, 28, 1)).astype("float32")
        p_bf16 = np.asarray(model.predict_on_batch(x))

    path = export.export_keras(source)
    assert path == str(tmp_path / "mlp-float32.keras")
    loaded = models.load_keras_model(path)
    assert {layer.dtype_policy.name for layer in loaded.layers} == {"float32"}
    with policy("float32"):
        p_float32 = np.asarray(loaded.predict_on_batch(x))
    np.testing.assert_allclose(p_float32, p_bf16, atol=0.05)  # same model, more precise

    assert export.export_onnx(source) == str(tmp_path / "mlp.onnx")  # child process on TF
    onnx_predictor = inference.load_predictor(source, backend="onnx", export=False)
    assert onnx_predictor.class_names == tuple(str(i) for i in range(10))  # bare file: indices
    np.testing.assert_allclose(onnx_predictor.predict(x), p_float32, atol=export.ONNX_TOLERANCE)


def test_bare_keras_file_reads_any_image_as_the_models_input(tmp_path):
    source = tmp_path / "fashion.keras"
    with policy("float32"):
        model = fashion_mnist_cnn.build_model()
        model.save(source)
    picture = tmp_path / "photo.jpg"
    rgb = np.random.default_rng(7).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(picture)
    predictor = inference.load_predictor(source, backend="keras")
    assert predictor.input_shape == (28, 28, 1)
    assert predictor.class_names == tuple(str(i) for i in range(10))
    x = inference.load_images([str(picture)], predictor.input_shape)
    assert x.shape == (1, 28, 28, 1) and x.dtype == np.uint8
    grey = np.asarray(Image.open(picture).convert("L").resize((28, 28), Image.Resampling.BILINEAR))
    # decoded as image folders are for training: libjpeg's luma, close to Pillow's convert("L")
    assert np.abs(x[0, ..., 0].astype(int) - grey).mean() < 0.5
    np.testing.assert_allclose(predictor.predict_files([str(picture)]), predictor.predict(x))


@pytest.mark.parametrize("name, content, message", [
    ("notes.txt", b"shopping: milk", "cannot read image {} (not an image file: no PNG, JPEG"),
    ("bad.png", b"not an image", "cannot read image {} (not an image file"),
    ("bad.png", None, "image {} not found")])
def test_cli_bad_image_is_a_one_line_error(cifar_run, tmp_path, name, content, message):
    run, paths, _ = cifar_run
    bad = tmp_path / name
    if content is not None:
        bad.write_bytes(content)
    out = run_meshfit("predict", str(run), paths[0], str(bad), env=ONE_DEVICE)
    assert out.returncode == 2
    assert out.stderr.startswith("meshfit: error: ") and out.stderr.count("\n") == 1
    assert message.format(bad) in out.stderr and "BytesIO" not in out.stderr, out.stderr
    assert out.stdout == ""


def test_cli_missing_model_is_a_clear_error(tmp_path):
    out = run_meshfit("predict", str(tmp_path / "no-such-run"), "x.png", env=ONE_DEVICE)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "no-such-run not found" in out.stderr and "meshfit train" in out.stderr
    with pytest.raises(MeshfitError, match="has no model.keras"):
        rundir.locate_model(tmp_path)
    out = run_meshfit("export", str(tmp_path), "--format", "onnx", env=ONE_DEVICE)
    assert out.returncode == 2 and "has no model.keras" in out.stderr


def test_cli_export_rejects_an_out_path_of_the_wrong_kind(cifar_run):
    run, _, _ = cifar_run
    out = run_meshfit("export", str(run), "--format", "keras", "--out", str(run / "model.onnx"),
                      env=ONE_DEVICE)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "must end in .keras" in out.stderr


def test_without_onnxruntime_predict_falls_back_to_keras(cifar_run, monkeypatch):
    run, paths, expected = cifar_run
    monkeypatch.setattr(inference, "installed", lambda module: module != "onnxruntime")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no second line on every predict
        predictor = inference.load_predictor(run)
    assert predictor.backend == "keras"
    np.testing.assert_allclose(predictor.predict_files(paths), expected, atol=1e-5)


def test_impossible_conversion_names_the_file(tmp_path):
    picture = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(picture)
    with pytest.raises(MeshfitError, match=f"cannot convert {picture} to the model's 2 channels"):
        inference.load_image(str(picture), (8, 8, 2))


def test_benchmark_latency_reports_percentiles(cifar_run):
    run, _, _ = cifar_run
    stats = inference.benchmark_latency(run, n=20, warmup=2, threads=1)
    assert stats["backend"] == "onnxruntime" and stats["n"] == 20
    assert 0 < stats["p50_ms"] <= stats["p90_ms"]


REGRESSION_RECIPE = '''"""A regression: an 8x8 grey image's mean brightness, one output, no classes."""
import numpy as np

import meshfit


def dataset(seed):
    x = np.random.default_rng(seed).integers(0, 256, (48, 8, 8, 1)).astype(np.uint8)
    y = np.round(x.reshape(48, -1).mean(axis=1) / 25.6).astype(TARGETS)  # whole numbers 3..6
    return (x[:32], y[:32]), (x[32:], y[32:])


def build_model(input_shape, num_classes):
    import keras

    return keras.Sequential([keras.Input(input_shape), keras.layers.Rescaling(1 / 255),
                             keras.layers.Flatten(), keras.layers.Dense(1)])


def optimizer(steps_per_epoch, epochs):
    import keras

    return keras.optimizers.Adam(1e-2)


RECIPE = meshfit.Recipe(name="brightness", dataset=dataset, build_model=build_model,
                        optimizer=optimizer, epochs=1, global_batch=16, loss="mse")
'''


@pytest.mark.parametrize("targets", ["int64", "float32"])
def test_regression_recipe_trains_and_predict_prints_its_values(strategy, tmp_path, capsys,
                                                                 monkeypatch, targets):
    """Issue 39 item 8: a recipe file whose model has one output (a regression) records no class
    names (not its targets' 0..6 as classes), its float targets train as they are (not cut to
    whole numbers), and `meshfit predict` prints the model's value per image, as Keras gives it;
    --top-k, which lists classes, is refused in one line. In this process."""
    from meshfit import cli
    from meshfit.commands import runs
    from helpers import connect_eight_devices

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # predict sets it; restored after the test
    recipe, run = tmp_path / "brightness.py", str(tmp_path / "run")
    recipe.write_text(REGRESSION_RECIPE.replace("TARGETS", f"np.{targets}"))
    Image.fromarray(np.full((8, 8), 200, np.uint8)).save(tmp_path / "bright.png")
    devices = ["--simulate-devices", "8", "--engine", "jax"]
    try:
        assert cli.main(["train", str(recipe), "--out", run, "--no-tensorboard", *devices]) == 0
        config = json.load(open(f"{run}/{rundir.CONFIG}"))
        assert config["class_names"] == []
        # no accuracy is made up for it (argmax of one output): its loss and mean absolute error
        trained = capsys.readouterr().out
        assert "accuracy" not in trained and "test mae" in trained
        metrics = json.load(open(f"{run}/{rundir.METRICS}"))
        assert not [key for key in metrics if "accuracy" in key]
        assert {"test_loss", "test_mae", "train_mae"} <= set(metrics)
        assert not [key for r in json.load(open(f"{run}/{rundir.HISTORY}")) for key in r if "accuracy" in key]
        row = runs.summarize(run)
        assert row["test_accuracy"] is None and row["test_mae"] == metrics["test_mae"]
        assert cli.main(["eval", run, *devices]) == 0
        assert capsys.readouterr().out.splitlines()[-1].startswith("test mae ")
        assert cli.main(["eval", run, "--json", *devices]) == 0
        scored = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert "test_accuracy" not in scored and scored["test_mae"] == pytest.approx(metrics["test_mae"], abs=1e-5)
        image = str(tmp_path / "bright.png")
        assert cli.main(["predict", run, image, "--json", "--backend", "keras"]) == 0
        row = json.loads(capsys.readouterr().out)["predictions"][0]
        model = models.load_keras_model(f"{run}/model.keras")
        expected = float(np.asarray(model.predict_on_batch(np.full((1, 8, 8, 1), 200.0, "float32")))[0, 0])
        assert row == {"image": image, "values": [pytest.approx(expected, abs=1e-5)]}
        picture = tmp_path / "values.png"
        assert cli.main(["predict", run, image, "--backend", "keras", "--show", str(picture)]) == 0
        assert capsys.readouterr().out.splitlines()[0] == f"{image}: {expected:.6g}"
        assert picture.stat().st_size > 1000
        assert cli.main(["predict", run, image, "--top-k", "1", "--backend", "keras"]) == 2
        assert "is no classifier" in capsys.readouterr().err
    finally:
        connect_eight_devices()


BINARY_RECIPE = '''"""Bright or dark 8x8 images: one output for two classes (a sigmoid, or its logit)."""
import numpy as np

import meshfit


''' + BRIGHT_OR_DARK_DATASET + '''

def build_model(input_shape, num_classes):
    import keras

    return keras.Sequential([keras.Input(input_shape), keras.layers.Rescaling(1 / 127.5, offset=-1),
                             keras.layers.Flatten(), keras.layers.Dense(1, activation=ACTIVATION)])


def loss():
    import keras

    return keras.losses.BinaryCrossentropy(from_logits=ACTIVATION is None)


RECIPE = meshfit.Recipe(name="binary", dataset=dataset, build_model=build_model, loss=loss,
                        optimizer=lambda steps, epochs: __import__("keras").optimizers.Adam(0.02),
                        epochs=3, global_batch=16)
'''


@pytest.mark.parametrize("activation, outputs", [("'sigmoid'", "sigmoid"), ("None", "sigmoid-logits")])
def test_a_binary_classifier_with_one_output_has_accuracy_and_class_probabilities(
        strategy, tmp_path, capsys, monkeypatch, activation, outputs):
    """Dense(1) with a sigmoid (or its logit, BinaryCrossentropy(from_logits=True), as keras.io's
    "Image classification from scratch") was taken for a regression: a mean absolute error for
    its accuracy, and predict printed its raw value. Now: accuracy, and each class's probability."""
    from meshfit import cli
    from helpers import connect_eight_devices

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # predict sets it; restored after the test
    recipe, run = tmp_path / "binary.py", str(tmp_path / "run")
    recipe.write_text(BINARY_RECIPE.replace("ACTIVATION", activation))
    Image.fromarray(np.full((8, 8), 230, np.uint8)).save(tmp_path / "bright.png")
    devices = ["--simulate-devices", "8", "--engine", "jax"]
    try:
        assert cli.main(["train", str(recipe), "--out", run, "--no-tensorboard", *devices]) == 0
        config = json.load(open(f"{run}/{rundir.CONFIG}"))
        assert config["class_names"] == ["0", "1"] and config["outputs"] == outputs
        metrics = json.load(open(f"{run}/{rundir.METRICS}"))
        assert metrics["test_accuracy"] >= 0.9 and "test_mae" not in metrics, metrics
        capsys.readouterr()
        assert cli.main(["eval", run, "--json", *devices]) == 0
        scored = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert scored["test_accuracy"] == pytest.approx(metrics["test_accuracy"])
        for backend in ("keras", "onnx"):
            assert cli.main(["predict", run, str(tmp_path / "bright.png"), "--json", "--backend", backend]) == 0
            row = json.loads(capsys.readouterr().out)["predictions"][0]
            assert row["label"] == "1" and sum(row["probabilities"]) == pytest.approx(1, abs=1e-5), row
            assert row["probability"] > 0.5
    finally:
        connect_eight_devices()


def test_class_probabilities_from_each_kind_of_output():
    logits = np.array([[2.0, 0.0, -1.0]], np.float32)
    np.testing.assert_allclose(inference.probabilities(logits, "logits"),
                               np.exp(logits) / np.exp(logits).sum(), rtol=1e-6)
    np.testing.assert_allclose(inference.probabilities(np.array([[0.25]]), "sigmoid"), [[0.75, 0.25]])
    np.testing.assert_allclose(inference.probabilities(np.array([[0.0]]), "sigmoid-logits"), [[0.5, 0.5]])
    assert inference.probabilities(logits, "probabilities") is logits


def test_float_targets_are_kept_with_no_classes():
    """A dataset callable's floating-point labels are a regression's targets, kept as float32."""
    from meshfit.data import splits

    x = np.zeros((4, 2, 2, 1), np.uint8)
    data = splits._arrays(((x, np.array([0.25, 1.5, 2.0, 3.75])), (x, np.array([0.5, 1, 2, 3.0]))))
    assert data.class_names == () and data.y_train.dtype == np.float32
    np.testing.assert_array_equal(data.y_train, [0.25, 1.5, 2.0, 3.75])


def test_a_one_output_model_is_no_classifier_whatever_its_run_recorded():
    """A run trained before class names were kept for classifiers only lists its targets as 10
    classes; its one-output model's values are still what predict gives (not a refusal)."""
    import types

    old_run = types.SimpleNamespace(config={"class_names": [str(i) for i in range(10)]}, source="run")
    assert inference._class_names(old_run, None, 1) == ()
    assert inference._class_names(old_run, None, 10) == tuple(str(i) for i in range(10))
    with pytest.raises(MeshfitError, match="lists 10 class names but the model outputs 3"):
        inference._class_names(old_run, None, 3)
