"""The `meshfit` command line: `meshfit COMMAND ...`, also `python -m meshfit`.

Every command has `add_<command>_arguments(parser)` and `run_<command>(args) -> int` here (bench's
and launch's hand on to meshfit.commands.bench.command and meshfit.commands.launch_command), and every flag is defined once: a run's settings, the
flags of train, info, plan, eval and bench alike, in meshfit.run.options, the others here; the
work itself is done by the library module of its concept. Library
modules never import this one. Every module the command line imports runs before the engine is
chosen, so none imports Keras, JAX or TensorFlow at its top: each command's module crosses the
engine line itself, after connect() (see docs/reference/code.md). The modules that load numpy and
the data packages (~0.3 s) are imported inside the command that needs them, so that `meshfit
predict`'s cold start, `launch` and `--help` do not pay for the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import gc
import json
import os
import shlex
import sys
import warnings
from typing import Callable

import meshfit
from meshfit.commands import ctrl_c, launch_command, runs
from meshfit.commands import verify as verify_command
from meshfit.errors import MeshfitError
from meshfit.parallel import cluster, engine
from meshfit.run import options
from meshfit.watch import figures, goodput

COMMANDS = {
    "info": "print the devices found, engine, precision and batch multiple",
    "train": "train a recipe, a recipe file or a folder of images; write a run directory",
    "eval": "evaluate a trained model on its test set or a folder of images",
    "predict": "classify image files on the CPU (a model that is no classifier: its values)",
    "export": "export a trained model for CPU serving (keras or onnx)",
    "bench": "time the train step per engine, precision and batch size",
    "plan": "the memory per device of a recipe's train step, replicated and sharded (fsdp)",
    "launch": "start N local processes of a multi-host job",
    "runs": "list run directories side by side: settings, progress, accuracy, speed",
    "recipe": "print a built-in recipe as a file to start one's own from",
    "verify": "train a few steps on one device and on N, compare step by step: same model or not",
}


# ------------------------------------------------------------------------------- shared flags

def _recipes():
    """meshfit.recipes, for the commands that name recipes."""
    from meshfit import recipes  # start-up: loads numpy and the data modules (see the docstring)

    return recipes


def add_json_argument(parser: argparse.ArgumentParser, what: str = "the results") -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON")


# --------------------------------------------------------------------------------------- info

def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    """The settings connect() takes (meshfit.run.options.CONNECT) and --json."""
    options.add_flags(parser, *options.CONNECT)
    add_json_argument(parser, "the report")


def run_info(args: argparse.Namespace) -> int:
    """The discovery report."""
    settings = options.TrainOptions.from_args(args, verbose=not args.json)
    strategy = meshfit.connect(**settings.connect_settings())
    if args.json:
        print(json.dumps(strategy.describe()))
    return 0


# -------------------------------------------------------------------------------------- train

def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipe, the folder flags (--data ...), --json and every setting of TrainOptions."""
    recipes = _recipes()
    parser.add_argument("recipe", nargs="?", metavar="RECIPE",
                        help=f"one of: {', '.join(recipes.names())}, or a recipe file defining "
                             f"RECIPE = meshfit.Recipe(...) (default: {recipes.DEFAULT})")
    parser.add_argument("--data", metavar="FOLDER",
                        help="train an image classifier on FOLDER, one sub-folder of images per "
                             "class (or train/ and test/ or val/ sub-folders); needs --image-size")
    parser.add_argument("--image-size", type=int, nargs=2, metavar=("H", "W"),
                        help="with --data: resize images to H x W pixels")
    parser.add_argument("--channels", type=int, choices=(1, 3),
                        help="with --data: 1 (grey) or 3 (RGB) (default: 1 when the images are grey)")
    parser.add_argument("--model", metavar="NAME",
                        help="with --data: cnn, mobilenetv3small or efficientnetb0 (default: cnn up "
                             "to 64 pixels, mobilenetv3small above)")
    parser.add_argument("--json", action="store_true", help="print metrics.json as the last line")
    options.add_flags(parser)


def run_train(args: argparse.Namespace) -> int:
    """Train; a stop by SIGTERM/SIGINT (state saved) exits with its own code and one line."""
    from meshfit.run import train  # start-up: only this command loads the data modules

    command = shlex.join(["meshfit", *sys.argv[1:]])
    recipe = args.recipe
    if args.data is not None:
        recipe = folder_recipe(args, command)
    elif args.image_size or args.channels or args.model:
        raise MeshfitError("--image-size, --channels and --model go with --data FOLDER")
    settings = options.TrainOptions.from_args(  # --validation-split is in the folder recipe with --data
        args, command=command, validation_split=None if args.data else args.validation_split)
    metrics = train.train(recipe, settings)  # a stop on a signal: TrainingInterrupted, see main
    if args.json:
        print(json.dumps(metrics), flush=True)
    return 0


def folder_recipe(args: argparse.Namespace, command: str):
    """The image-folder recipe `--data FOLDER --image-size H W ...` asks for, with its file's text."""
    from meshfit.recipes import image_folder  # start-up: only --data loads it

    if args.recipe or args.resume:
        raise MeshfitError("--data trains a new run on a folder; give a RECIPE, --resume RUN_DIR "
                           "or --data FOLDER, one of them")
    if not args.image_size:
        raise MeshfitError("--data needs --image-size H W, the pixels to resize images to "
                           "(e.g. --image-size 28 28)")
    folder, size = image_folder.check_folder(args.data), tuple(args.image_size)  # before connecting
    chosen = {"channels": args.channels or image_folder.guess_channels(folder),
              "model": (args.model or image_folder.default_model(size)).lower(),
              "validation_split": args.validation_split}
    chosen = {key: value for key, value in chosen.items() if value is not None}
    recipe = image_folder.recipe(folder, size, **chosen)
    text = image_folder.recipe_file_text(command, folder, size, **chosen)
    return dataclasses.replace(recipe, text=text)


# --------------------------------------------------------------------------------------- eval

def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="RUN_DIR_OR_MODEL",
                        help="a run directory written by meshfit train, or its model.keras")
    parser.add_argument("--data", metavar="FOLDER",
                        help="score on this folder of class sub-folders (named as the run's "
                             "classes) instead of the run's test set")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="where the run's built-in dataset is (default: the run's)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON, last line")
    options.add_flags(parser, "simulate_devices", "engine", "require")


def run_eval(args: argparse.Namespace) -> int:
    from meshfit.run import evaluate  # start-up: only this command loads the data modules

    result = evaluate.evaluate(args.model, args.data_dir, folder=args.data,
                               simulate_devices=args.simulate_devices, engine=args.engine,
                               require=args.require, verbose=not args.json)
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(f"{evaluate.score_line(result)}  ({result['samples']} {result['sample_name']}"
              f"{' of ' + result['data'] if args.data else ''})")
    return 0


# ------------------------------------------------------------------------------------ predict

def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="run directory, .keras or .onnx file")
    parser.add_argument("images", nargs="*", metavar="IMAGE", help="PNG or JPEG files")
    parser.add_argument("--top-k", type=int, metavar="K",
                        help="classes to list per image (default: 3, or all when fewer)")
    parser.add_argument("--show", metavar="OUT.png",
                        help="write a picture of the images with their probabilities")
    add_json_argument(parser)
    parser.add_argument("--backend", choices=("auto", "onnx", "keras"), default="auto",
                        help="auto (ONNX Runtime when possible), onnx or keras (default: auto)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="ONNX Runtime threads per operation (default: one per core)")
    parser.add_argument("--benchmark", type=int, metavar="N",
                        help="time N single-image predictions in this process; print p50/p90 ms")


def run_predict(args: argparse.Namespace) -> int:
    """Classify image files on the CPU (or print the values of a model that is no classifier)."""
    _serving_on_the_cpu()
    from meshfit.serve import inference  # start-up: predict's cold start loads only what it uses

    if args.top_k is not None and args.top_k < 1:
        raise MeshfitError(f"--top-k must be at least 1, got {args.top_k}")
    if args.threads is not None and args.threads < 1:
        raise MeshfitError(f"--threads must be at least 1, got {args.threads}")
    figures.check_path("--show", args.show)
    if args.benchmark is not None:
        stats = inference.benchmark_latency(args.model, n=args.benchmark, backend=args.backend,
                                            threads=args.threads)
        print(json.dumps(stats) if args.json else
              f"{args.model} on {stats['backend']}: p50 {stats['p50_ms']:.3f} ms, "
              f"p90 {stats['p90_ms']:.3f} ms per image ({stats['n']} runs, batch 1)")
        if not args.images:
            return 0
    if not args.images:
        raise MeshfitError("no images given; usage: meshfit predict MODEL IMAGE...")
    inference.check_model(args.model)  # a wrong model, then a bad image, fail before any export
    inference.check_images(args.images)
    predictor = inference.load_predictor(args.model, backend=args.backend, threads=args.threads)
    images = inference.load_images(args.images, predictor.input_shape)
    classes = len(predictor.class_names)
    if args.top_k is not None and not predictor.classifier:
        raise MeshfitError(f"--top-k lists classes, but {args.model} is no classifier (it has no "
                           "class names: its outputs are values); predict without --top-k")
    if args.top_k is not None and args.top_k > classes:
        raise MeshfitError(f"--top-k {args.top_k} is more than the model's {classes} classes; "
                           f"use 1 to {classes}")
    rows = inference.results(args.images, predictor.predict(images), predictor.class_names,
                             args.top_k or min(3, classes))
    if args.show:
        inference.save_figure(args.show, images, rows)
    if args.json:
        print(json.dumps({"model": args.model, "backend": predictor.backend, "predictions": rows}))
    else:
        print(inference.format_results(rows))
        print(f"answered on the CPU by {predictor.engine()} ({predictor.model_file})")
    return 0


# ------------------------------------------------------------------------------------- export

def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="run directory or .keras file")
    parser.add_argument("--format", choices=("keras", "onnx"), default="onnx",
                        help="onnx (for ONNX Runtime) or keras (default: onnx)")
    parser.add_argument("--out", metavar="PATH",
                        help="where to write (default: beside the model, where predict looks)")


def run_export(args: argparse.Namespace) -> int:
    """Write a float32 model for CPU serving."""
    _serving_on_the_cpu()
    from meshfit.serve import export  # start-up: only this command loads it

    write = export.export_onnx if args.format == "onnx" else export.export_keras
    print(f"wrote {write(args.model, args.out)}")
    return 0


def _serving_on_the_cpu() -> None:
    """For predict and export: a Keras on JAX stays on the CPU, and TensorFlow (the ONNX export
    runs in it, also predict's first, in this process) writes none of its C++ log lines
    ("cpu_feature_guard.cc ... rebuild TensorFlow", "Starting new session") to stderr."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


# -------------------------------------------------------------------------------------- bench

def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from meshfit.commands.bench import command  # start-up: only for bench

    command.add_arguments(parser)


def run_bench(args: argparse.Namespace) -> int:
    from meshfit.commands.bench import command  # start-up: only for bench

    return command.run(args)


# --------------------------------------------------------------------------------------- plan

def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", metavar="RECIPE",
                        help=f"a built-in recipe or a recipe file (default: {_recipes().DEFAULT})")
    options.add_flags(parser, "global_batch", "data_dir", *options.CONNECT)
    add_json_argument(parser, "the plan")


def run_plan(args: argparse.Namespace) -> int:
    """Compile the recipe's train step per sharding (never run it) and print the bytes per device."""
    from meshfit.commands import plan as plan_command  # start-up: only this command loads it

    settings = options.TrainOptions.from_args(args, verbose=not args.json)
    result = plan_command.plan_memory(args.recipe, settings)
    if args.json:  # without --json, plan_memory printed the plan
        print(json.dumps(result.as_dict()))
    return 0


# ------------------------------------------------------------------------------------- launch

def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    launch_command.add_arguments(parser)


def run_launch(args: argparse.Namespace) -> int:
    return launch_command.run(args)


# ------------------------------------------------------------------------------------- recipe

def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", metavar="NAME",
                        help="a built-in recipe (without NAME: list them)")


def run_recipe(args: argparse.Namespace) -> int:
    """Print a built-in recipe's file (e.g. `meshfit recipe fashion-mnist-cnn > mine.py`), or list them."""
    recipes = _recipes()
    if args.name:
        sys.stdout.write(recipes.source(args.name))
        return 0
    for name in recipes.names():
        summary = " ".join(recipes.get(name).doc.strip().split("\n\n")[0].split())  # 1st paragraph
        print(f"{name:20s} {summary.split(': ', 1)[-1]}")
    print("\nmeshfit recipe NAME > my_recipe.py   then edit it and run: meshfit train my_recipe.py")
    return 0


# --------------------------------------------------------------------------------------- runs

def add_runs_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="*", metavar="DIR",
                        help="run directories, or folders holding them (default: runs)")
    parser.add_argument("--plot", metavar="OUT.png",
                        help="also draw accuracy and loss of every run against time and epochs")
    parser.add_argument("--goodput-plot", metavar="OUT.png",
                        help="also draw each run's wall time as a bar stacked by goodput part")
    add_json_argument(parser, "the rows")


def run_runs(args: argparse.Namespace) -> int:
    """The table of runs (finished and unfinished) and, with --plot, their curves."""
    figures.check_path("--plot", args.plot)
    figures.check_path("--goodput-plot", args.goodput_plot)
    rows = runs.collect(args.dirs)
    print(runs.to_json(rows) if args.json else runs.format_table(rows), flush=True)
    if args.plot:
        histories = []
        for row in rows:
            try:
                histories.append([] if row["status"].startswith("unreadable") else runs.history(row["run"]))
            except ValueError:
                histories.append([])
        runs.plot(rows, histories, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.goodput_plot:
        runs.plot_goodput(rows, args.goodput_plot)
        print(f"wrote {args.goodput_plot}", file=sys.stderr if args.json else sys.stdout, flush=True)
    return 0


# ------------------------------------------------------------------------------------- verify

def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    verify_command.add_arguments(parser)


def run_verify(args: argparse.Namespace) -> int:
    """Exit 0 when every configuration trains the one-device model within rounding, else 1."""
    return verify_command.run(args)


# --------------------------------------------------------------------------------------- main

class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported as one line (exit code 2) like every other error,
    and no abbreviated flags (`--epoch` is not silently `--epochs`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(2, f"meshfit: error: {message} (see {self.prog} --help)\n")


def _parser(command: str | None) -> argparse.ArgumentParser:
    """The parser; only the chosen command's arguments are added (each may import its module).
    Its `commands` attribute holds the sub-parser of each command."""
    parser = _Parser(
        prog="meshfit",
        description="Train any Keras model on every core of a TPU, GPU or CPU; infer on the CPU.")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}
    for name, help_text in COMMANDS.items():
        cmd = parser.commands[name] = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            _function("add", name)(cmd)
    return parser


# (engine, distribution) for `meshfit --version`: keras-nightly installs the package `keras` under
# its own name (`make test-next`), as tensorflow-cpu installs `tensorflow`.
ENGINE_DISTRIBUTIONS = (("JAX", "jax"), ("Keras", "keras"), ("Keras", "keras-nightly"),
                        ("TensorFlow", "tensorflow"), ("TensorFlow", "tensorflow-cpu"))


def version_text() -> str:
    """`meshfit --version`: meshfit's version and those of Python and the engines installed
    (read from the packages' metadata: nothing heavy is imported)."""
    from importlib import metadata  # not at the top: it costs the other commands' start-up

    found = {}  # each engine's version, from the first of its distributions installed
    for name, package in ENGINE_DISTRIBUTIONS:
        try:
            found.setdefault(name, f"{name} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            pass
    python = ".".join(map(str, sys.version_info[:3]))
    return f"meshfit {meshfit.__version__} (Python {python}; {', '.join(found.values()) or 'no engine installed'})"


def _did_you_mean(word: str, choices) -> str:
    """'; did you mean X?' for the choice a mistyped or abbreviated `word` most likely meant (the
    shortest that begins with it, else the closest), else ''."""
    completions = sorted((c for c in choices if c.startswith(word)), key=len)
    close = completions or difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """The one-line error for arguments the command does not have, with the closest flag."""
    unknown = next((a for a in extras if a.startswith("-")), extras[0]).split("=", 1)[0]
    flags = [f for f in parser._option_string_actions if f.startswith("--")]
    return (f"unrecognized argument {unknown} for {parser.prog}"
            f"{_did_you_mean(unknown, flags) if unknown.startswith('-') else ''} "
            f"(see {parser.prog} --help)")


def _function(kind: str, command: str) -> Callable:
    return globals()[f"{kind}_{command}_arguments" if kind == "add" else f"run_{command}"]


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"meshfit: warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    """Run one command; a MeshfitError becomes one line on stderr and exit code 2, a Ctrl-C (at
    any moment) the line "meshfit: interrupted" and exit code 130 (meshfit.commands.ctrl_c)."""
    if argv is None:  # the process's own command line (not a caller's): its exit made quick,
        goodput.quick_exit()  # and Keras loaded without the optional imports no command uses
        engine.skip_keras_extras()
    return ctrl_c.run(lambda: _main(argv), lambda code: _exit_failed(code, stopped=False),
                      process_end=argv is None)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in COMMANDS:
        print(f"meshfit: error: unknown command {command!r}{_did_you_mean(command, COMMANDS)} "
              f"(see meshfit --help)", file=sys.stderr)
        return 2
    parser = _parser(command)
    args, extras = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 1
    if extras:
        print(f"meshfit: error: {_unrecognized(parser.commands[args.command], extras)}",
              file=sys.stderr)
        return 2
    warnings.formatwarning = _one_line_warning
    stopped = False  # training stopped on a signal at a step all processes agreed on, state saved
    try:
        code = _function("run", args.command)(args) or 0
    except MeshfitError as err:
        stopped = hasattr(err, "exit_code")  # only TrainingInterrupted has its own exit code
        print(f"meshfit: {err}" if stopped else f"meshfit: error: {err}", file=sys.stderr, flush=True)
        code = err.exit_code if stopped else 2
    _exit_failed(code, stopped)
    return code


def _exit_failed(code: int, stopped: bool) -> None:
    """After a failed or stopped command: its leftovers freed quietly, a job's process ended."""
    if code:
        # A stopped fit leaves TensorFlow's generator-backed dataset in reference cycles; freed at
        # interpreter shutdown, it logs "Error occurred when finalizing GeneratorDataset iterator:
        # FAILED_PRECONDITION" after meshfit's own line. Freed now, it says nothing.
        gc.collect()
        cluster.exit_failed(code, together=stopped)  # a failed process must not wait for the others


if __name__ == "__main__":
    sys.exit(main())
