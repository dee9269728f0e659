"""`meshfit bench`: train-step time per engine, precision, batch size and steps per dispatch.

For every combination two models of the recipe are timed on random data of its input shape (no
download), each in a fresh process per engine (Keras fixes its backend per process):
  plain    raw Keras: `keras` imported with the engine as backend, `model.compile` + `model.fit`
           (`steps_per_execution` = steps per dispatch; Keras' own `DataParallel` on several JAX
           devices); nothing of meshfit runs in that process but the recipe's model builder;
  meshfit  `meshfit.connect(engine=...)`, `Strategy.fit` with the per-epoch report, on TensorFlow
           its cache-sized micro-batches (`meshfit.fit.tf_microbatch`, shown in the micro-batches column),
           and with more than one step per dispatch the on-device loop of `meshfit.fit.jax_loop`;
  meshfit+tensorboard  (with `--tensorboard`) the meshfit path plus the TensorBoard log of every
           `meshfit train` (scalars every 10 steps); its `vs meshfit` column is the logging's cost.
Each fit runs 1 + repeats epochs of `steps` steps: the first is warm-up (compilation, reported as
its extra time over a timed epoch), the others are timed between device synchronizations and the
median is reported. Columns: ms/step, samples/s, MFU (XLA's FLOPs of the step / peak FLOP/s; n/a
where the peak is unknown, as on CPUs), compile seconds, `vs plain` (samples/s / the plain row of
the same engine, precision, batch and steps per dispatch) and `vs fastest` (samples/s / the fastest
plain Keras row of any engine at that precision and batch: the baseline a user could get without
meshfit). Writes bench.csv, bench.json and bench.png to --out (default runs/bench-<time>/).
On several (simulated) CPU devices both paths finish each dispatch before the next, since XLA:CPU
collectives can deadlock with several programs in flight on fewer cores than devices. The paths
run one after the other, so a change in the machine's load between them moves their ratio:
`--rounds R` runs every engine and path R times, alternating (plain, meshfit, plain, ...), and
reports for each row the median samples/s over the rounds (`rounds_samples_per_s` lists them).

`--input FOLDER --image-size H W` times the input pipeline alone instead (`bench_input`):
meshfit.data.folders's streamed batches against `keras.utils.image_dataset_from_directory` on the
same folder, fresh processes alternating per round; `--make-jpeg-folder DIR` writes its test
folder (`write_jpeg_folder`).
"""

from __future__ import annotations

import collections
import csv
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from meshfit.parallel import devices as devices_lib
from meshfit.parallel import engine as engine_lib
from meshfit.parallel import planning
from meshfit import recipes
from meshfit.run import rundir
from meshfit.parallel import sharding as sharding_lib
from meshfit.errors import MeshfitError

DEFAULT_REPEATS = 5
DEFAULT_STEPS = 10  # timed steps per repeat (rounded up to a multiple of the steps per dispatch)
BENCH_ENGINES = ("jax", "tensorflow")
PATHS = ("plain", "meshfit")
TENSORBOARD_PATH = "meshfit+tensorboard"
COLUMNS = ("recipe", "engine", "path", "precision", "batch", "steps_per_dispatch", "micro_batches",
           "sharding", "replicas", "ms_per_step", "samples_per_s", "mfu", "compile_s", "vs_plain", "vs_fastest",
           "vs_meshfit",
           "flops_per_step", "auto_engine", "platform", "device_kind", "repeats", "steps_per_repeat",
           "rounds")
_ROW, _MACHINE, _ERROR = "meshfit-bench-row ", "meshfit-bench-machine ", "meshfit-bench-error "


def bench(recipe: str = recipes.DEFAULT, *, engines: list[str] | None = None,
          precisions: list[str] | None = None, batch_sizes: list[int] | None = None,
          steps_per_dispatch: list[int] | None = None, simulate_devices: int | None = None,
          repeats: int = DEFAULT_REPEATS, steps: int = DEFAULT_STEPS, rounds: int = 1,
          out: str | None = None, tensorboard: bool = False, sharding: str | None = None,
          fsdp_min_bytes: int | str = sharding_lib.DEFAULT_FSDP_MIN_BYTES,
          device_memory: int | str | None = None) -> dict:
    """Run the benchmark (one process per engine, path and round) and write its files; returns
    the results.

    Lists left as None take the defaults described in `meshfit bench --help`. sharding,
    fsdp_min_bytes, device_memory: the meshfit path's, as for meshfit.connect (plain Keras stays
    data-parallel).
    """
    the_recipe = recipes.load(recipe)
    sharding = sharding_lib.check_mode(sharding)
    fsdp_min_bytes = sharding_lib.parse_size(fsdp_min_bytes, "--fsdp-min-size")
    device_memory = sharding_lib.parse_size(device_memory)
    for name in precisions or []:
        planning.precision_name(name)
    for name in engines or []:
        if name not in BENCH_ENGINES:
            raise MeshfitError(f"unknown engine {name!r} in --engines; use any of: {', '.join(BENCH_ENGINES)}")
    if repeats < 1 or steps < 1 or rounds < 1:
        raise MeshfitError(f"--repeats, --steps and --rounds must be at least 1, got {repeats}, "
                           f"{steps} and {rounds}")
    if simulate_devices is not None and simulate_devices < 1:
        raise MeshfitError(f"--simulate-devices must be at least 1, got {simulate_devices}")
    if engines is None:
        engines = [e for e in BENCH_ENGINES if engine_lib.installed(e)]
        if (devices_lib.requested_simulation(simulate_devices) or 1) > 1:
            engines = ["jax"]  # only JAX runs several devices in meshfit
    spec = {"recipe": the_recipe.file or the_recipe.name, "precisions": precisions, "batch_sizes": batch_sizes,
            "steps_per_dispatch": steps_per_dispatch, "simulate": simulate_devices,
            "repeats": repeats, "steps": steps, "sharding": sharding,
            "fsdp_min_bytes": fsdp_min_bytes, "device_memory": device_memory}
    rows, machine, skipped, unable = [], None, [], set()
    for _ in range(rounds):
        for engine in (e for e in engines if e not in unable):
            for path in PATHS + ((TENSORBOARD_PATH,) if tensorboard else ()):
                found, meta, error = _run_worker({**spec, "engine": engine, "path": path})
                if error:
                    unable.add(engine)
                    skipped.append(f"{engine}: {error}")
                    print(f"meshfit: note: skipped engine {engine}: {error}", file=sys.stderr,
                          flush=True)
                    break
                rows += found
                machine = machine or meta
    rows = median_over_rounds(rows)
    if not rows:
        raise MeshfitError("nothing was measured; " + "; ".join(skipped))
    add_ratios(rows)
    out = out or rundir.timestamped("bench")
    result = {"recipe": the_recipe.name, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": "meshfit bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None,
              "machine": machine, "skipped": skipped, "out": out,
              "baseline": "vs_fastest = samples/s / the fastest plain-Keras row (any engine, any "
                          "steps per dispatch) at the same precision and batch",
              "rows": rows}
    write_files(result, out)
    return result


def median_over_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (engine, path, precision, batch, steps per dispatch): the round with the median
    samples/s (the lower middle one for an even count), with every round's samples/s attached."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(_key(row) + (row["path"],), []).append(row)
    merged = []
    for group in groups.values():
        ranked = sorted(group, key=lambda r: r["samples_per_s"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["rounds"] = len(group)
        row["rounds_samples_per_s"] = [r["samples_per_s"] for r in group]
        merged.append(row)
    return merged


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Fill `vs_plain`, `vs_fastest` and `vs_meshfit` in place (see the module docstring)."""
    plain = {_key(r): r["samples_per_s"] for r in rows if r["path"] == "plain"}
    meshfit = {_key(r): r["samples_per_s"] for r in rows if r["path"] == "meshfit"}
    fastest: dict[tuple, float] = {}
    for r in rows:
        if r["path"] == "plain":
            group = (r["precision"], r["batch"])
            fastest[group] = max(fastest.get(group, 0.0), r["samples_per_s"])
    for r in rows:
        base = plain.get(_key(r))
        r["vs_plain"] = r["samples_per_s"] / base if base else None
        best = fastest.get((r["precision"], r["batch"]))
        r["vs_fastest"] = r["samples_per_s"] / best if best else None
        own = meshfit.get(_key(r)) if r["path"] == TENSORBOARD_PATH else None
        r["vs_meshfit"] = r["samples_per_s"] / own if own else None


def _key(row: dict[str, Any]) -> tuple:
    return row["engine"], row["precision"], row["batch"], row["steps_per_dispatch"]


def _run_worker(spec: dict) -> tuple[list[dict], dict | None, str | None]:
    """Run one engine and path in a fresh process; relay its progress lines; parse its results."""
    proc = subprocess.Popen([sys.executable, "-m", "meshfit.commands.bench", json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tail: collections.deque = collections.deque(maxlen=20)

    def relay():
        for line in proc.stderr:
            if line.startswith(("bench: ", "meshfit: warning")):
                print(line, end="", file=sys.stderr, flush=True)
            elif line.strip():
                tail.append(line.rstrip())

    relayer = threading.Thread(target=relay, daemon=True)
    relayer.start()
    stdout = proc.stdout.read()
    proc.wait()
    relayer.join()
    rows, machine, error = [], None, None
    for line in stdout.splitlines():
        if line.startswith(_ROW):
            rows.append(json.loads(line[len(_ROW):]))
        elif line.startswith(_MACHINE):
            machine = json.loads(line[len(_MACHINE):])
        elif line.startswith(_ERROR):
            error = line[len(_ERROR):]
    if proc.returncode != 0 and error is None:
        last = tail[-1] if tail else "no output"
        raise MeshfitError(f"the {spec.get('engine', 'input')} {spec['path']} benchmark process failed "
                           f"(exit {proc.returncode}): {last}")
    return rows, machine, error


# --------------------------------------------------------------------------------------- output

def _cell(row: dict[str, Any], column: str) -> str:
    value = row.get(column)
    if column == "mfu":
        return f"{value * 100:.1f}%" if value else "n/a"
    if value is None:
        return "-"
    if column in ("vs_plain", "vs_fastest", "vs_meshfit"):
        return f"{value:.3f}x" if column == "vs_meshfit" else f"{value:.2f}x"
    if column == "samples_per_s":
        return f"{value:,.0f}"
    if column in ("ms_per_step", "compile_s"):
        return f"{value:.1f}"
    if column == "engine" and row.get("auto_engine") == value:
        return f"{value}*"
    return str(value)


_TABLE = (("engine", "engine"), ("path", "path"), ("precision", "precision"), ("batch", "batch"),
          ("steps_per_dispatch", "steps/dispatch"), ("micro_batches", "micro-batches"),
          ("sharding", "sharding"), ("ms_per_step", "ms/step"),
          ("samples_per_s", "samples/s"), ("mfu", "MFU"), ("compile_s", "compile s"),
          ("vs_plain", "vs plain"), ("vs_fastest", "vs fastest"), ("vs_meshfit", "vs meshfit"))


def format_table(result: dict) -> str:
    """The results as a plain-text table with a title and the baseline stated under it."""
    header = [title for _, title in _TABLE]
    body = [[_cell(r, c) for c, _ in _TABLE] for r in result["rows"]]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = [_title(result), "  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in body]
    return "\n".join(lines + _notes(result))


def _title(result: dict) -> str:
    m = result.get("machine") or {}
    return (f"meshfit bench {result['recipe']} on {m.get('device_kind', '?')} "
            f"({m.get('platform', '?')}, {m.get('devices', '?')} device(s)), {result['date']}")


def _notes(result: dict) -> list[str]:
    auto = (result.get("machine") or {}).get("auto_engine")
    notes = [f"* meshfit's engine for these devices ({auto})" if auto else "",
             result["baseline"] + "; vs_plain = samples/s / plain Keras on the same engine, "
             "precision, batch and steps per dispatch"]
    rounds = max((r.get("rounds") or 1 for r in result["rows"]), default=1)
    if rounds > 1:
        notes.append(f"each row: the median of {rounds} rounds, paths alternating")
    return [n for n in notes if n] + [f"skipped {s}" for s in result.get("skipped", [])]


def write_files(result: dict, out: str) -> None:
    """bench.csv (one row per measurement), bench.json (everything) and bench.png (bar chart)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["rows"])
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out, "bench.png"))


def plot(result: dict, path: str) -> None:
    """Horizontal bars of samples/s, one per row, labelled with the `vs fastest` ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['engine']} {r['path']} {r['precision']} b{r['batch']} x{r['steps_per_dispatch']}"
              for r in rows]
    values = [r["samples_per_s"] for r in rows]
    colors = ["#9e9e9e" if r["path"] == "plain" else "#1f77b4" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.4 * len(rows)))
    bars = ax.barh(range(len(rows)), values, color=colors)
    for bar, r in zip(bars, rows):
        ratio = f" {r['vs_fastest']:.2f}x" if r.get("vs_fastest") else ""
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, ratio, va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("training samples/s (grey: plain Keras, blue: meshfit; label: vs fastest plain)")
    ax.set_title(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------ measurement (worker)

def default_batch(recipe: recipes.Recipe, platform: str, device_kind: str, replicas: int) -> int:
    """The recipe's global batch on these devices, as `meshfit train` would use it."""
    return planning.plan_global_batch(replicas, platform, device_kind, global_batch=recipe.global_batch,
                                      per_core_batch=recipe.per_core_batch)


def _epoch_timer():
    import keras

    from meshfit.watch.report import wait_for_device

    class EpochTimer(keras.callbacks.Callback):
        """Seconds of each epoch, between device synchronizations."""

        def __init__(self):
            super().__init__()
            self.seconds: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            wait_for_device(self.model)
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            wait_for_device(self.model)
            self.seconds.append(time.perf_counter() - self._start)

    return EpochTimer()


def _wait_each_dispatch(info) -> list:
    """On several CPU devices, a callback finishing each dispatch, as meshfit's train function does.

    XLA:CPU collectives can deadlock with several programs in flight when the machine has fewer
    cores than (simulated) devices, so plain Keras needs the same wait to finish at all.
    """
    if info.platform != "cpu" or info.device_count == 1:
        return []
    import jax
    import keras

    return [keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: jax.block_until_ready(logs))]


def _worker(spec: dict) -> None:
    """Measure one engine and path for every precision, batch and steps per dispatch."""
    engine, path = spec["engine"], spec["path"]
    if path != "plain":
        from meshfit.parallel.distribution import Strategy, connect

        info = connect(simulate=spec["simulate"], engine=engine, verbose=False).info
    else:
        info = devices_lib.discover(simulate=spec["simulate"])
        engine_lib.choose(engine, info.platform, info.device_count)  # the same rules as meshfit
        os.environ["KERAS_BACKEND"] = engine
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    from meshfit.fit import jax_loop, tf_microbatch
    from meshfit.parallel import memory_plan
    from meshfit.watch.report import EpochReport, train_step_flops

    recipe = recipes.load(spec["recipe"])
    replicas = info.device_count if engine == "jax" else 1
    auto_engine = engine_lib.fastest(info.platform, info.device_count)
    machine = {"platform": info.platform, "device_kind": info.device_kind, "devices": info.device_count,
               "simulated": info.simulated, "cpu": devices_lib.cpu_model(), "auto_engine": auto_engine,
               "keras": keras.__version__, "python": sys.version.split()[0]}
    print(_MACHINE + json.dumps(machine), flush=True)
    shape = recipes.input_shape(recipe)
    # Built-in datasets' classes; the synthetic recipe keeps its model's own head; others: 10.
    classes = len(recipes.dataset_class_names(recipe.dataset)) or (None if recipe.dataset == "synthetic" else 10)
    precisions = spec["precisions"] or [recipe.precision]
    batches = [planning.split_global_batch(b, replicas) for b in spec["batch_sizes"] or []] or \
        [default_batch(recipe, info.platform, info.device_kind, replicas)]
    dispatches = spec["steps_per_dispatch"] or ([1] if info.platform == "cpu" else [1, 8])
    repeats = spec["repeats"]
    for name in precisions:
        precision = planning.resolve_precision(name, info.platform, info.compute_capability,
                                                recipe.precision)
        peak = planning.peak_flops(info.platform, info.device_kind, precision)
        peak = peak * replicas if peak else None
        for batch in batches:
            for k in dispatches:
                steps = -(-spec["steps"] // k) * k
                def reset(chosen=None):
                    keras.backend.clear_session()  # (no keras.utils.set_random_seed: it would import TensorFlow)
                    if chosen is not None:
                        chosen.activate()

                def build():
                    model = (recipe.build_model(shape, classes) if classes else recipe.build_model(shape))
                    model.compile(optimizer=recipe.optimizer(steps, repeats + 1), loss=recipe.make_loss(),
                                  metrics=["accuracy"], steps_per_execution=1 if strategy else k)
                    return model

                reset()
                strategy = None
                if path != "plain":
                    strategy = Strategy(info, engine, precision, spec["sharding"],
                                        spec["fsdp_min_bytes"], spec["device_memory"])
                    strategy, _ = memory_plan.settle(strategy, build, batch, reset, verbose=False)
                    reset(strategy)
                else:
                    keras.config.set_dtype_policy(planning.keras_policy(precision))
                    if engine == "jax" and replicas > 1:
                        keras.distribution.set_distribution(keras.distribution.DataParallel())
                model = build()
                rng = np.random.default_rng(0)
                x = rng.integers(0, 256, (steps * batch, *shape), dtype=np.uint8)
                y = rng.integers(0, model.output_shape[-1], steps * batch).astype(np.int32)
                timer = _epoch_timer()
                fit = dict(batch_size=batch, epochs=repeats + 1, shuffle=False, verbose=0)
                flops, slices = None, 1
                if strategy is not None:
                    jax_loop.install(model, k)
                    report = EpochReport(batch_size=batch, strategy=strategy, stream=io.StringIO())
                    with tempfile.TemporaryDirectory(prefix="meshfit-bench-tb-") as logdir:
                        logs = []
                        if path == TENSORBOARD_PATH:
                            from meshfit.watch.tensorboard import TensorBoardLog

                            logs = [TensorBoardLog(logdir, report=report, global_batch=batch)]
                        strategy.fit(model, x, y, callbacks=[timer, report, *logs], **fit)
                    flops = report.flops_per_step
                    slices = tf_microbatch.installed(model)
                else:
                    model.fit(x, y, callbacks=[timer] + _wait_each_dispatch(info), **fit)
                    flops = train_step_flops(model, batch) if peak else None
                median = statistics.median(timer.seconds[1:])
                step_seconds = median / steps
                row = {"recipe": recipe.name, "engine": engine, "path": path, "precision": precision,
                       "batch": batch, "steps_per_dispatch": k, "micro_batches": slices,
                       "sharding": strategy.sharding if strategy else "data", "replicas": replicas,
                       "ms_per_step": 1000 * step_seconds, "samples_per_s": batch / step_seconds,
                       "mfu": flops / step_seconds / peak if (flops and peak) else None,
                       "compile_s": max(timer.seconds[0] - median, 0.0), "flops_per_step": flops or None,
                       "auto_engine": auto_engine, "platform": info.platform,
                       "device_kind": info.device_kind, "repeats": repeats, "steps_per_repeat": steps,
                       "epoch_seconds": timer.seconds}
                print(_ROW + json.dumps(row), flush=True)
                print(f"bench: {engine} {path} {precision} batch {batch} x{k}: "
                      f"{row['ms_per_step']:.1f} ms/step, {row['samples_per_s']:,.0f} samples/s "
                      f"(+{row['compile_s']:.1f} s compile)", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------ input pipeline (images)

JPEG_FOLDER_IMAGES = 30_000  # images in `meshfit bench --make-jpeg-folder`'s folder
JPEG_QUALITY = 90


def write_jpeg_folder(dest: str, data_dir: str | None = None, count: int = JPEG_FOLDER_IMAGES,
                      image_size: tuple[int, int] = (160, 160)) -> int:
    """Write the first `count` CIFAR-10 training images, upscaled (bilinear) to image_size =
    (height, width), as JPEGs (quality 90) in dest/<class name>/<index>.jpg; returns the count.

    CIFAR-10 is read as `meshfit train` reads it (data_dir, $MESHFIT_DATA, ...; no download).
    """
    import concurrent.futures

    from PIL import Image

    from meshfit.data import datasets, folders

    if os.path.isdir(dest) and os.listdir(dest):
        raise MeshfitError(f"{dest} is not empty; give a new folder for the JPEGs")
    data = datasets.load("cifar10", data_dir, download=False)
    count = min(count, len(data.x_train))
    if count < 1:
        raise MeshfitError(f"the JPEG folder needs at least 1 image, got {count}")
    height, width = folders.check_image_size(image_size, 3)
    for name in data.class_names:
        os.makedirs(os.path.join(dest, name), exist_ok=True)

    def write(i: int) -> None:
        image = Image.fromarray(data.x_train[i]).resize((width, height), Image.Resampling.BILINEAR)
        image.save(os.path.join(dest, data.class_names[data.y_train[i]], f"{i:05d}.jpg"),
                   quality=JPEG_QUALITY)

    with concurrent.futures.ThreadPoolExecutor(folders.default_workers()) as pool:
        list(pool.map(write, range(count), chunksize=256))
    return count


INPUT_PATHS = ("meshfit", "keras")  # FolderTrainBatches; keras.utils.image_dataset_from_directory
DEFAULT_INPUT_BATCH = 128
INPUT_WARMUP_BATCHES = 5


def bench_input(folder: str, image_size: tuple[int, int], channels: int = 3,
                batch_size: int = DEFAULT_INPUT_BATCH, rounds: int = 3, steps: int | None = None,
                out: str | None = None) -> dict:
    """Time the input pipeline alone on an image folder: meshfit's FolderTrainBatches against
    `keras.utils.image_dataset_from_directory` (tf.data: parallel decode, prefetch), same folder,
    size, batch and shuffling, each in a fresh process per round, alternating.

    Each measurement decodes INPUT_WARMUP_BATCHES batches, then times `steps` more (default: one
    epoch); images/s is the median over the rounds. Writes bench.json to `out` (default
    runs/bench-input-<time>/) and returns the results.
    """
    from meshfit.data import folders

    height, width = folders.check_image_size(image_size, channels)
    if batch_size < 1 or rounds < 1 or (steps is not None and steps < 1):
        raise MeshfitError(f"--batch-size, --rounds and --steps must be at least 1, got {batch_size}, "
                           f"{rounds} and {steps}")
    found = folders.scan(folder)  # bad folders fail here, in one line
    if len(found) < batch_size:
        raise MeshfitError(f"{folder} has {len(found)} readable images, fewer than the batch of "
                           f"{batch_size}; use a smaller --batch-size")
    spec = {"input": found.root, "image_size": [height, width], "channels": channels,
            "batch": batch_size, "steps": steps or len(found) // batch_size}
    rows, machine, skipped = [], None, []
    for _ in range(rounds):
        for path in (p for p in INPUT_PATHS if not any(s.startswith(p) for s in skipped)):
            found_rows, meta, error = _run_worker({**spec, "path": path})
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
              "image_size": [height, width], "channels": channels, "batch": batch_size,
              "steps": spec["steps"], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": "meshfit bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None,
              "machine": machine, "skipped": skipped, "out": out,
              "input_images_per_second": ours, "anchor_images_per_second": anchor,
              "vs_anchor": ours / anchor if ours and anchor else None,
              "rounds_vs_anchor": per_round, "rows": merged}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def format_input_table(result: dict) -> str:
    """The input benchmark as a plain-text table with the ratio under it."""
    m = result.get("machine") or {}
    height, width = result["image_size"]
    lines = [f"meshfit bench --input {result['input']}: {result['images']:,} images to "
             f"{height}x{width}x{result['channels']}, batch {result['batch']}, {result['steps']} timed "
             f"batches, on {m.get('cpu', '?')} ({m.get('cores', '?')} cores), {result['date']}",
             f"{'path':<8}  {'images/s':>9}  {'CPU-us/image':>12}  {'peak RSS MB':>11}  rounds (images/s)"]
    for r in result["rows"]:
        name = "meshfit" if r["path"] == "meshfit" else "keras"
        lines.append(f"{name:<8}  {r['images_per_s']:>9,.0f}  {r['cpu_us_per_image']:>12,.0f}  "
                     f"{r['peak_rss_mb']:>11,.0f}  "
                     + ", ".join(f"{v:,.0f}" for v in r["rounds_images_per_s"]))
    if result["vs_anchor"]:
        lines.append(f"meshfit vs keras.utils.image_dataset_from_directory: {result['vs_anchor']:.2f}x "
                     f"(medians of {len(result['rounds_vs_anchor'])} rounds, paths alternating)")
    return "\n".join(lines + [f"skipped {s}" for s in result["skipped"]])


def _input_worker(spec: dict) -> None:
    """Time one input path (see bench_input) and print its row."""
    import resource

    height, width = spec["image_size"]
    batch, steps = spec["batch"], spec["steps"]
    print(_MACHINE + json.dumps({"cpu": devices_lib.cpu_model(), "cores": os.cpu_count(),
                                 "python": sys.version.split()[0]}), flush=True)
    setup = time.perf_counter()
    if spec["path"] == "meshfit":
        from meshfit.data import folders

        folder = folders.scan(spec["input"])
        batches = folders.FolderTrainBatches(folder, (height, width), spec["channels"], batch)
        stream = batches.iterate()
        detail = {"workers": batches._decoder.workers, "loader": "thread pool over Pillow"}
    else:
        os.environ["KERAS_BACKEND"] = "tensorflow"
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
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
           "batches": steps, "batch": batch, "setup_s": setup, "peak_rss_mb": peak_kb / 1024,
           "cpu_us_per_image": 1e6 * cpu / (steps * batch), **detail}
    print(_ROW + json.dumps(row), flush=True)
    print(f"bench: input {spec['path']}: {row['images_per_s']:,.0f} images/s, "
          f"{row['cpu_us_per_image']:.0f} CPU-us/image, peak RSS {row['peak_rss_mb']:,.0f} MB",
          file=sys.stderr, flush=True)


def _worker_main(argv: list[str]) -> int:
    try:
        spec = json.loads(argv[0])
        (_input_worker if "input" in spec else _worker)(spec)
    except MeshfitError as err:
        print(_ERROR + str(err), flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
