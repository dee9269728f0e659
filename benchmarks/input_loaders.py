"""Which loader feeds meshfit.data.folders fastest: a thread pool, Grain or tf.data, on a JPEG folder.

Every loader decodes the same files in the same order (epoch 0's permutation of
FolderTrainBatches) into uint8 batches of (B, H, W, 3), with decoding and prefetch in parallel:
  threads           meshfit.data.folders.FolderTrainBatches (its thread pool; simplejpeg for JPEGs)
  threads-pillow    the same with every file decoded by Pillow (no simplejpeg)
  grain-threads     grain.MapDataset(files).map(image_files.load_image).batch(B), to_iter_dataset
                    with one read thread per core
  grain-processes   the same batches made in one worker process per core (mp_prefetch)
  tf.data           tf.data: read_file + decode_jpeg (uint8) with num_parallel_calls=AUTOTUNE,
                    batch, prefetch(AUTOTUNE)
Each loader runs in a fresh process per round, the loaders alternating; after WARMUP batches it
times --batches batches. Prints per loader the median images/s, CPU time per image (the process and
its worker processes) and resident memory (the process's peak; the process tree's at the end).

    python benchmarks/input_loaders.py FOLDER [--rounds 3] [--batches 100] [--batch 128] [--size 160 160]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

LOADERS = ("threads", "threads-pillow", "grain-threads", "grain-processes", "tf.data")
WARMUP = 5


def _decode(path: str, size: tuple[int, int]):
    from meshfit.data import image_files

    return image_files.load_image(path, size, 3)


def _stream(loader: str, folder: str, size: tuple[int, int], batch: int):
    import numpy as np

    from meshfit.data import folder_scan, folders, image_files

    found = folder_scan.scan(folder)
    batches = folders.FolderTrainBatches(found, size, 3, batch)
    if loader in ("threads", "threads-pillow"):
        if loader == "threads-pillow":
            image_files._decode_jpeg = lambda data, out: False
        return batches.iterate()
    files = [found.files[i] for i in batches._order(0)]
    cores = image_files.default_workers()
    if loader.startswith("grain"):
        import functools

        import grain
        from absl import flags

        flags.FLAGS.mark_as_parsed()  # Grain's worker processes read absl flags

        dataset = grain.MapDataset.source(files).map(functools.partial(_decode, size=size)).batch(batch)
        if loader == "grain-threads":
            return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=cores,
                                                                  prefetch_buffer_size=2 * batch)))
        return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
                    .mp_prefetch(grain.MultiprocessingOptions(num_workers=cores)))
    import tensorflow as tf

    def read(path):
        return tf.io.decode_jpeg(tf.io.read_file(path), channels=3)

    dataset = (tf.data.Dataset.from_tensor_slices(np.array(files)).map(read, num_parallel_calls=tf.data.AUTOTUNE)
               .batch(batch).prefetch(tf.data.AUTOTUNE))
    return iter(dataset.as_numpy_iterator())


def measure(loader: str, folder: str, size: tuple[int, int], batch: int, batches: int) -> dict:
    stream = _stream(loader, folder, size, batch)
    for _ in range(WARMUP):
        next(stream)
    start, cpu = time.perf_counter(), _cpu()
    for _ in range(batches):
        images = next(stream)
    seconds, cpu = time.perf_counter() - start, _cpu() - cpu
    shape = tuple(images[0].shape if isinstance(images, tuple) else images.shape)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"loader": loader, "images_per_s": batches * batch / seconds,
            "cpu_us_per_image": 1e6 * cpu / (batches * batch), "peak_rss_mb": peak,
            "tree_rss_mb_at_end": _rss_mb(), "shape": shape}


def _tree():
    import psutil

    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def _cpu() -> float:
    """CPU seconds of this process and its live children (Grain's workers)."""
    return sum(sum(p.cpu_times()[:4]) for p in _tree())


def _rss_mb() -> float:
    """Resident memory of this process and its children now, MB."""
    return sum(p.memory_info().rss for p in _tree()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--size", type=int, nargs=2, default=(160, 160))
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = tuple(args.size)
    if args.worker:
        row = measure(args.worker, args.folder, size, args.batch, args.batches)
        print("row " + json.dumps(row), flush=True)
        os._exit(0)  # Grain's worker processes and TensorFlow's threads need no orderly shutdown
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    rows: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for loader in args.loaders.split(","):
            done = subprocess.run([sys.executable, __file__, args.folder, "--worker", loader,
                                   "--batches", str(args.batches), "--batch", str(args.batch),
                                   "--size", *map(str, size)], capture_output=True, text=True, env=env)
            line = next((x for x in done.stdout.splitlines() if x.startswith("row ")), None)
            if line is None:
                print(f"{loader}: failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            row = json.loads(line[4:])
            rows.setdefault(loader, []).append(row)
            print(f"{loader:16s} {row['images_per_s']:7,.0f} images/s {row['cpu_us_per_image']:5.0f} "
                  f"CPU-us/image, RSS {row['peak_rss_mb']:5,.0f} MB peak (process), "
                  f"{row['tree_rss_mb_at_end']:5,.0f} MB at the end (process tree)", flush=True)
    print(f"\nmedians of {args.rounds} rounds, batch {args.batch}, {args.batches} timed batches, "
          f"{size[0]}x{size[1]}:")
    for loader, group in rows.items():
        print(f"{loader:16s} {statistics.median(r['images_per_s'] for r in group):7,.0f} images/s "
              f"{statistics.median(r['cpu_us_per_image'] for r in group):5.0f} CPU-us/image "
              f"{max(r['peak_rss_mb'] for r in group):5,.0f} MB peak RSS (process), "
              f"{max(r['tree_rss_mb_at_end'] for r in group):5,.0f} MB RSS at the end (process tree)")


if __name__ == "__main__":
    main()
