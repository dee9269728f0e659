"""`meshfit runs` (meshfit.commands.runs) over run directories written by hand."""

import json
import os

import pytest

from meshfit.commands import runs
from meshfit.cli import main
from meshfit.errors import MeshfitError

CONFIG = {"recipe": "fashion-mnist-cnn", "epochs": 3, "engine": "tensorflow", "replicas": 1,
          "precision": "float32", "platform": "cpu", "device_kind": "Intel Xeon"}


def record(epoch, accuracy, seconds=2.0, mfu=None):
    return {"epoch": epoch, "loss": 1.0 / epoch, "accuracy": accuracy - 0.05,
            "val_loss": 1.2 / epoch, "val_accuracy": accuracy, "train_seconds": seconds,
            "ms_per_step": 10.0, "samples_per_second": 100.0, "mfu": mfu, "samples": 200}


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(data if isinstance(data, str) else json.dumps(data))


@pytest.fixture
def folder(tmp_path):
    """runs/: a finished run on 8 TPU cores, an unfinished one, a damaged one and a non-run."""
    root = tmp_path / "runs"
    done = root / "a-finished"
    write(done / "config.json", {**CONFIG, "engine": "jax", "replicas": 8, "platform": "tpu",
                                 "device_kind": "TPU v4", "precision": "bfloat16"})
    write(done / "history.json", [record(1, 0.8, mfu=0.3), record(2, 0.85, mfu=0.5), record(3, 0.9, mfu=0.4)])
    write(done / "metrics.json", {**CONFIG, "engine": "jax", "replicas": 8, "platform": "tpu",
                                  "device_kind": "TPU v4", "precision": "bfloat16",
                                  "test_accuracy": 0.9, "train_seconds": 6.0,
                                  "samples_per_second": 100.0})
    cut = root / "b-unfinished"
    write(cut / "config.json", CONFIG)
    write(cut / "checkpoints" / "ckpt-00000100" / "state.json", {"history": [record(1, 0.7)]})
    write(cut / "checkpoints" / "ckpt-00000200" / "state.json",
          {"epoch": 2, "step": 0, "history": [record(1, 0.7), record(2, 0.75, seconds=3.0)]})
    os.makedirs(cut / "checkpoints" / "ckpt-00000300.tmp")  # a save cut short: ignored
    write(root / "c-damaged" / "config.json", CONFIG)
    write(root / "c-damaged" / "metrics.json", '{"test_accuracy": 0.')
    os.makedirs(root / "not-a-run")
    return root


def test_collect_finished_unfinished_and_unreadable(folder):
    rows = runs.collect([str(folder)])
    assert [os.path.basename(r["run"]) for r in rows] == ["a-finished", "b-unfinished", "c-damaged"]
    done, cut, damaged = rows
    assert done["status"] == "finished" and done["epochs"] == "3/3"
    assert (done["engine"], done["replicas"], done["device_kind"]) == ("jax", 8, "TPU v4")
    assert done["test_accuracy"] == 0.9 and done["train_seconds"] == 6.0
    assert done["mfu"] == pytest.approx(0.4)
    assert cut["status"] == "unfinished" and cut["epochs"] == "2/3"  # from the newest checkpoint
    assert cut["test_accuracy"] == 0.75 and cut["train_seconds"] == 5.0
    assert cut["samples_per_second"] == pytest.approx(400 / 5.0) and cut["mfu"] is None
    assert damaged["status"].startswith("unreadable: metrics.json: ")
    assert runs.collect([str(folder / "a-finished")]) == [done]  # a run directory itself


def test_unfinished_run_without_checkpoint_and_missing_paths(tmp_path):
    write(tmp_path / "r" / "config.json", CONFIG)
    (row,) = runs.collect([str(tmp_path / "r")])
    assert row["status"] == "unfinished" and row["epochs"] == "0/3" and row["test_accuracy"] is None
    write(tmp_path / "bad" / "config.json", "not json")
    assert runs.collect([str(tmp_path / "bad")])[0]["status"].startswith("unreadable: config.json")
    write(tmp_path / "list" / "config.json", [1, 2])
    assert runs.collect([str(tmp_path / "list")])[0]["status"].startswith("unreadable: ")
    with pytest.raises(MeshfitError, match="nowhere is not a directory"):
        runs.collect([str(tmp_path / "nowhere")])


def test_table_and_json(folder):
    rows = runs.collect([str(folder)])
    table = runs.format_table(rows).splitlines()
    assert table[0].split()[:3] == ["run", "recipe", "device"]
    assert len(table) == 4
    assert "TPU v4" in table[1] and "90.00%" in table[1] and "40.0%" in table[1] and "finished" in table[1]
    assert "2/3" in table[2] and "unfinished" in table[2] and "75.00% val" in table[2]  # not scored yet
    assert "90.00% val" not in table[1] and rows[0]["scored_on"] == "test"
    assert "unreadable: metrics.json" in table[3]
    assert {line.index("fashion-mnist-cnn") for line in table[1:]} == {table[0].index("recipe")}
    assert "Intel Xeon" in table[3]  # a damaged metrics.json: the settings still shown
    assert json.loads(runs.to_json(rows)) == rows
    assert runs.format_table([]) == "no runs found"


def test_labels():
    assert runs.label({**CONFIG}) == "fashion-mnist-cnn cpu x1 tensorflow"
    assert runs.label({**CONFIG, "platform": "tpu", "device_kind": "TPU v4", "replicas": 8,
                       "engine": "jax"}) == "fashion-mnist-cnn TPU v4 x8 jax"


def test_cli_prints_and_plots(folder, tmp_path, capsys):
    out = tmp_path / "runs.png"
    assert main(["runs", str(folder), "--plot", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "a-finished" in printed and f"wrote {out}" in printed
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    assert main(["runs", str(folder), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3
