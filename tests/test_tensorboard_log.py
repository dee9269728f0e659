"""TensorBoard scalars (meshfit.watch.keras_side.tensorboard), read back from the event files."""

import os

import numpy as np
from helpers import read_scalars


def _fit(strategy, logdir, dispatch=1, epochs=2):
    import keras

    from meshfit.watch.keras_side.report import EpochReport
    from meshfit.watch.keras_side.tensorboard import TensorBoardLog

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 4)).astype("float32"), rng.integers(0, 3, 96)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=6, decay_rate=0.5)
        model.compile(optimizer=keras.optimizers.SGD(schedule), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=dispatch)
    report = EpochReport(global_batch=16, strategy=strategy, stream=open(os.devnull, "w"))
    log = TensorBoardLog(logdir, log_every=2, report=report, global_batch=16)
    strategy.fit(model, x, y, batch_size=16, epochs=epochs, validation_data=(x[:32], y[:32]),
                 callbacks=[report, log])  # 6 steps per epoch
    return read_scalars(logdir)


def test_scalars_at_global_steps(strategy, tmp_path):
    scalars = _fit(strategy, str(tmp_path))
    assert [s for s, _ in scalars["train/loss"]] == [2, 4, 6, 8, 10, 12]
    assert [s for s, _ in scalars["train/accuracy"]] == [2, 4, 6, 8, 10, 12]
    for tag in ("epoch/loss", "epoch/accuracy", "epoch/val_loss", "epoch/val_accuracy",
                "epoch/learning_rate", "speed/ms_per_step", "speed/samples_per_second"):
        assert [s for s, _ in scalars[tag]] == [6, 12], tag
    rates = [v for _, v in scalars["epoch/learning_rate"]]
    np.testing.assert_allclose(rates, [0.05, 0.025], rtol=1e-5)  # the schedule at steps 6 and 12
    assert all(v > 0 for _, v in scalars["speed/samples_per_second"])
    # A CPU's MFU is against its measured peak; the run's goodput so far at each epoch end.
    assert all(0 < v < 1 for _, v in scalars["speed/mfu"])
    assert [s for s, _ in scalars["goodput/fraction"]] == [6, 12]
    assert all(0 < v < 1 for _, v in scalars["goodput/fraction"])
    assert scalars["goodput/train_seconds"][1][1] > scalars["goodput/train_seconds"][0][1]


def test_steps_per_dispatch_logs_at_the_dispatch_passing_a_multiple(strategy, tmp_path):
    scalars = _fit(strategy, str(tmp_path), dispatch=3, epochs=1)
    # Dispatches end at steps 3 and 6: each passes a multiple of 2 (2, then 4 and 6).
    assert [s for s, _ in scalars["train/loss"]] == [3, 6]
    assert [s for s, _ in scalars["epoch/val_loss"]] == [6]


def test_global_step_of_a_resumed_cut_epoch():
    from meshfit.watch.keras_side.tensorboard import global_step

    assert global_step(0, 0, 6, None) == 1
    assert global_step(2, 5, 6, 6) == 18
    assert global_step(2, 0, 2, 6) == 17  # the last 2 steps of epoch 3 (of 6 steps)


def test_tensorboardx_is_imported_without_pytorch(tmp_path):
    # tensorboardX imports torch at its top whenever it is installed (3.2 s on a GPU machine, in
    # the first epoch of every run): meshfit's writer must leave it out, and torch must still
    # import normally afterwards. A stand-in torch package records whether it was imported.
    import subprocess
    import sys

    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import os\nopen(os.environ['TORCH_MARKER'], 'a').write('imported\\n')\n")
    marker = tmp_path / "torch-imported"
    program = (
        "import os, sys, meshfit\n"
        "meshfit.connect(engine='jax', verbose=False)\n"
        "from meshfit.watch.keras_side.tensorboard import TensorBoardLog\n"
        "log = TensorBoardLog(sys.argv[1], log_every=1)\n"
        "writer = log._writer_class(sys.argv[1]); writer.add_scalar('a', 1.0, 1); writer.close()\n"
        "print('before', os.path.exists(os.environ['TORCH_MARKER']), 'tensorboardX' in sys.modules)\n"
        "import torch\n"
        "print('after', os.path.exists(os.environ['TORCH_MARKER']))\n")
    env = {**os.environ, "TORCH_MARKER": str(marker),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", program, str(tmp_path / "tb")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "before False True" in done.stdout and "after True" in done.stdout, done.stdout
    assert read_scalars(str(tmp_path / "tb"))["a"] == [(1, 1.0)]
