"""`meshfit bench`'s arguments and what it runs: train-step timing (step.py), --scaling
(scaling.py), --input (inputs.py) and --make-jpeg-folder (jpeg_folder.py). meshfit.cli imports
this module only for `meshfit bench`.
"""

from __future__ import annotations

import argparse
import json
import os

from meshfit import recipes
from meshfit.commands.bench import inputs, jpeg_folder, scaling, step, table
from meshfit.errors import MeshfitError
from meshfit.parallel import planning
from meshfit.run import options, spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipe and bench's own flags, with --simulate-devices and the sharding flags of
    meshfit.run.options."""
    parser.add_argument("recipe", nargs="?", default=recipes.DEFAULT,
                        help=f"recipe whose model is timed (default: {recipes.DEFAULT})")
    parser.add_argument("--engines", help="comma-separated Keras backends (default: every installed "
                        "one that runs on these devices: jax, tensorflow)")
    parser.add_argument("--precisions", help=f"comma-separated: {', '.join(planning.PRECISIONS)} "
                        "(default: the recipe's)")
    parser.add_argument("--global-batches", "--batch-sizes", "--batch-size", dest="global_batches",
                        help="comma-separated global batches, samples per step over all replicas "
                        f"(default: the recipe's; with --input one, default {inputs.DEFAULT_INPUT_BATCH})")
    parser.add_argument("--steps-per-dispatch", help="comma-separated train steps per dispatch "
                        "(default: 1 on CPU, 1,8 on accelerators)")
    options.add_flags(parser, "simulate_devices")
    parser.add_argument("--repeats", type=int, default=step.DEFAULT_REPEATS,
                        help="timed epochs per measurement; the median is reported "
                             f"(default: {step.DEFAULT_REPEATS})")
    parser.add_argument("--rounds", type=int,
                        help="run every engine and path this many times, alternating, and report "
                             "the median (default: 1; with --input 3)")
    parser.add_argument("--steps", type=int, help=f"train steps per timed epoch (default: "
                        f"{step.DEFAULT_STEPS}); with --input, timed batches (default: one epoch)")
    parser.add_argument("--out", help="directory for bench.csv, bench.json, bench.png "
                        "(default: runs/bench-<time>)")
    parser.add_argument("--tensorboard", action="store_true",
                        help="also time the meshfit path with TensorBoard logging on (vs meshfit: its cost)")
    parser.add_argument("--profile", metavar="START:STOP",
                        help="trace train steps START to STOP of each meshfit row into "
                             "OUT/profile/<row>/ with the engine's profiler, as meshfit train "
                             "--profile does (the traced epoch counts among the timed ones)")
    parser.add_argument("--scaling", nargs="?", const="1,2,4,8", metavar="COUNTS",
                        help="time the recipe on 1, 2, 4, 8 devices (or the comma-separated "
                             "COUNTS) at one global batch: samples/s, efficiency vs linear, "
                             "goodput parts, scaling.png (simulated devices on a CPU)")
    parser.add_argument("--input", metavar="FOLDER",
                        help="time the input pipeline alone on this image folder (one sub-folder per "
                             "class): meshfit's streamed batches vs keras.utils.image_dataset_from_directory")
    parser.add_argument("--image-size", type=int, nargs=2, metavar=("H", "W"),
                        help="with --input or --make-jpeg-folder: image height and width in pixels")
    parser.add_argument("--channels", type=int, default=3, help="with --input: 3 (RGB) or 1 (grey)")
    parser.add_argument("--make-jpeg-folder", metavar="DIR",
                        help=f"write {jpeg_folder.JPEG_FOLDER_IMAGES:,} CIFAR-10 training images as JPEGs "
                             "(--image-size, default 160 160) in DIR/<class>/, for --input")
    parser.add_argument("--data-dir", help="with --make-jpeg-folder: where CIFAR-10 is")
    options.add_flags(parser, *options.SHARDING)
    parser.add_argument("--json", action="store_true",
                        help="print the results (not a table) as JSON")


def run(args: argparse.Namespace) -> int:
    """Measure, print the table (or JSON) and write the files."""
    if args.make_jpeg_folder:
        count = jpeg_folder.write_jpeg_folder(args.make_jpeg_folder, args.data_dir,
                                              image_size=tuple(args.image_size or (160, 160)))
        print(f"wrote {count:,} JPEGs in {args.make_jpeg_folder}")
        return 0
    if args.input:
        return run_input(args)
    if args.image_size:
        raise MeshfitError("--image-size goes with --input FOLDER or --make-jpeg-folder DIR")
    if args.scaling:
        return run_scaling(args)
    result = step.bench(args.recipe, engines=comma_names(args.engines, "--engines"),
                        precisions=comma_names(args.precisions, "--precisions"),
                        global_batches=comma_counts(args.global_batches, "--global-batches"),
                        steps_per_dispatch=comma_counts(args.steps_per_dispatch, "--steps-per-dispatch"),
                        simulate_devices=args.simulate_devices, repeats=args.repeats,
                        steps=step.DEFAULT_STEPS if args.steps is None else args.steps,
                        rounds=1 if args.rounds is None else args.rounds, out=args.out,
                        tensorboard=args.tensorboard, profile=spec.profiling_steps(args.profile),
                        **options.of(args, options.SHARDING))
    if args.json:
        print(json.dumps(result))
    else:
        print(table.format_table(result))
        print("wrote " + ", ".join(os.path.join(result["out"], f)
                                   for f in ("bench.csv", "bench.json", "bench.png")))
    return 0


def run_scaling(args: argparse.Namespace) -> int:
    """`meshfit bench --scaling [COUNTS]`: the same global batch on 1, 2, 4, 8 devices."""
    batches = comma_counts(args.global_batches, "--global-batches") or [None]
    precisions = comma_names(args.precisions, "--precisions") or [None]
    if len(batches) > 1 or len(precisions) > 1:
        raise MeshfitError("--scaling takes one --global-batches and one --precisions")
    result = scaling.bench_scaling(args.recipe, comma_counts(args.scaling, "--scaling"),
                                   global_batch=batches[0], precision=precisions[0],
                                   repeats=args.repeats, out=args.out,
                                   steps=args.steps)
    print(json.dumps(result) if args.json else scaling.format_table(result))
    if not args.json:
        print(scaling.main_line(result))
    return 0


def run_input(args: argparse.Namespace) -> int:
    """`meshfit bench --input FOLDER --image-size H W`: the input pipeline alone."""
    if not args.image_size:
        raise MeshfitError("--input needs --image-size H W (the pixels to decode to)")
    batches = comma_counts(args.global_batches, "--global-batches") or [inputs.DEFAULT_INPUT_BATCH]
    if len(batches) > 1:
        raise MeshfitError("--input takes one --global-batches")
    result = inputs.bench_input(args.input, tuple(args.image_size), args.channels, batches[0],
                                rounds=3 if args.rounds is None else args.rounds,
                                steps=args.steps, out=args.out)
    if args.json:
        print(json.dumps(result))
    else:
        print(table.format_input_table(result))
        print("wrote " + os.path.join(result["out"], "bench.json"))
    return 0


def comma_names(text: str | None, flag: str) -> list[str] | None:
    """A comma-separated flag value as lower-case names; None when the flag was not given."""
    if text is None:
        return None
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not names:
        raise MeshfitError(f"{flag} needs at least one value, e.g. {flag} a,b")
    return names


def comma_counts(text: str | None, flag: str) -> list[int] | None:
    """A comma-separated flag value as whole numbers >= 1; None when the flag was not given."""
    names = comma_names(text, flag)
    if names is None:
        return None
    if not all(n.isdigit() and int(n) >= 1 for n in names):
        raise MeshfitError(f"{flag} takes whole numbers of at least 1, comma-separated, got {text!r}")
    return [int(n) for n in names]
