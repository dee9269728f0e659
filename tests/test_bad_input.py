"""Bad input and hostile places: each is one line on stderr, exit code 2, and nothing of the
user's is touched. These fail before any device or data work, so they are quick."""

import os
import shutil

import numpy as np
import pytest
from helpers import cli_env, run_meshfit, write_idx_dataset

from meshfit import checkpoints, datasets, rundir
from meshfit.errors import MeshfitError


def one_line_error(out, *words):
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr, out.stderr
    for word in words:
        assert word in out.stderr, out.stderr


@pytest.mark.parametrize("flag,value", [("--epochs", "0"), ("--batch-size", "0"),
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
    stale = checkpoints.save(directory, model, epoch=10, step=0, steps_per_epoch=10)  # step 100
    written = checkpoints.save(directory, model, epoch=0, step=5, steps_per_epoch=10, keep=1)
    assert os.path.isdir(written) and not os.path.exists(stale)
    kept = checkpoints.save(directory, model, epoch=0, step=6, steps_per_epoch=10, keep=2)
    assert checkpoints.list_checkpoints(directory) == [written, kept]


def test_a_failed_checkpoint_write_is_one_line_and_keeps_the_previous(strategy, tmp_path, monkeypatch):
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    directory = tmp_path / "checkpoints"
    previous = checkpoints.save(directory, model, epoch=0, step=1, steps_per_epoch=10)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.raises(MeshfitError, match="No space left on device.*previous checkpoints are intact"):
        checkpoints.save(directory, model, epoch=0, step=2, steps_per_epoch=10)
    assert checkpoints.list_checkpoints(directory) == [previous]
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
    datasets.write_idx(str(root / datasets.IDX_FILES[0]), x)
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
