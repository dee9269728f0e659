"""Progress bars (meshfit.watch.progress): drawn on terminals only."""

import io
import subprocess
import sys

import numpy as np
from helpers import ONE_CPU, environment


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_bars_only_on_a_terminal_that_can_draw(monkeypatch):
    from meshfit.watch.progress import bars

    monkeypatch.setenv("TERM", "xterm")
    assert bars(FakeTTY()) and not bars(io.StringIO())
    monkeypatch.setenv("TERM", "dumb")
    assert not bars(FakeTTY())


def test_no_bars_in_a_process_of_a_multi_process_job(monkeypatch):
    """mpirun gives each rank a pseudo-terminal while the job's output goes to a log: a job's
    processes print lines only (the run itself: tests/test_schedulers.py)."""
    from meshfit.parallel import cluster
    from meshfit.watch.progress import bars

    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(cluster, "multi_process", lambda: True)
    assert not bars(FakeTTY())


def test_track_is_a_passthrough_off_a_terminal(capsys):
    from rich.console import Console

    from meshfit.watch.progress import track

    items = [1, 2, 3]
    assert track(items, None, "plain") is items  # pytest's stdout is no terminal
    assert list(track(items, 3, "pipe", console=Console(file=io.StringIO()))) == items
    out = io.StringIO()
    assert list(track(iter(items), 3, "copying", console=Console(file=out, force_terminal=True))) == items
    assert "copying" in out.getvalue()
    assert capsys.readouterr().out == ""


def test_import_does_not_import_keras():
    code = "import sys, meshfit.watch.progress; sys.exit('keras' in sys.modules or 'rich' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=environment(ONE_CPU)).returncode == 0


def _fit(strategy, bar):
    import keras

    x = np.random.default_rng(0).normal(size=(48, 4)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    strategy.fit(model, x, np.arange(48) % 3, batch_size=8, epochs=2, callbacks=[bar], report=False)


def test_no_bar_off_a_terminal(strategy, capsys):
    from rich.console import Console

    from meshfit.watch.keras_side.progress_bar import ProgressBar

    out = io.StringIO()
    _fit(strategy, ProgressBar(global_batch=8, console=Console(file=out)))
    _fit(strategy, ProgressBar(global_batch=8))  # stdout: pytest's capture, no terminal
    assert out.getvalue() == "" and capsys.readouterr().out == ""


def test_bar_on_a_terminal_shows_steps_and_speed(strategy):
    from rich.console import Console

    from meshfit.watch.keras_side.progress_bar import ProgressBar

    out = io.StringIO()
    bar = ProgressBar(global_batch=8, console=Console(file=out, force_terminal=True, width=120))
    _fit(strategy, bar)
    text = out.getvalue()
    assert "epoch 1/2" in text and "epoch 2/2" in text
    assert "6/6" in text and "samples/s" in text and "loss " in text
    assert bar._progress is None  # stopped: the transient bar is erased at each epoch end


def test_task_draws_on_a_terminal_only(capsys):
    from rich.console import Console

    from meshfit.watch.progress import counted, task

    out = io.StringIO()
    with task("evaluating", total=3, console=Console(file=out, force_terminal=True)) as advance:
        assert list(counted([1, 2, 3], advance)) == [1, 2, 3]
    assert "evaluating" in out.getvalue()
    with task("downloading", total=None, data_bytes=True) as advance:  # pytest's stdout: no terminal
        advance(1 << 20)
    assert capsys.readouterr().out == ""
