"""Runs that cannot go on: the divergence guard (meshfit.run.keras_side.divergence), a run whose
weights become NaN or inf stops with one line and keeps the checkpoints it had, nothing of the
diverged state saved; and a device out of memory during training, one line with the fix."""

import os
import subprocess
import sys
import textwrap

import pytest
from helpers import BRIGHT_OR_DARK_DATASET, cli_env, environment, run_meshfit

from meshfit.commands import runs
from meshfit.errors import MeshfitError
from meshfit.run import local_copies, rundir

# tiny's linear model, its learning rate 0.02 for 7 steps and then inf: the 8th step makes the
# weights non-finite. 8 steps per epoch, checkpoints every 3.
DIVERGING_RECIPE = '''"""diverging: bright or dark 8x8 images, a learning rate that explodes."""
import numpy as np

import meshfit


''' + BRIGHT_OR_DARK_DATASET + '''

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
    (row,) = runs.collect([run])
    assert row["status"] == "diverged at step 8", row


def test_a_device_out_of_memory_during_training_is_one_line_with_the_fix(tmp_path):
    """XLA's RESOURCE_EXHAUSTED mid-run (raised here by a callback at step 5, as JAX raises it
    from a step's allocation) ends train() with a MeshfitError naming the resume command with
    micro-batches; the checkpoint before it is intact."""
    recipe = tmp_path / "diverging.py"
    recipe.write_text(DIVERGING_RECIPE.replace("0.02, float(\"inf\")", "0.02, 0.02"))
    script = textwrap.dedent(f"""
        import keras, meshfit
        from meshfit.run.train import train

        class OutOfMemory(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if batch == 5:
                    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                       "allocate 17179869184 bytes.\\nBufferAssignment ...")

        try:
            train({str(recipe)!r}, out={str(tmp_path / "run")!r}, checkpoint_every="3",
                  tensorboard=False, verbose=False, callbacks=[OutOfMemory()])
        except meshfit.MeshfitError as error:
            print(error)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env=environment(cli_env(tmp_path, engine="tensorflow")))
    assert out.returncode == 0, out.stderr[-3000:]
    message = out.stdout.strip().splitlines()[-1]
    assert message.startswith("out of device memory (RESOURCE_EXHAUSTED: Out of memory while "
                              "trying to allocate 17179869184 bytes.)"), message
    assert f"meshfit train --resume {tmp_path / 'run'} --micro-batches 2" in message, message
    assert "docs/troubleshooting.md#out-of-device-memory" in message, message
    saved = rundir.list_checkpoints(os.path.join(tmp_path / "run", rundir.CHECKPOINTS))
    assert [os.path.basename(p) for p in saved] == ["ckpt-00000003"], saved
