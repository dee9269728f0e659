"""`meshfit verify TARGET`: a recipe (built-in or file) or a run directory trained a few steps on
one device and under each configuration asked, compared (meshfit.run.verify); exit 0 when every
configuration is equal within rounding, 1 when one diverges.

The recipe's own model, optimizer and batches (meshfit.data.arrays.TrainBatches: its order and
augmentation from the seed) are used; a run directory gives its recipe, global batch, seed and
precision. Every configuration runs in this process on simulated CPU devices, as many as the
largest count asked.
"""

from __future__ import annotations

import argparse
import json
import os

import meshfit
from meshfit.errors import MeshfitError
from meshfit.parallel import planning
from meshfit.run import options, spec
from meshfit.run import verify as verify_lib
from meshfit.run import verify_engines
from meshfit.watch import figures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="TARGET",
                        help="a built-in recipe, a recipe file, or a run directory (its recipe, "
                             "global batch, seed and precision)")
    parser.add_argument("--devices", default=",".join(map(str, verify_lib.DEFAULT_DEVICES)),
                        metavar="N,N,...", help="device counts to compare with one device "
                        "(simulated CPU devices; default: %(default)s)")
    parser.add_argument("--sharding", default=",".join(verify_lib.DEFAULT_SHARDING),
                        metavar="MODE,...", help="shardings on each device count: data, fsdp, auto, "
                        "model:K (data x model K) (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=verify_lib.DEFAULT_STEPS, metavar="K",
                        help="train steps per configuration (default: %(default)s)")
    parser.add_argument("--micro-batches", default="", metavar="K,...",
                        help="also train with K micro-batches on the largest device count")
    parser.add_argument("--steps-per-dispatch", default="", metavar="K,...",
                        help="also train K steps per dispatch on the largest device count")
    parser.add_argument("--engines", default="jax", metavar="ENGINE,...",
                        help="also train on one device of each engine named besides jax "
                             "(tensorflow), in a process of its own (default: %(default)s)")
    parser.add_argument("--processes", default="", metavar="P,...",
                        help="also split the largest device count over P processes, a job of "
                             "meshfit launch (e.g. 2: 2 processes x N/2 devices)")
    parser.add_argument("--no-resume", action="store_true",
                        help="skip the stop, checkpoint and resume after half the steps")
    options.add_flags(parser, "global_batch", "data_dir", "seed")
    parser.add_argument("--precision", default=planning.DEFAULT_PRECISION, metavar="P,...",
                        help=f"one or several of {', '.join(planning.PRECISIONS)} (default: "
                             "%(default)s: the recipe's or run's, else the hardware's); every "
                             "configuration in the first, each further one against its own "
                             "one-device reference and floor on the largest device count")
    parser.add_argument("--plot", metavar="OUT.png",
                        help="the picture: loss per step and distance per step (default: "
                             "verify-<recipe>.png; '' for none)")
    parser.add_argument("--json", action="store_true", help="print the verdicts as JSON, last line")


def run(args: argparse.Namespace) -> int:
    figures.check_path("--plot", args.plot)
    counts = verify_lib.parse_counts(args.devices, "--devices")
    shardings = verify_lib.parse_shardings(args.sharding)
    engines = verify_engines.parse_engines(args.engines)
    extra = {name: verify_lib.parse_counts(getattr(args, name), f"--{name.replace('_', '-')}")
             if getattr(args, name) else () for name in ("micro_batches", "steps_per_dispatch",
                                                           "processes")}
    recipe, saved = verify_lib.target_recipe(args.target, max(counts))
    seed = spec.check_seed(args.seed if args.seed is not None else saved.seed if saved else None)
    precision = [planning.asked_precision(
        saved.precision if saved and asked == planning.DEFAULT_PRECISION else asked, recipe.precision)
        for asked in verify_lib.parse_precisions(args.precision)]
    data_dir = args.data_dir or (saved.data_dir if saved else None)
    dataset = meshfit.data.splits.load(recipe, data_dir, seed, saved.dataset if saved else None)
    if dataset.streamed:
        raise MeshfitError(f"meshfit verify reads in-memory data; {recipe.name}'s training data is "
                           "streamed (a folder or its own source): verify its model from Python "
                           "with meshfit.verify(build_model, x, y)")
    global_batch = (args.global_batch or (saved.global_batch if saved else None)
                    or recipe.global_batch
                    or (recipe.per_core_batch or planning.DEFAULT_PER_CORE_BATCH) * max(counts))
    x, y = dataset.train
    batches = meshfit.data.arrays.TrainBatches(
        x, y, global_batch, seed, steps_per_epoch=min(len(x) // global_batch, recipe.steps_per_epoch
                                                      or len(x)) or None,
        augment=recipe.augment, on_device=False, crop_padding=recipe.crop_padding, flips=recipe.flips)
    plot = f"verify-{recipe.name}.png" if args.plot is None else args.plot or None
    runs = verify_lib.configurations(counts, shardings, steps=args.steps, resume=not args.no_resume,
                                     engines=engines, **extra)
    for count in counts:
        if global_batch % count:
            raise MeshfitError(f"global batch {global_batch} does not split over {count} devices; "
                               f"give --global-batch as a multiple of {max(counts)}")
    build = verify_lib.RecipeModel(recipe, dataset, batches.steps_per_epoch, recipe.epochs, rebuild={
        "target": os.path.abspath(args.target) if os.path.exists(args.target) else args.target,
        "data_dir": data_dir, "seed": seed, "steps_per_epoch": batches.steps_per_epoch,
        "epochs": recipe.epochs})
    verdicts = verify_lib.compare_runs(
        max(counts), precision, build, lambda start: batches.iterate(0, start), runs,
        steps=args.steps, global_batch=global_batch, seed=seed, plot=plot, verbose=not args.json)
    if args.json:
        print(json.dumps({"target": args.target, "recipe": recipe.name, "seed": seed, "picture": plot,
                          **verdicts.as_dict()}), flush=True)
    return verdicts.exit_code
