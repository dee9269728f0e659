"""The epoch report (meshfit.watch.keras_side.report): throughput, compile time and the XLA FLOP count."""

import re

import pytest

from helpers import compiled_cnn, random_images


def test_epoch_line_reports_throughput_and_compile_apart(strategy, capsys):
    x, y = random_images(512, seed=1)
    model = compiled_cnn(strategy, metrics=["accuracy"])
    strategy.fit(model, x, y, batch_size=64, epochs=2, validation_data=(x[:128], y[:128]))
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("epoch ")]
    assert len(lines) == 2
    assert "samples/s" in lines[0] and "ms/step" in lines[0] and "compile" in lines[0]
    assert "compile" not in lines[1]
    # CPU: no published peak, so MFU is against the measured one (meshfit.watch.peak)
    assert all(0 < float(re.search(r"MFU ([0-9.]+)%", line).group(1)) < 100 for line in lines)


def test_train_step_flops_come_from_xla(strategy):
    from meshfit.watch.keras_side.report import train_step_flops

    flops = train_step_flops(compiled_cnn(strategy), 64)
    # Conv 26*26*64*9*2 FLOPs forward per image; backward roughly doubles it twice.
    forward_conv = 26 * 26 * 64 * 9 * 2 * 64
    assert 2 * forward_conv < flops < 10 * forward_conv


def test_the_flop_count_is_kept_per_model_and_batch(strategy, tmp_path, monkeypatch):
    from meshfit.watch.keras_side import report

    import tensorflow  # noqa: F401 (the key is made where TensorFlow is loaded: flops_key)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = compiled_cnn(strategy)
    counted = report.train_step_flops(model, 64)
    assert counted and (tmp_path / "meshfit" / "flops.json").is_file()

    def count_again(*_):
        raise AssertionError("counted again")

    monkeypatch.setattr(report, "count_train_step_flops", count_again)
    assert report.train_step_flops(model, 64) == counted  # the same model and batch: kept
    with pytest.raises(AssertionError, match="counted again"):
        report.train_step_flops(model, 128)  # another batch is another count
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")  # another optimizer
    assert report.flops_key(model, 64) != report.flops_key(compiled_cnn(strategy), 64)
    monkeypatch.setattr(report, "count_train_step_flops", lambda *_: 123.0)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))  # no cache can be written there
    assert report.train_step_flops(model, 64) == report.train_step_flops(model, 64) == 123.0
