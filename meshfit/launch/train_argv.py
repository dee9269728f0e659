"""The command every generation of `meshfit launch --elastic` runs: `meshfit train` with its run
directory (the same for every generation: runs/<recipe>-<time> when the command gives none, as
`meshfit train` names a new run), more frequent saves and local copies unless asked otherwise,
and the micro-batches that keep each device's share of the batch (--keep-batch per-core), with
the line saying which batch a generation keeps.
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from meshfit import recipes
from meshfit.errors import MeshfitError
from meshfit.launch import mesh_history
from meshfit.run import options, rundir

# A lost process costs the steps since the last checkpoint: the run saves this often unless the
# command says otherwise. A save blocks training only while the arrays are copied off the devices
# and orbax starts the write (the files are written in a background thread,
# meshfit.run.keras_side.checkpoints): 0.2-0.3 s a save in a 2-process job of the Fashion-MNIST
# CNN on a loaded 2-core VM, 2-3% of the wall time at 5 s (BENCHMARKS.md section 6), so 10 s.
ELASTIC_CHECKPOINT_EVERY = "10s"
# ... and keeps a copy of the state on each host's local disk every this many steps (at most one a
# dispatch) unless the command gives --local-copy-every: a lost process then costs the steps
# since the newest copy (meshfit.run.local_copies). A copy of the Fashion-MNIST CNN's state (1.25
# MiB) blocks training 1.1-3.5 ms (median 1.4; the run's first 85 ms, starting its writing
# thread), its write in the background about 66 ms, against 1.0-2.0 s steps of the 2 x 4-device
# job on a loaded 2-core VM: 0.1-0.3% at every step, goodput `checkpoint` 2.1% of the wall time
# against 2.0% without copies (BENCHMARKS.md section 6). A larger state or shorter steps (an
# accelerator) cost more: give a larger N there.
ELASTIC_LOCAL_COPY_EVERY = "1"

def train_command(argv: list[str]) -> tuple[list[str], str]:
    """(the command every generation runs, its run directory): `meshfit train` with --out (added
    when missing: a new runs/<recipe>-<time>, `run_name`), --checkpoint-every (ELASTIC_CHECKPOINT_EVERY when
    missing) and --local-copy-every (ELASTIC_LOCAL_COPY_EVERY when missing); a resumed run's own
    directory when the command has --resume."""
    if argv[1:3] != ["-m", "meshfit"] or len(argv) < 4 or argv[3] != "train":
        raise MeshfitError("--elastic restarts a `meshfit train` run from its checkpoints; give "
                           "one after --, e.g. meshfit launch --elastic --processes 2 -- meshfit "
                           "train fashion-mnist-cnn")
    argv = list(argv)
    run = flag_value(argv, "--resume") or flag_value(argv, "--out")
    if run is None:
        run = rundir.timestamped(run_name(argv[4:]))
        argv += ["--out", run]
    if flag_value(argv, "--resume"):
        argv = without_flag(argv, "--resume")  # each generation adds it itself
    if flag_value(argv, "--checkpoint-every") is None:
        argv += ["--checkpoint-every", ELASTIC_CHECKPOINT_EVERY]
    if flag_value(argv, "--local-copy-every") is None:
        argv += ["--local-copy-every", ELASTIC_LOCAL_COPY_EVERY]
    return argv, run


def run_name(train_args: list[str]) -> str:
    """The name `meshfit train` gives a new run of these arguments (runs/<name>-<time>): the
    built-in recipe's, "image-folder" with --data, a recipe file's own name without .py (the
    name its RECIPE gives is known only once the file runs, which may import Keras: the launcher
    never does)."""
    parser = argparse.ArgumentParser(add_help=False)  # the flags of train's that take values
    options.add_flags(parser)  # (meshfit.cli's own: the recipe, --data's; enough to find these)
    parser.add_argument("recipe", nargs="?")
    for flag, values in (("--data", None), ("--image-size", 2), ("--channels", None), ("--model", None)):
        parser.add_argument(flag, nargs=values)
    args, _ = parser.parse_known_args(train_args)
    if args.data is not None:
        return "image-folder"
    if args.recipe and recipes.is_file(args.recipe):
        return os.path.splitext(os.path.basename(args.recipe))[0]
    return recipes.builtin_name(args.recipe or recipes.DEFAULT)


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return None


def without_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def batch_line(run: str, devices: int, full_devices: int | None = None, argv: Sequence[str] = ()) -> str:
    """The batch of a generation on `devices`, e.g. 'global batch kept at 1000 (250 per device)';
    with `full_devices` (--keep-batch per-core), e.g. 'per-core batch kept at 125 (global batch
    1000 in 2 micro-batches)'. The run's global batch from config.json; argv: the command (its
    own --micro-batches)."""
    batch = mesh_history.run_config(run).get("global_batch")
    if not batch:
        return "global batch kept" if full_devices is None else "per-core batch kept"
    if full_devices is not None:
        slices = micro_batches_for(run, devices, full_devices, argv)
        if slices is not None:
            share, kept = batch // (devices * slices), per_core_batch(batch, full_devices, argv)
            text = (f"per-core batch kept at {share}" if share == kept else
                    f"per-core batch {share}, below the {kept} kept")
            return text + (f" (global batch {batch} in {slices} micro-batches)" if slices > 1
                           else f" (global batch {batch})")
    share = f"{batch // devices} per device" if batch % devices == 0 else f"{batch / devices:g} per device"
    return f"global batch kept at {batch} ({share})"


def per_core_batch(batch: int, full_devices: int, argv: Sequence[str] = ()) -> int:
    """Rows each device trains at a time on the full mesh: the global batch over its devices and
    the command's own --micro-batches."""
    asked = flag_value(list(argv), "--micro-batches")
    return max(batch // (full_devices * (int(asked) if asked and asked.isdigit() else 1)), 1)


def micro_batches_for(run: str, devices: int, full_devices: int, argv: Sequence[str] = ()) -> int | None:
    """Micro-batches per batch that keep each of `devices` at most at the full mesh's per-core
    batch (per_core_batch): the fewest whose per-device slices of the run's global batch
    (config.json) are equal, e.g. 1000 on 8 -> 4 devices: 2 (125 rows per device at a time).
    None while the batch is unknown (before the first generation wrote config.json) or does not
    split over the devices (train's own error then says why)."""
    batch = mesh_history.run_config(run).get("global_batch")
    if not isinstance(batch, int) or batch < 1 or batch % devices:
        return None
    kept = per_core_batch(batch, full_devices, argv)
    return next(k for k in range(1, batch // devices + 1)
                if batch % (devices * k) == 0 and batch // (devices * k) <= kept)


def with_micro_batches(argv: list[str], slices: int | None) -> list[str]:
    """The command with --micro-batches `slices` (argv as it is for None, or when it asks for as
    many: a full mesh keeps the command's own)."""
    asked = flag_value(argv, "--micro-batches")
    if slices is None or str(slices) == (asked or "1"):
        return argv
    return without_flag(argv, "--micro-batches") + ["--micro-batches", str(slices)]


