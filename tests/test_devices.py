"""Device discovery (meshfit.parallel.devices) through meshfit.connect and `meshfit info`."""

import json

import pytest
from helpers import run_meshfit

import meshfit


def test_connect_finds_eight_simulated_devices(strategy):
    assert strategy.replicas == 8
    assert strategy.platform == "cpu"
    assert strategy.precision == "float32"
    assert strategy.describe()["simulated"] is True


def test_simulate_after_jax_started_is_a_clear_error(strategy):
    with pytest.raises(meshfit.MeshfitError, match="JAX already started with 8 cpu device"):
        meshfit.connect(simulate_devices=4, verbose=False)


def test_a_count_of_simulated_devices_may_be_its_digits_and_nothing_else(strategy, monkeypatch):
    """A program's `connect(simulate=sys.argv[1])` gets its devices; a word is one line, not
    Python's TypeError from comparing a string with 1."""
    from meshfit.parallel import devices

    assert devices.requested_simulation(" 8") == devices.requested_simulation(8) == 8
    meshfit.connect(simulate="8", engine="jax", verbose=False)  # the 8 devices JAX has: accepted
    for bad in ("eight", "8.0", True):
        with pytest.raises(meshfit.MeshfitError, match=f"simulate_devices={bad!r} is not a whole number"):
            meshfit.connect(simulate=bad, verbose=False)
    monkeypatch.delenv("MESHFIT_SIMULATE_DEVICES", raising=False)
    assert devices.requested_simulation(None) is None


def test_cli_info_json_reports_eight_replicas():
    out = run_meshfit("info", "--simulate-devices", "8", "--json", env={"XLA_FLAGS": ""}, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["replicas"] == 8 and info["platform"] == "cpu"


@pytest.mark.parametrize("args, message", [
    (["info", "--precision", "fp8x"], "unknown precision 'fp8x'"),
    (["info", "--simulate-devices", "0"], "at least 1"),
    (["info", "--require", "tpu"], "no TPU found"),
])
def test_cli_bad_input_is_one_line(args, message):
    out = run_meshfit(*args, env={"XLA_FLAGS": ""}, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and message in out.stderr
    assert "Traceback" not in out.stderr
