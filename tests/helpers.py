"""Shared test helpers: environments for meshfit subprocesses."""

import os

# A plain single-CPU process: no simulated devices, and meshfit chooses the engine.
ONE_CPU = {"XLA_FLAGS": "", "KERAS_BACKEND": None, "MESHFIT_ENGINE": None, "MESHFIT_SIMULATE_DEVICES": None}


def environment(changes=None) -> dict:
    """This process's environment with `changes` applied (a value of None removes the variable)."""
    merged = dict(os.environ)
    for key, value in (changes or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged
