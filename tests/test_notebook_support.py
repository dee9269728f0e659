"""meshfit as a notebook user expects it, checked in this process with a stand-in kernel: live bars
redrawn in one output, figures that show themselves, connect() run twice. The notebooks themselves
run in a real kernel in test_notebooks.py."""

import numpy as np
import pytest

import meshfit


class FakeHandle:
    """An IPython DisplayHandle that records what it was given."""

    def __init__(self, shown):
        self.shown = shown

    def update(self, data, raw=False):
        self.shown.append(data["text/plain"])


@pytest.fixture
def kernel(monkeypatch):
    """A notebook for meshfit.watch.progress: ipykernel imported, get_ipython() has a kernel, and
    IPython's display() recorded; returns the list of texts shown, in order."""
    import IPython
    import IPython.display

    class Shell:
        kernel = object()

    shown = []

    def display(data, raw=False, display_id=False):
        assert raw and display_id
        shown.append(data["text/plain"])
        return FakeHandle(shown)

    monkeypatch.setitem(__import__("sys").modules, "ipykernel", object())
    monkeypatch.setattr(IPython, "get_ipython", lambda: Shell())
    monkeypatch.setattr(IPython.display, "display", display)
    return shown


def test_a_notebook_is_told_apart_from_a_terminal_and_a_pipe(kernel, monkeypatch):
    import IPython

    from meshfit import env
    from meshfit.watch import progress

    assert env.notebook() and progress.live()
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)  # IPython in a terminal, no kernel
    assert not env.notebook()


def test_the_bar_is_one_output_redrawn_then_emptied_for_the_epoch_line(kernel, strategy, capsys):
    from meshfit.watch.keras_side.progress_bar import ProgressBar

    import keras

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    strategy.fit(model, x, np.arange(64) % 3, batch_size=8, epochs=2,
                 callbacks=[ProgressBar(global_batch=8, refresh_per_second=1000)], report=False)
    assert "\r" not in capsys.readouterr().out
    epochs = [i for i, text in enumerate(kernel) if text.startswith("epoch ")]
    assert kernel[epochs[0]].startswith("epoch 1/2") and kernel[epochs[-1]].startswith("epoch 2/2")
    assert any("8/8" in text and "samples/s" in text for text in kernel), kernel
    assert kernel[-1] == "" and kernel.count("") == 2  # each epoch's bar emptied at its end


def test_plain_fit_in_a_notebook_shows_meshfit_bar_instead_of_keras(kernel, strategy, capsys):
    import keras

    x = np.random.default_rng(1).normal(size=(64, 4)).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, np.arange(64) % 3, batch_size=8, epochs=1)
    out = capsys.readouterr().out
    assert "\r" not in out and "━" not in out, out  # no Keras bar
    assert "samples/s" in out  # meshfit's epoch line
    assert kernel and kernel[0].startswith("epoch 1/1") and kernel[-1] == ""


def test_task_in_a_notebook_is_one_output(kernel):
    from meshfit.watch import progress

    with progress.task("evaluating", total=3) as advance:
        for _ in range(3):
            advance(1)
    assert kernel[0].startswith("evaluating") and kernel[-1] == ""
    assert list(progress.track([1, 2], description="copying")) == [1, 2]


def test_connect_again_in_the_same_process(strategy, kernel):
    again = meshfit.connect(simulate_devices=8, engine="jax", verbose=False)
    assert again.replicas == strategy.replicas == 8
    assert meshfit.connect(verbose=False).replicas == 8  # the devices JAX has
    with pytest.raises(meshfit.MeshfitError) as caught:
        meshfit.connect(simulate_devices=4, verbose=False)
    message = str(caught.value)
    assert "\n" not in message and "8 cpu device(s)" in message
    assert "restart the kernel and call meshfit.connect(simulate_devices=4)" in message, message


def test_figures_show_themselves_as_png(tmp_path):
    from meshfit.serve import inference
    from meshfit.commands import runs

    rows = inference.results(["a.png"], np.array([[0.1, 0.7, 0.2]]), ["cat", "dog", "eel"], 2)
    picture = inference.figure(np.zeros((1, 8, 8, 3), np.uint8), rows)
    history = [{"epoch": 1, "accuracy": 0.5, "val_accuracy": 0.4, "loss": 1.0, "val_loss": 1.2,
                "train_seconds": 2.0}]
    plot = runs.plot([{"run": str(tmp_path), "recipe": "r", "platform": "cpu", "replicas": 1,
                       "engine": "jax"}], [history], str(tmp_path / "runs.png"))
    for figure in (picture, plot):
        assert figure._repr_png_().startswith(b"\x89PNG")
    assert (tmp_path / "runs.png").read_bytes().startswith(b"\x89PNG")
