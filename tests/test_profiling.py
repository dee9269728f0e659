"""`--profile START:STOP` (meshfit.watch.keras_side.profiling): parsing, and trace files on JAX and TensorFlow."""

import glob
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import ONE_CPU, environment

from meshfit.errors import MeshfitError

# 1 epoch of 8 steps with Profile(logdir, 2, 4), in a process of its own (Keras fixes its backend).
FIT_8_STEPS = """
import sys
import numpy as np
import keras
from meshfit.watch.keras_side.profiling import Profile

x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = np.arange(64) % 3
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Profile(sys.argv[1], 2, 4)])
"""


def test_parse_profile_steps():
    from meshfit.run.spec import profiling_steps

    assert profiling_steps(None) is None
    assert profiling_steps("10:20") == (10, 20)
    assert profiling_steps(" 2 : 4 ") == (2, 4)
    for bad in ("5", "0:3", "7:5", "a:b", "3:3", "-1:4", ""):
        with pytest.raises(MeshfitError, match=r"--profile .*START:STOP") as error:
            profiling_steps(bad)
        assert "\n" not in str(error.value)


def test_parsing_the_flag_does_not_import_keras():
    """--profile is checked before the engine is chosen; the Profile callback itself needs Keras."""
    code = ("import sys; from meshfit.run.spec import profiling_steps; profiling_steps('2:4'); "
            "sys.exit('keras' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env=environment(ONE_CPU)).returncode == 0


def _trace_files(logdir) -> list[str]:
    pattern = os.path.join(logdir, "plugins", "profile", "*", "*")
    return sorted(os.path.basename(p) for p in glob.glob(pattern))


def test_jax_trace_of_steps_2_to_4(strategy, tmp_path):
    import keras

    from meshfit.watch.keras_side.profiling import Profile

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    profile = Profile(str(tmp_path), 2, 4)
    strategy.fit(model, x, np.arange(64) % 3, batch_size=8, epochs=1, callbacks=[profile], report=False)
    files = _trace_files(tmp_path)
    assert any(f.endswith(".xplane.pb") for f in files), files
    assert "perfetto_trace.json.gz" in files
    assert profile.done and not profile.running


def test_tensorflow_trace_of_steps_2_to_4(tmp_path):
    env = environment({**ONE_CPU, "KERAS_BACKEND": "tensorflow"})
    result = subprocess.run([sys.executable, "-c", FIT_8_STEPS, str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert any(f.endswith(".xplane.pb") for f in _trace_files(tmp_path)), result.stderr[-3000:]


def test_warns_when_training_ends_before_start(strategy, tmp_path):
    import keras

    from meshfit.watch.keras_side.profiling import Profile

    x = np.zeros((16, 4), "float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(UserWarning, match="before step 50; no trace written"):
        strategy.fit(model, x, np.zeros((16, 3)), batch_size=8, epochs=1, report=False,
                     callbacks=[Profile(str(tmp_path), 50, 60)])
    assert _trace_files(tmp_path) == []
