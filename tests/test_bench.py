"""`meshfit bench`: end to end in small settings, its ratios and its errors."""

import csv
import glob
import json
import os

import pytest
from helpers import ONE_CPU, run_meshfit

from meshfit import recipes
from meshfit.commands.bench import step, table

TINY = ["--global-batches", "8", "--repeats", "2", "--steps", "2"]
BENCH_TIMEOUT = 400  # seconds


@pytest.mark.slow
def test_bench_times_every_engine_path_and_dispatch_and_writes_csv_json_png(tmp_path):
    out = tmp_path / "bench"
    result = run_meshfit("bench", "mnist-mlp-bf16", "--engines", "jax,tensorflow",
                         "--steps-per-dispatch", "1,2", *TINY, "--profile", "3:4", "--out", str(out),
                         env=ONE_CPU, timeout=BENCH_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "vs fastest" in result.stdout and "fastest plain-Keras row" in result.stdout
    assert "bench: jax meshfit bfloat16 batch 8 x2:" in result.stderr  # progress, relayed live

    with open(out / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(table.COLUMNS)
    combos = {(r["engine"], r["path"], r["steps_per_dispatch"]) for r in rows}
    assert combos == {(e, p, k) for e in ("jax", "tensorflow") for p in ("plain", "meshfit") for k in ("1", "2")}
    for r in rows:
        assert r["precision"] == "bfloat16" and r["global_batch"] == "8"
        assert float(r["mfu"]) > 0  # against the CPU peak measured in bfloat16 (watch.peak)
        assert float(r["ms_per_step"]) > 0 and float(r["compile_s"]) >= 0
        assert float(r["samples_per_s"]) == pytest.approx(8 / (float(r["ms_per_step"]) / 1000))
        assert float(r["vs_fastest"]) <= 1.0 or r["path"] == "meshfit"
        if r["path"] == "plain":
            assert float(r["vs_plain"]) == 1.0
    assert max(float(r["vs_fastest"]) for r in rows if r["path"] == "plain") == 1.0

    saved = json.loads((out / "bench.json").read_text())
    assert saved["recipe"] == "mnist-mlp-bf16" and len(saved["rows"]) == 8
    assert saved["machine"]["platform"] == "cpu" and saved["machine"]["devices"] == 1
    assert all(len(r["epoch_seconds"]) == 3 for r in saved["rows"])  # warm-up + 2 repeats
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --profile: a trace of steps 3-4 for each meshfit row, none for plain Keras
    traced = {os.path.relpath(path, out / "profile").split(os.sep)[0]
              for path in glob.glob(str(out / "profile" / "*" / "plugins" / "profile" / "*" / "*.xplane.pb"))}
    assert traced == {f"{e}-meshfit-bfloat16-batch8-x{k}" for e in ("jax", "tensorflow") for k in (1, 2)}


@pytest.mark.slow
def test_bench_cifar10_cnn_runs_two_rounds_and_prints_json(tmp_path):
    result = run_meshfit("bench", "cifar10-cnn", "--engines", "tensorflow", "--global-batches", "4",
                         "--repeats", "1", "--steps", "1", "--rounds", "2", "--out", str(tmp_path),
                         "--json", env=ONE_CPU, timeout=BENCH_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("bench: tensorflow plain float32 batch 4 x1:") == 2
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert [(r["engine"], r["path"]) for r in data["rows"]] == [("tensorflow", "plain"), ("tensorflow", "meshfit")]
    assert all(r["rounds"] == 2 and len(r["rounds_samples_per_s"]) == 2 for r in data["rows"])
    assert data["rows"][1]["auto_engine"] == "tensorflow"  # meshfit's own choice on one CPU
    assert os.path.isfile(tmp_path / "bench.csv") and os.path.isfile(tmp_path / "bench.png")


def test_bench_engine_that_cannot_run_the_devices_is_one_line_error(tmp_path):
    result = run_meshfit("bench", "--engines", "tensorflow", "--simulate-devices", "8", *TINY,
                         "--out", str(tmp_path), env=ONE_CPU, timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("meshfit: error")]
    assert len(lines) == 1 and "runs on one CPU device" in lines[0] and "--engine jax" in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--global-batches", "0"], "--global-batches takes whole numbers"),
    (["--engines", "mxnet"], "unknown engine 'mxnet'"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--precisions", "fp8x"], "unknown precision 'fp8x'"),
    (["no-such-recipe"], "unknown recipe 'no-such-recipe'"),
])
def test_bench_bad_flags_are_one_line_errors(args, message):
    result = run_meshfit("bench", *args, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr


def test_median_over_rounds_keeps_one_row_per_measurement():
    def row(path, sps, k=1):
        return {"engine": "tensorflow", "path": path, "precision": "float32", "global_batch": 256,
                "steps_per_dispatch": k, "samples_per_s": sps, "ms_per_step": 256e3 / sps}

    rounds = [row("plain", 900.0), row("meshfit", 500.0), row("plain", 1000.0),
              row("meshfit", 1100.0), row("plain", 400.0), row("meshfit", 1050.0), row("plain", 7.0, k=8)]
    merged = {(r["path"], r["steps_per_dispatch"]): r for r in step.median_over_rounds(rounds)}
    assert sorted(merged) == [("meshfit", 1), ("plain", 1), ("plain", 8)]
    assert merged["plain", 1]["samples_per_s"] == 900.0 and merged["plain", 1]["rounds"] == 3
    assert merged["meshfit", 1]["samples_per_s"] == 1050.0
    assert merged["meshfit", 1]["ms_per_step"] == pytest.approx(256e3 / 1050.0)  # from the same round
    assert merged["meshfit", 1]["rounds_samples_per_s"] == [500.0, 1100.0, 1050.0]
    assert merged["plain", 8]["rounds"] == 1


def test_ratios_compare_with_plain_and_with_the_fastest_plain_engine():
    def row(engine, path, sps, k=1):
        return {"engine": engine, "path": path, "precision": "float32", "global_batch": 256,
                "steps_per_dispatch": k, "samples_per_s": sps, "auto_engine": "tensorflow"}

    rows = [row("jax", "plain", 200.0), row("jax", "meshfit", 196.0), row("tensorflow", "plain", 1000.0),
            row("tensorflow", "meshfit", 1200.0), row("jax", "meshfit", 300.0, k=8)]
    step.add_ratios(rows)
    assert [r["vs_plain"] for r in rows] == [1.0, 0.98, 1.0, 1.2, None]  # no plain x8 row measured
    assert [r["vs_fastest"] for r in rows] == [0.2, 0.196, 1.0, 1.2, 0.3]
    result = {"recipe": "r", "date": "d", "machine": {"auto_engine": "tensorflow"}, "rows": rows,
              "baseline": "stated baseline", "skipped": []}
    text = table.format_table(result)
    assert "tensorflow*" in text and "stated baseline" in text and "1.20x" in text


def test_random_labels_have_the_classes_the_model_is_built_with():
    from meshfit.commands.bench.keras_side import timing

    assert timing.class_count(recipes.load("fashion-mnist-cnn")) == 10
    assert timing.class_count(recipes.load("resnet50-synthetic")) == 1000  # build_model's default head
