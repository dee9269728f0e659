"""The divergence guard (meshfit.run.keras_side.divergence): a run whose weights become NaN or inf
stops with one line, and keeps the checkpoints it had; nothing of the diverged state is saved."""

import os

import pytest
from helpers import cli_env, run_meshfit

from meshfit.errors import MeshfitError
from meshfit.run import local_copies, rundir

# tiny's linear model, its learning rate 0.02 for 7 steps and then inf: the 8th step makes the
# weights non-finite. 8 steps per epoch, checkpoints every 3.
DIVERGING_RECIPE = '''"""diverging: bright or dark 8x8 images, a learning rate that explodes."""
import numpy as np

import meshfit


def dataset(seed):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 160)
    x = np.clip(70 + 110 * labels[:, None, None, None] + rng.normal(0, 30, (160, 8, 8, 1)), 0, 255)
    return (x[:128].astype("uint8"), labels[:128]), (x[128:].astype("uint8"), labels[128:])


def build_model(input_shape, num_classes):
    import keras

    return keras.Sequential([keras.Input(input_shape), keras.layers.Rescaling(1 / 255),
                             keras.layers.Flatten(),
                             keras.layers.Dense(num_classes, activation="softmax")])


def optimizer(steps_per_epoch, epochs):
    import keras

    class Explodes(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):  # step: the optimizer's iterations so far
            return keras.ops.where(step < 7, 0.02, float("inf"))

        def get_config(self):
            return {}

    return keras.optimizers.SGD(Explodes())


RECIPE = meshfit.Recipe(name="diverging", dataset=dataset, build_model=build_model,
                        optimizer=optimizer, epochs=3, global_batch=16)
'''


@pytest.mark.parametrize("engine", ["tensorflow", "jax"])
def test_a_diverged_run_stops_in_one_line_and_keeps_its_checkpoints(tmp_path, engine):
    recipe = tmp_path / "diverging.py"
    recipe.write_text(DIVERGING_RECIPE)
    run = str(tmp_path / "run")
    env = {**cli_env(tmp_path, engine="tensorflow"), "MESHFIT_LOCAL_COPIES": str(tmp_path / "copies")}
    extra = ["--simulate-devices", "2", "--local-copy-every", "1"] if engine == "jax" else []
    out = run_meshfit("train", str(recipe), "--out", run, "--checkpoint-every", "3",
                      "--no-tensorboard", *extra, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    error = out.stderr.strip().splitlines()[-1]
    assert "Traceback" not in out.stderr and error.startswith("meshfit: error: training diverged: "), out.stderr
    assert "holds NaN or inf after step 8 (epoch 1)" in error and "ckpt-00000006" in error, error
    assert "lower the learning rate" in error, error
    saved = [os.path.basename(p) for p in rundir.list_checkpoints(os.path.join(run, rundir.CHECKPOINTS))]
    assert saved == ["ckpt-00000003", "ckpt-00000006"], saved
    assert not os.path.exists(os.path.join(run, "model.keras"))
    assert not os.path.exists(local_copies.folder_of(run))  # copies of the NaN steps removed
    with pytest.raises(MeshfitError, match=r"has not finished training \(no model.keras yet; its "
                       r"newest checkpoint: ckpt-00000006\); finish it with: meshfit train --resume"):
        rundir.locate_model(run)  # predict, eval and export say so
