"""The epoch report (meshfit.watch.report): throughput, compile time and the XLA FLOP count."""

import re

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
    from meshfit.watch.report import train_step_flops

    flops = train_step_flops(compiled_cnn(strategy), 64)
    # Conv 26*26*64*9*2 FLOPs forward per image; backward roughly doubles it twice.
    forward_conv = 26 * 26 * 64 * 9 * 2 * 64
    assert 2 * forward_conv < flops < 10 * forward_conv
