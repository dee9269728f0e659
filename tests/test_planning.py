"""Planning from the hardware (meshfit.parallel.planning): precision and peak FLOP/s."""

import pytest

import meshfit
from meshfit.parallel import planning


def test_precision_auto_and_forced():
    assert planning.resolve_precision("auto", "tpu") == "bfloat16"
    assert planning.resolve_precision("auto", "gpu", "9.0") == "bfloat16"
    assert planning.resolve_precision("auto", "gpu", "7.0") == "float16"
    assert planning.resolve_precision("auto", "cpu") == "float32"
    assert planning.resolve_precision("bf16", "cpu") == "bfloat16"
    with pytest.raises(meshfit.MeshfitError, match="unknown precision 'fp8x'.*float32, bfloat16, float16"):
        planning.resolve_precision("fp8x", "cpu")


def test_peak_flops_known_for_accelerators_and_not_cpus():
    assert planning.peak_flops("gpu", "NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert planning.peak_flops("tpu", "TPU v4", "bfloat16") == 275e12
    assert planning.peak_flops("cpu", "AMD EPYC 7B13", "float32") is None
