"""Step time training from an image folder (streamed from disk) vs the same images in memory.

Usage: python benchmarks/folder_vs_memory.py FOLDER --data-dir DIR [--rounds 3] [--steps 100]

FOLDER holds MNIST's training digits as PNGs, one sub-folder per class (0..9), e.g. written by
`python benchmarks/folder_vs_memory.py FOLDER --data-dir DIR --write`. Both sides train the
image-folder recipe's small CNN (meshfit.recipes.image_folder) on 28x28 grey images with the same
batch, split and steps, through `meshfit train`, alternating, `--rounds` times; the figure is the
median ms/step of the second epoch (no compile), and the ratio folder / memory.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MEMORY_RECIPE = '''"""The image-folder CNN on MNIST's training images in memory (for folder_vs_memory.py)."""
import meshfit
from meshfit.data import datasets
from meshfit.recipes import image_folder


def dataset(seed):
    data = datasets.load("mnist", {data_dir!r})
    return (data.x_train, data.y_train), (data.x_train[:0], data.y_train[:0])


RECIPE = meshfit.Recipe(name="mnist-in-memory", dataset=dataset, build_model=image_folder.build_cnn,
                        optimizer=image_folder.optimizer, epochs=2, validation_split=0.2)
'''


def write_folder(folder: str, data_dir: str) -> None:
    from PIL import Image

    from meshfit.data import datasets

    data = datasets.load("mnist", data_dir)
    for i, (x, y) in enumerate(zip(data.x_train, data.y_train)):
        os.makedirs(os.path.join(folder, str(y)), exist_ok=True)
        Image.fromarray(x[..., 0]).save(os.path.join(folder, str(y), f"{i:05d}.png"))


def ms_per_step(args: list[str], out: str) -> float:
    subprocess.run([sys.executable, "-m", "meshfit", "train", *args, "--out", out, "--epochs", "2",
                    "--checkpoint-every", "off", "--no-tensorboard"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out, "history.json")) as f:
        return json.load(f)[-1]["ms_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--write", action="store_true", help="write the folder of PNGs and stop")
    args = parser.parse_args()
    if args.write:
        write_folder(args.folder, args.data_dir)
        return
    work = tempfile.mkdtemp(prefix="folder-vs-memory-")
    recipe = os.path.join(work, "memory.py")
    with open(recipe, "w") as f:
        f.write(MEMORY_RECIPE.format(data_dir=os.path.abspath(args.data_dir)))
    steps = ["--steps-per-epoch", str(args.steps)]
    times = {"folder": [], "memory": []}
    for r in range(args.rounds):
        times["folder"].append(ms_per_step(["--data", args.folder, "--image-size", "28", "28",
                                            *steps], os.path.join(work, f"folder-{r}")))
        times["memory"].append(ms_per_step([recipe, *steps], os.path.join(work, f"memory-{r}")))
        print(f"round {r + 1}: folder {times['folder'][-1]:.1f} ms/step, memory "
              f"{times['memory'][-1]:.1f} ms/step", flush=True)
    folder, memory = (statistics.median(times[k]) for k in ("folder", "memory"))
    print(json.dumps({"folder_ms_per_step": folder, "memory_ms_per_step": memory,
                      "folder_vs_memory": folder / memory, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
