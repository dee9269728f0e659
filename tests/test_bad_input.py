"""Bad input and hostile places: each is one line on stderr, exit code 2, and nothing of the
user's is touched. These fail before any device or data work, so they are quick."""

import os
import re
import shutil

import numpy as np
import pytest
from helpers import cli_env, drop_state_field, run_meshfit, write_idx_dataset

from meshfit.run import checkpoint_format, rundir
from meshfit.run.keras_side import checkpoint_restore, checkpoint_save
from meshfit.data import datasets, file_formats
from meshfit.errors import MeshfitError


def one_line_error(out, *words):
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr, out.stderr
    for word in words:
        assert word in out.stderr, out.stderr


@pytest.mark.parametrize("flag,value", [("--epochs", "0"), ("--global-batch", "0"),
                                        ("--keep-checkpoints", "0"), ("--keep-checkpoints", "-1"),
                                        ("--log-every", "0")])
def test_counts_below_one_are_refused(flag, value, tmp_path):
    out = run_meshfit("train", flag, value, "--out", str(tmp_path / "run"), env=cli_env(tmp_path),
                      timeout=120)
    one_line_error(out, f"{flag} must be at least 1, got {value}")
    assert not (tmp_path / "run").exists()


def test_out_naming_a_file_is_refused(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    out = run_meshfit("train", "--out", str(target), env=cli_env(tmp_path), timeout=120)
    one_line_error(out, "is a file")
    assert target.read_text() == "mine"


def test_out_holding_other_files_is_refused_and_left_alone(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "model.keras").write_bytes(b"the user's own model")
    out = run_meshfit("train", "--out", str(folder), env=cli_env(tmp_path), timeout=120)
    one_line_error(out, "not a meshfit run", "empty or new directory")
    assert os.listdir(folder) == ["model.keras"]
    assert (folder / "model.keras").read_bytes() == b"the user's own model"


def test_out_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    out = run_meshfit("train", "--out", "/proc/meshfit-run", env=cli_env(tmp_path), timeout=120)
    one_line_error(out, "cannot write the run directory /proc/meshfit-run")
    assert "meshfit connected" not in out.stdout  # no devices were touched


@pytest.mark.parametrize("name, folder", [("cnn/v2", "cnn-v2"), ("../../etc", "etc"), ("..", "run"),
                                          ("my model", "my-model"), ("cifar10-fast", "cifar10-fast")])
def test_a_recipe_name_makes_one_plain_folder_under_runs(name, folder):
    """A Recipe(name=...) is the user's text: its run went into another folder, or out of runs/."""
    path = rundir.timestamped(name)
    assert os.path.dirname(path) == "runs" and re.fullmatch(folder + r"-\d{8}-\d{6}", os.path.basename(path))


def test_a_locked_run_directory_names_its_holder(tmp_path):
    run = str(tmp_path / "run")
    with rundir.lock(run):
        with pytest.raises(MeshfitError, match=rf"{run} is in use by process {os.getpid()}"):
            with rundir.lock(run):
                pass
    with rundir.lock(run):  # released on exit
        pass


def test_the_checkpoint_just_written_is_never_deleted(strategy, tmp_path):
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    directory = tmp_path / "checkpoints"
    stale = checkpoint_save.save(directory, model, epoch=10, step=0, steps_per_epoch=10)  # step 100
    written = checkpoint_save.save(directory, model, epoch=0, step=5, steps_per_epoch=10, keep=1)
    assert os.path.isdir(written) and not os.path.exists(stale)
    kept = checkpoint_save.save(directory, model, epoch=0, step=6, steps_per_epoch=10, keep=2)
    assert rundir.list_checkpoints(directory) == [written, kept]


def test_a_failed_checkpoint_write_is_one_line_and_keeps_the_previous(strategy, tmp_path, monkeypatch):
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    directory = tmp_path / "checkpoints"
    previous = checkpoint_save.save(directory, model, epoch=0, step=1, steps_per_epoch=10)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.raises(MeshfitError, match="No space left on device.*previous checkpoints are intact"):
        checkpoint_save.save(directory, model, epoch=0, step=2, steps_per_epoch=10)
    assert rundir.list_checkpoints(directory) == [previous]
    assert [n for n in os.listdir(directory) if n.startswith(".tmp-")] == []


def test_a_data_folder_whose_path_says_images_loads(tmp_path):
    root = tmp_path / "my-images"
    write_idx_dataset(root / "fashion-mnist")
    data = datasets.load("fashion_mnist", str(root), download=False)
    assert data.x_train.shape[1:] == (28, 28, 1)


def test_idx_images_that_are_not_28x28_are_refused(tmp_path):
    root = tmp_path / "data" / "fashion-mnist"
    write_idx_dataset(root)
    x = np.zeros((128, 14, 56), np.uint8)
    file_formats.write_idx(str(root / datasets.IDX_FILES[0]), x)
    with pytest.raises(MeshfitError, match="14x56, not 28x28"):
        datasets.load("fashion_mnist", str(tmp_path / "data"), download=False)


def test_fashion_mnist_downloads_over_https():
    assert all(url.startswith("https://") for url in datasets.URLS.values())


def test_resume_of_a_directory_with_a_foreign_config_is_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for content in ("[]", "{}", '{"recipe": "fashion-mnist-cnn"}'):
        (run / "config.json").write_text(content)
        out = run_meshfit("train", "--resume", str(run), env=cli_env(tmp_path), timeout=120)
        one_line_error(out, str(run))
    shutil.rmtree(run)


# ------------------------------------------------------------------ checkpoints: commit and damage

def _dense_model(strategy):
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.optimizer.build(model.trainable_variables)
    return model


def _kernel(model):
    import keras

    return keras.ops.convert_to_numpy(model.trainable_variables[0]).copy()


def test_a_checkpoint_is_committed_by_its_manifest_never_by_renaming_a_folder(strategy, tmp_path,
                                                                             monkeypatch):
    model = _dense_model(strategy)
    real_replace = os.replace

    def no_folder_renames(src, dst, *args, **kwargs):
        if os.path.isdir(src):
            raise OSError(38, "Function not implemented")  # gcsfuse without --rename-dir-limit
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", no_folder_renames)
    monkeypatch.setattr(os, "replace", no_folder_renames)
    path = checkpoint_save.save(tmp_path, model, epoch=0, step=3, steps_per_epoch=10)
    # arrays/: orbax's shards (JAX), its folder marked complete by a file, not renamed either
    assert sorted(os.listdir(path)) == ["arrays", "arrays.npz", "manifest.json", "state.json"]
    assert "commit_success.txt" in os.listdir(os.path.join(path, "arrays"))
    checkpoint_format.verify(path)
    os.remove(os.path.join(path, "manifest.json"))  # a save cut short before its commit
    assert rundir.list_checkpoints(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncated arrays", "flipped byte", "no manifest field",
                                    "state lacks a field"])
def test_a_damaged_checkpoint_is_refused_before_any_variable_changes(strategy, tmp_path, damage):
    model = _dense_model(strategy)
    path = checkpoint_save.save(tmp_path, model, epoch=0, step=3, steps_per_epoch=10)
    arrays = os.path.join(path, "arrays.npz")
    if damage == "truncated arrays":
        os.truncate(arrays, 100)
    elif damage == "flipped byte":
        data = bytearray(open(arrays, "rb").read())
        data[len(data) // 2] ^= 1
        open(arrays, "wb").write(bytes(data))
    elif damage == "no manifest field":
        open(os.path.join(path, "manifest.json"), "w").write('{"format": 2}')
    else:  # with a manifest that matches, as a hand-edited file would not
        drop_state_field(path, "steps_per_epoch")
    model.trainable_variables[0].assign(np.zeros((3, 2)))
    with pytest.raises(checkpoint_format.CheckpointDamaged, match=f"checkpoint {path} is damaged"):
        checkpoint_restore.restore(model, path)
    np.testing.assert_array_equal(_kernel(model), np.zeros((3, 2)))


def test_resume_falls_back_to_the_newest_intact_checkpoint_with_a_warning(strategy, tmp_path):
    from meshfit.run.keras_side import fitting as training

    model = _dense_model(strategy)
    directory = tmp_path / "checkpoints"
    first = checkpoint_save.save(directory, model, epoch=0, step=1, steps_per_epoch=10,
                                 extra={"history": []})
    kernel = _kernel(model)
    model.trainable_variables[0].assign(np.ones((3, 2)))
    newest = checkpoint_save.save(directory, model, epoch=0, step=2, steps_per_epoch=10,
                                  extra={"history": []})
    os.truncate(os.path.join(newest, "arrays.npz"), 10)
    labels = np.zeros(4, np.int32)
    with pytest.warns(UserWarning, match="ckpt-00000002 is damaged.*resuming from ckpt-00000001"):
        state = training.restore(model, str(tmp_path), 10, labels)
    assert state["path"] == first and (state["epoch"], state["step"]) == (0, 1)
    np.testing.assert_array_equal(_kernel(model), kernel)
    with pytest.raises(checkpoint_format.CheckpointDamaged):  # named on --resume: no fallback
        training.restore(model, str(tmp_path), 10, labels, newest)
    # the resumed run writes step 2 again over the damaged folder
    again = checkpoint_save.save(directory, model, epoch=0, step=2, steps_per_epoch=10)
    checkpoint_format.verify(again)


def test_resume_can_name_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "data", "run-0.1.0"), run)
    named = str(run / "checkpoints" / "ckpt-00000006")
    assert rundir.resume_target(named) == (str(run), named)
    assert rundir.resume_target(str(run / "checkpoints" / "ckpt-6")) == (str(run), named)
    assert rundir.resume_target(str(run)) == (str(run), None)
    with pytest.raises(MeshfitError, match="complete ones: ckpt-00000006, ckpt-00000008"):
        rundir.resume_target(str(run / "checkpoints" / "ckpt-7"))


def test_meshfit_0_1_checkpoints_are_still_complete_and_readable():
    legacy = os.path.join(os.path.dirname(__file__), "data", "run-0.1.0", "checkpoints")
    found = rundir.list_checkpoints(legacy)
    assert [os.path.basename(p) for p in found] == ["ckpt-00000006", "ckpt-00000008"]
    checkpoint_format.verify(found[-1])
    assert checkpoint_format.read_state(found[-1])["format"] == 1
    assert "model/00000" in checkpoint_format.read_arrays(found[-1])


# ----------------------------------------------------------------------------- loaders and models

def test_a_cifar_label_too_large_for_64_bits_is_one_line(tmp_path):
    folder = tmp_path / "cifar10" / datasets.CIFAR_DIR
    folder.mkdir(parents=True)
    x = np.zeros((10, 32, 32, 3), np.uint8)
    for name in datasets.CIFAR_FILES:
        file_formats.write_cifar_batch(folder / name, x, [2 ** 70] * 10 if name == "test_batch" else range(10))
    with pytest.raises(MeshfitError, match="test_batch.*not a list of integers"):
        datasets.load("cifar10", str(tmp_path), download=False)


def test_an_idx_decompression_bomb_is_refused_early(tmp_path):
    import zlib

    root = tmp_path / "fashion-mnist"
    write_idx_dataset(root)
    pack = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    header = bytes([0, 0, 8, 3]) + (128).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
    data = pack.compress(header) + b"".join(pack.compress(bytes(1 << 24)) for _ in range(16))
    (root / datasets.IDX_FILES[0]).write_bytes(data + pack.flush())  # 256 MB of zeros in 250 KB
    with pytest.raises(MeshfitError, match="more than 100352 data bytes"):
        datasets.load("fashion_mnist", str(tmp_path), download=False)


def test_an_empty_training_set_is_named_as_such(tmp_path):
    write_idx_dataset(tmp_path / "fashion-mnist", n_train=0)
    with pytest.raises(MeshfitError, match="has no training images"):
        datasets.load("fashion_mnist", str(tmp_path), download=False)


def test_a_transparent_background_reads_as_white(tmp_path):
    from PIL import Image

    from meshfit.serve import inference

    picture = np.zeros((8, 8, 4), np.uint8)  # transparent black...
    picture[2:6, 2:6] = (255, 0, 0, 255)  # ...around an opaque red square
    Image.fromarray(picture, "RGBA").save(tmp_path / "a.png")
    rgb = inference.load_image(str(tmp_path / "a.png"), (8, 8, 3))
    assert tuple(rgb[0, 0]) == (255, 255, 255) and tuple(rgb[3, 3]) == (255, 0, 0)


@pytest.mark.parametrize("content,message", [(os.urandom(2000), "is not a .keras model"),
                                             (b"\x89HDF\r\n\x1a\n" + bytes(100), "is an HDF5 file")])
def test_a_keras_file_that_is_not_one_says_so(tmp_path, content, message):
    path = tmp_path / "model.keras"
    path.write_bytes(content)
    out = run_meshfit("export", str(path), env=cli_env(tmp_path), timeout=120)
    one_line_error(out, message)


def test_export_leaves_a_users_own_onnx_beside_the_keras_file(tmp_path):
    import zipfile

    with zipfile.ZipFile(tmp_path / "net.keras", "w") as z:
        z.writestr("config.json", "{}")
    (tmp_path / "net.onnx").write_bytes(b"the user's own model")
    out = run_meshfit("export", str(tmp_path / "net.keras"), env=cli_env(tmp_path), timeout=120)
    one_line_error(out, "was not written by meshfit", "--out")
    assert (tmp_path / "net.onnx").read_bytes() == b"the user's own model"


def test_a_bad_argument_is_one_line(tmp_path):
    out = run_meshfit("train", "--epochs", "many", env=cli_env(tmp_path), timeout=120)
    one_line_error(out, "argument --epochs: invalid int value: 'many'")


@pytest.mark.parametrize("given", ["images", "images/", "./images", "missing.py", "runs/cnn"])
def test_a_folder_or_missing_file_given_as_the_recipe_is_named_before_the_devices_connect(
        tmp_path, capsys, monkeypatch, given):
    """`meshfit train my_images` (the first thing a new user tries with a folder) says how to
    train on a folder; a run directory, how to train it on; a missing recipe file is named: one
    line (exit 2), nothing connected."""
    from meshfit import cli
    from meshfit.parallel import engine

    monkeypatch.setattr(engine, "start_engine", lambda *a, **k: pytest.fail("connected first"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "images" / "cats").mkdir(parents=True)
    (tmp_path / "runs" / "cnn").mkdir(parents=True)
    (tmp_path / "runs" / "cnn" / "config.json").write_text("{}")
    assert cli.main(["train", given]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    expected = {"missing.py": f"{tmp_path / 'missing.py'} does not exist",
                "runs/cnn": f"{tmp_path / 'runs' / 'cnn'} is a run directory, not a recipe file; to "
                            f"train it on: meshfit train --resume {tmp_path / 'runs' / 'cnn'} --epochs N"
                }.get(given, f"{tmp_path / 'images'} is a folder, not a recipe file; to train on the "
                             f"images in it (a sub-folder per class): meshfit train --data "
                             f"{tmp_path / 'images'} --image-size")
    assert len(err) == 1 and expected in err[0], err


@pytest.mark.parametrize("command", [["train", "--data", "MISSING", "--image-size", "28", "28"],
                                     ["eval", "RUN", "--data", "MISSING"]])
def test_a_missing_data_folder_is_named_before_the_devices_connect(tmp_path, capsys, monkeypatch,
                                                                    command):
    """`--data MISSING` is one line (exit 2) before any device is looked for, not after."""
    from meshfit import cli
    from meshfit.parallel import engine

    monkeypatch.setattr(engine, "start_engine", lambda *a, **k: pytest.fail("connected first"))
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.CONFIG).write_text("{}")
    args = [str(run) if a == "RUN" else str(tmp_path / "missing") if a == "MISSING" else a for a in command]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"image folder {tmp_path / 'missing'} does not exist" in err[0], err


@pytest.mark.parametrize("args", [["runs", "--plot", "curves.txt"], ["runs", "--goodput-plot", "bars"],
                                  ["verify", "fashion-mnist-cnn", "--plot", "v.bmp"]])
def test_a_picture_flag_naming_no_picture_format_is_one_line_before_any_work(args, tmp_path):
    """matplotlib refused the suffix only after the work, with a traceback (or, given none, wrote
    another file than the one named)."""
    args = [*args[:-1], str(tmp_path / args[-1])]
    out = run_meshfit(*args, env=cli_env(tmp_path), timeout=120)
    one_line_error(out, "name a .png, .jpg, .jpeg, .pdf, .svg file")
    assert "meshfit connected" not in out.stdout and os.listdir(tmp_path) == []
