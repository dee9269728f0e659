"""A run directory written by meshfit 0.1.0 (tests/data/run-0.1.0) still resumes, evaluates and
predicts. It is a 2-epoch fashion-mnist-cnn run on the TensorFlow engine, global batch 32, on the
data of helpers.write_idx_dataset(seed=0), with checkpoints after steps 6 (epoch 2, step 2) and 8."""

import json
import os
import shutil

import numpy as np
import pytest
from helpers import cli_env, run_meshfit, write_idx_dataset
from PIL import Image

LEGACY = os.path.join(os.path.dirname(__file__), "data", "run-0.1.0")


@pytest.fixture
def legacy(tmp_path):
    """A copy of the legacy run and the data it was trained on."""
    run, data = tmp_path / "run", tmp_path / "data"
    shutil.copytree(LEGACY, run)
    arrays = write_idx_dataset(data / "fashion-mnist")
    return str(run), str(data), arrays


def arrays_of(checkpoint):
    """A checkpoint's arrays: arrays.npz since the manifest format, state.npz in meshfit 0.1's."""
    name = "arrays.npz" if os.path.exists(os.path.join(checkpoint, "arrays.npz")) else "state.npz"
    with np.load(os.path.join(checkpoint, name)) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.slow
def test_a_legacy_run_resumes_mid_epoch_to_the_same_end(legacy, tmp_path):
    run, data, _ = legacy
    shutil.rmtree(os.path.join(run, "checkpoints", "ckpt-00000008"))
    os.remove(os.path.join(run, "model.keras"))
    out = run_meshfit("train", "--resume", run, "--data-dir", data, env=cli_env(tmp_path, "tensorflow"))
    assert out.returncode == 0, out.stderr
    assert f"resuming {run} from ckpt-00000006: epoch 2 step 2" in out.stdout
    resumed = arrays_of(os.path.join(run, "checkpoints", "ckpt-00000008"))
    original = arrays_of(os.path.join(LEGACY, "checkpoints", "ckpt-00000008"))
    assert sorted(resumed) == sorted(original)
    for key in original:  # bit-identical on the CPU that wrote it; other CPUs' kernels round apart
        np.testing.assert_allclose(resumed[key], original[key], rtol=1e-4, atol=1e-4, err_msg=key)
    config = json.loads(open(os.path.join(run, "config.json")).read())
    assert config["resumed"][0]["checkpoint"] == "ckpt-00000006"
    assert config["started"] == "2026-11-22T21:59:02"  # the original specification is kept
    metrics = json.loads(open(os.path.join(run, "metrics.json")).read())
    expected = json.loads(open(os.path.join(LEGACY, "metrics.json")).read())
    assert metrics["resumed"] and metrics["test_accuracy"] == pytest.approx(expected["test_accuracy"])
    assert os.path.isfile(os.path.join(run, "model.keras"))


def test_a_legacy_run_evaluates_to_its_recorded_accuracy(legacy, tmp_path):
    run, data, _ = legacy
    out = run_meshfit("eval", run, "--data-dir", data, "--json", env=cli_env(tmp_path, "tensorflow"))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    expected = json.loads(open(os.path.join(run, "metrics.json")).read())
    assert result["samples"] == 37
    assert result["test_accuracy"] == pytest.approx(expected["test_accuracy"])
    assert result["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-4)


def test_a_legacy_run_predicts_with_its_class_names(legacy, tmp_path):
    run, _, (_, _, x_test, _) = legacy
    image = str(tmp_path / "shirt.png")
    Image.fromarray(x_test[0]).save(image)
    out = run_meshfit("predict", run, image, "--json", env=cli_env(tmp_path, "tensorflow"))
    assert out.returncode == 0, out.stderr
    prediction = json.loads(out.stdout.splitlines()[-1])["predictions"][0]
    names = json.loads(open(os.path.join(run, "config.json")).read())["class_names"]
    assert prediction["label"] == names[prediction["index"]] == prediction["top_k"][0]["label"]
    assert len(prediction["probabilities"]) == 10
    assert sum(prediction["probabilities"]) == pytest.approx(1.0, abs=1e-5)


def test_config_json_keys_of_before_the_rename_are_read_under_their_new_names(legacy):
    """One name per setting since 0.1.0: config.json's "simulated_devices" is now
    "simulate_devices"; a run written before reads back with its value."""
    from meshfit.run import spec

    run, _, _ = legacy
    saved, config = spec.read(run)
    assert "simulated_devices" in config and "simulate_devices" not in config
    assert saved.simulate_devices is None and saved.global_batch == 32
    config["simulated_devices"] = 8
    assert spec.RunSpec.from_dict(config).simulate_devices == 8


@pytest.mark.slow
def test_a_run_recorded_under_the_old_names_resumes_on_its_simulated_devices(tmp_path):
    """A run on 8 simulated devices whose config.json says "simulated_devices" (as meshfit wrote
    it before the rename) resumes on 8 devices without --simulate-devices."""
    data = str(tmp_path / "data")
    write_idx_dataset(os.path.join(data, "fashion-mnist"))
    run = str(tmp_path / "run")
    env = {**cli_env(tmp_path), "KERAS_BACKEND": None, "MESHFIT_SIMULATE_DEVICES": None, "XLA_FLAGS": ""}
    out = run_meshfit("train", "--data-dir", data, "--out", run, "--epochs", "1", "--engine", "jax",
                      "--simulate-devices", "8", "--global-batch", "32", "--checkpoint-every", "epoch",
                      env=env)
    assert out.returncode == 0, out.stderr
    path = os.path.join(run, "config.json")
    config = json.loads(open(path).read())
    assert config["simulate_devices"] == 8
    config["simulated_devices"] = config.pop("simulate_devices")  # as written before the rename
    open(path, "w").write(json.dumps(config))
    out = run_meshfit("train", "--resume", run, "--epochs", "2", env=env)
    assert out.returncode == 0, out.stderr
    resumed = json.loads(open(path).read())["resumed"][0]
    assert (resumed["replicas"], resumed["engine"]) == (8, "jax")
