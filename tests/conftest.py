"""Tests run on 8 simulated JAX CPU devices with the JAX engine unless a test says otherwise."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
