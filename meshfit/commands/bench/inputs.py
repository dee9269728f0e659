"""`meshfit bench --input FOLDER --image-size H W`: the input pipeline alone, on an image folder.

meshfit.data.folders's streamed batches (FolderTrainBatches) against
`keras.utils.image_dataset_from_directory` (tf.data: parallel decode, prefetch) on the same
folder, size, batch and shuffling, each in a fresh process per round, the paths alternating.
"""

from __future__ import annotations

import os
import sys
import time

from meshfit.commands.bench import table, worker
from meshfit.data import folder_scan, folders, image_files
from meshfit.errors import MeshfitError
from meshfit.parallel import devices as devices_lib
from meshfit.run import rundir

INPUT_PATHS = ("meshfit", "keras")  # FolderTrainBatches; keras.utils.image_dataset_from_directory
DEFAULT_INPUT_BATCH = 128
INPUT_WARMUP_BATCHES = 5


def bench_input(folder: str, image_size: tuple[int, int], channels: int = 3,
                global_batch: int = DEFAULT_INPUT_BATCH, rounds: int = 3, steps: int | None = None,
                out: str | None = None) -> dict:
    """Time the input pipeline alone on an image folder (see the module docstring); image_size
    is (height, width) in pixels; global_batch: images per batch (one process).

    Each measurement decodes INPUT_WARMUP_BATCHES batches, then times `steps` more (default: one
    epoch); images/s is the median over the rounds. Writes bench.json to `out` (default
    runs/bench-input-<time>/) and returns the results.
    """
    height, width = image_files.check_image_size(image_size, channels)
    if global_batch < 1 or rounds < 1 or (steps is not None and steps < 1):
        raise MeshfitError(f"--global-batches, --rounds and --steps must be at least 1, got "
                           f"{global_batch}, {rounds} and {steps}")
    found = folder_scan.scan(folder)  # bad folders fail here, in one line
    if len(found) < global_batch:
        raise MeshfitError(f"{folder} has {len(found)} readable images, fewer than the batch of "
                           f"{global_batch}; use a smaller --global-batches")
    spec = {"input": found.root, "image_size": [height, width], "channels": channels,
            "global_batch": global_batch, "steps": steps or len(found) // global_batch}
    rows, machine, skipped = [], None, []
    for _ in range(rounds):
        for path in (p for p in INPUT_PATHS if not any(s.startswith(p) for s in skipped)):
            found_rows, meta, error = worker.run("meshfit.commands.bench.inputs", {**spec, "path": path})
            if error:
                skipped.append(f"{path}: {error}")
                print(f"meshfit: note: skipped {path}: {error}", file=sys.stderr, flush=True)
                continue
            rows += found_rows
            machine = machine or meta
    merged = []
    for path in INPUT_PATHS:
        group = [r for r in rows if r["path"] == path]
        if group:
            row = dict(sorted(group, key=lambda r: r["images_per_s"])[(len(group) - 1) // 2])
            row.update(rounds=len(group), rounds_images_per_s=[r["images_per_s"] for r in group],
                       peak_rss_mb=max(r["peak_rss_mb"] for r in group))
            merged.append(row)
    ours = next((r["images_per_s"] for r in merged if r["path"] == "meshfit"), None)
    anchor = next((r["images_per_s"] for r in merged if r["path"] == "keras"), None)
    per_round = [a["images_per_s"] / b["images_per_s"] for a, b in
                 zip((r for r in rows if r["path"] == "meshfit"), (r for r in rows if r["path"] == "keras"))]
    out = out or rundir.timestamped("bench-input")
    result = {"input": found.root, "images": len(found), "skipped_files": len(found.skipped),
              "image_size": [height, width], "channels": channels, "global_batch": global_batch,
              "steps": spec["steps"], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": worker.command_line(),
              "machine": machine, "skipped": skipped, "out": out,
              "input_images_per_second": ours, "anchor_images_per_second": anchor,
              "vs_anchor": ours / anchor if ours and anchor else None,
              "rounds_vs_anchor": per_round, "rows": merged}
    table.write_json(result, out)
    return result


def measure(spec: dict) -> None:
    """(In the worker) time one input path (see bench_input) and hand back its row."""
    import resource

    height, width = spec["image_size"]
    batch, steps = spec["global_batch"], spec["steps"]
    worker.emit_machine({"cpu": devices_lib.cpu_model(), "cores": os.cpu_count(),
                         "python": sys.version.split()[0]})
    setup = time.perf_counter()
    if spec["path"] == "meshfit":
        folder = folder_scan.scan(spec["input"])
        batches = folders.FolderTrainBatches(folder, (height, width), spec["channels"], batch)
        stream = batches.iterate()
        detail = {"workers": batches.workers, "loader": "thread pool over Pillow"}
    else:
        os.environ["KERAS_BACKEND"] = "tensorflow"
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        try:
            import tensorflow  # noqa: F401 (image_dataset_from_directory is built on tf.data)
        except ImportError:
            raise MeshfitError("TensorFlow is not installed; the keras anchor needs it") from None
        import keras

        dataset = keras.utils.image_dataset_from_directory(
            spec["input"], image_size=(height, width), batch_size=batch, shuffle=True, seed=0,
            color_mode="rgb" if spec["channels"] == 3 else "grayscale", interpolation="bilinear",
            verbose=False).repeat()  # maps with num_parallel_calls=AUTOTUNE, then prefetch(AUTOTUNE)
        stream = iter(dataset)
        detail = {"workers": None, "loader": f"tf.data (Keras {keras.__version__})"}
    for _ in range(INPUT_WARMUP_BATCHES):
        next(stream)
    setup = time.perf_counter() - setup
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        next(stream)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak_kb = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    row = {"path": spec["path"], "images_per_s": steps * batch / seconds, "seconds": seconds,
           "batches": steps, "global_batch": batch, "setup_s": setup, "peak_rss_mb": peak_kb / 1024,
           "cpu_us_per_image": 1e6 * cpu / (steps * batch), **detail}
    worker.emit_row(row)
    print(f"bench: input {spec['path']}: {row['images_per_s']:,.0f} images/s, "
          f"{row['cpu_us_per_image']:.0f} CPU-us/image, peak RSS {row['peak_rss_mb']:,.0f} MB",
          file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(worker.main(measure, sys.argv[1:]))
