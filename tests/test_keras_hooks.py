"""Plain Keras after meshfit.connect() (meshfit.keras_hooks, devices.keep_cpu_collectives_safe):
the XLA:CPU setting that keeps several CPU devices from aborting, and what plain `fit` prints."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import environment

from meshfit import cluster, devices

SAFE = "--xla_cpu_multi_thread_eigen=false"


@pytest.mark.parametrize("flags, expected", [
    ("--xla_force_host_platform_device_count=8", f"--xla_force_host_platform_device_count=8 {SAFE}"),
    ("--xla_force_host_platform_device_count=1", "--xla_force_host_platform_device_count=1"),
    ("--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=true",  # the user's choice
     "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=true"),
    ("", ""),
])
def test_single_threaded_kernels_are_asked_for_with_several_cpu_devices(monkeypatch, flags, expected):
    monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.setattr(cluster, "jax_started", lambda: False)
    devices.keep_cpu_collectives_safe()
    assert os.environ["XLA_FLAGS"] == expected


FRESH = textwrap.dedent("""
    import json, os
    import meshfit
    strategy = meshfit.connect(verbose=False)
    print(json.dumps({"flags": os.environ["XLA_FLAGS"], "replicas": strategy.replicas}))
""")


@pytest.mark.parametrize("changes", [
    {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "MESHFIT_SIMULATE_DEVICES": None},  # the user's
    {"XLA_FLAGS": "", "MESHFIT_SIMULATE_DEVICES": "4"},  # meshfit's simulation
])
def test_connect_sets_it_before_jax_starts(changes):
    out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=120,
                         env=environment({**changes, "KERAS_BACKEND": None, "MESHFIT_ENGINE": "jax"}))
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["replicas"] == 4
    assert SAFE in result["flags"].split()


def tiny_model(strategy):
    import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_plain_fit_prints_the_epoch_report_after_connect(strategy, capsys):
    x = np.random.default_rng(0).normal(size=(100, 4)).astype("float32")
    y = np.arange(100) % 3
    model = tiny_model(strategy)
    model.fit(x, y, batch_size=32, epochs=2, verbose=2)  # outside the scope: connect() set it
    printed = capsys.readouterr().out
    assert "epoch 2/2  accuracy" in printed and "samples/s" in printed  # meshfit's line
    assert "4/4 - " in printed  # Keras' own line: 32+32+32+4, the last batch computed whole
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert "epoch 1/1" not in capsys.readouterr().out  # verbose=0 stays silent
