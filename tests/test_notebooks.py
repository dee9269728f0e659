"""The notebooks in notebooks/: committed without outputs, and each run top to bottom in a real
Jupyter kernel (nbclient, ipykernel) on one CPU, with tiny parameters and tiny generated data."""

import glob
import os
import re

import nbformat
import numpy as np
import pytest
from helpers import ONE_CPU, environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_notebooks_are_committed_without_outputs():
    assert len(NOTEBOOKS) >= 4
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, \
                    f"{os.path.basename(path)} has outputs: clear them before committing"
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{os.path.basename(path)} needs one cell tagged 'parameters'"
        first = next(c for c in nb.cells if c.cell_type == "code")
        # meshfit is not on PyPI: the repository's address or a wheel, never the bare name
        assert "%pip install" in first.source and "meshfit[tpu] @ git+" in first.source
        installs = [line for line in first.source.splitlines() if "%pip install" in line]
        assert all("git+" in line or ".whl" in line for line in installs), installs


@pytest.fixture(scope="module")
def notebook_data(tmp_path_factory):
    """Tiny Fashion-MNIST and MNIST (easy banded images: a few steps learn them) and CIFAR-10, in
    their canonical files."""
    from meshfit.data import datasets, file_formats

    root = tmp_path_factory.mktemp("notebook-data")
    for name, seed in (("fashion-mnist", 0), ("mnist", 1)):
        os.makedirs(root / name)
        arrays = banded_images(512, seed) + banded_images(64, seed + 10)
        for file, array in zip(datasets.IDX_FILES, arrays):
            file_formats.write_idx(root / name / file, array)
    folder = root / "cifar10" / datasets.CIFAR_DIR
    folder.mkdir(parents=True)
    rng = np.random.default_rng(2)
    for i, name in enumerate(datasets.CIFAR_FILES):
        y = rng.integers(0, 10, 16)
        x = np.clip(rng.normal(20 * y[:, None, None, None], 30, (16, 32, 32, 3)), 0, 255)
        file_formats.write_cifar_batch(folder / name, x, y, datasets.CLASS_NAMES["cifar10"] if i == 0 else None)
    return str(root)


def banded_images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n noisy 28x28 images whose class (0-9) is which band of 2 rows is bright, and labels."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, n).astype(np.uint8)
    x = rng.integers(0, 80, (n, 28, 28))
    for i, label in enumerate(y):
        x[i, 4 + 2 * label:6 + 2 * label] += 150
    return x.astype(np.uint8), y


def run_notebook(name: str, cwd, **parameters) -> str:
    """Execute notebooks/<name>.ipynb in a new kernel in `cwd`, `parameters` set after its
    parameters cell (as papermill does); returns all it printed. Fails on any cell's error."""
    from nbclient import NotebookClient

    nb = nbformat.read(os.path.join(ROOT, "notebooks", f"{name}.ipynb"), as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(
        "\n".join(f"{key} = {value!r}" for key, value in parameters.items())))
    env = environment({**ONE_CPU, "MESHFIT_OFFLINE": "1", "MESHFIT_DATA": None,
                       "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    displayed = []  # the text of every display and display update the kernel sent

    class Client(NotebookClient):
        def process_message(self, msg, cell, cell_index):
            if msg["msg_type"] in ("display_data", "update_display_data"):
                displayed.append(msg["content"]["data"].get("text/plain", ""))
            return super().process_message(msg, cell, cell_index)

    client = Client(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(cwd)}})
    client.execute(env=env, cwd=str(cwd))
    run_notebook.last, run_notebook.displayed = nb, displayed
    return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.outputs if out.output_type == "stream")


def outputs_of(nb, mime: str) -> list:
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
            if mime in out.get("data", {})]


def accuracy(printed: str) -> float:
    found = re.findall(r"(?:test|validation) accuracy (\d\.\d+)", printed)
    assert found, printed
    return float(found[-1])


def test_fashion_mnist_notebook(notebook_data, tmp_path):
    printed = run_notebook("01_fashion_mnist_cnn", tmp_path, epochs=3, batch_size=32,
                           data_dir=notebook_data)
    assert accuracy(printed) > 0.5, printed  # 10 classes: chance is 0.1
    assert "samples/s" in printed  # meshfit's epoch line under plain model.fit
    # The live bar: one output redrawn in place, emptied at each epoch's end for the epoch line;
    # no carriage-return progress in the printed text.
    bars = [text for text in run_notebook.displayed if text.startswith("epoch ")]
    assert any(text.startswith("epoch 1/3") for text in bars), run_notebook.displayed
    assert any(text.startswith("epoch 3/3") for text in bars), run_notebook.displayed
    assert run_notebook.displayed.count("") >= 3 and "\r" not in printed


def test_cifar10_notebook_classifies_one_image_on_the_cpu(notebook_data, tmp_path):
    from meshfit.data.datasets import CLASS_NAMES

    printed = run_notebook("02_cifar10_cnn_cpu_inference", tmp_path, epochs=1, per_core_batch=32,
                           data_dir=notebook_data)
    accuracy(printed)
    predicted = re.search(r"predicted: (\w+) \(", printed)
    assert predicted and predicted.group(1) in CLASS_NAMES["cifar10"], printed
    assert outputs_of(run_notebook.last, "image/png"), "no picture of the classified image"


def test_mnist_bfloat16_notebook(notebook_data, tmp_path):
    printed = run_notebook("03_mnist_mlp_bfloat16", tmp_path, epochs=3, batch_size=32,
                           data_dir=notebook_data)
    assert "compute dtype: bfloat16" in printed
    assert accuracy(printed) > 0.5, printed


def test_own_images_notebook_trains_and_predicts(tmp_path):
    printed = run_notebook("04_your_own_images", tmp_path, epochs=3, predict_backend="keras")
    assert accuracy(printed) > 0.5, printed  # 3 classes: chance is 1/3
    predictions = re.findall(r"^\S+\.png: (\w+) \(", printed, re.MULTILINE)
    assert len(predictions) == 3 and set(predictions) <= {"horizontal", "vertical", "dots"}, printed
    assert outputs_of(run_notebook.last, "image/png")
    assert os.path.isfile(tmp_path / "runs" / "my-images" / "model.keras")
