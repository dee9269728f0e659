"""The `meshfit` command line: `meshfit COMMAND ...`, also `python -m meshfit`.

Each command lives in the module of its concept, which provides `add_arguments(parser)` and
`run(args) -> int`; only the chosen command's module is imported, so start-up stays fast and
Keras is imported after the engine is chosen.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings

from meshfit.errors import MeshfitError

COMMANDS = {
    "info": ("meshfit.cli", "print the devices found, engine, precision and batch multiple"),
    "train": ("meshfit.training", "train a recipe and write a run directory"),
    "eval": ("meshfit.training", "evaluate a trained model on its test set"),
    "predict": ("meshfit.inference", "classify image files on the CPU"),
    "export": ("meshfit.export", "export a trained model for CPU serving (keras or onnx)"),
    "bench": ("meshfit.bench", "time the train step per engine, precision and batch size"),
    "launch": ("meshfit.launch", "start N local processes of a multi-host job"),
}


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every command that connects to devices takes."""
    parser.add_argument("--simulate-devices", type=int, metavar="N",
                        help="run on N JAX CPU devices standing in for accelerator cores")
    parser.add_argument("--precision", default="auto",
                        help="auto, float32, bfloat16 or float16 (default: auto)")
    parser.add_argument("--engine", default=None,
                        help="Keras backend: auto, jax or tensorflow (default: auto)")
    parser.add_argument("--require", choices=("tpu", "gpu", "cpu"),
                        help="fail unless this platform is present")


def connect_from_args(args: argparse.Namespace, verbose: bool = True):
    """`meshfit.connect` with the device flags of `args`."""
    from meshfit.distribution import connect

    return connect(require=args.require, simulate=args.simulate_devices,
                   precision=args.precision, engine=args.engine, verbose=verbose)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `meshfit info`."""
    add_device_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """`meshfit info`: the discovery report."""
    strategy = connect_from_args(args, verbose=not args.json)
    if args.json:
        print(json.dumps(strategy.describe()))
    return 0


def _parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshfit",
        description="Train any Keras model on every core of a TPU, GPU or CPU; infer on the CPU.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            mod = importlib.import_module(module)
            (getattr(mod, f"add_{name}_arguments", None) or mod.add_arguments)(cmd)
    return parser


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"meshfit: warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    """Run one command; a MeshfitError becomes one line on stderr and exit code 2."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = _parser(command if command in COMMANDS else None).parse_args(argv)
    if args.command is None:
        _parser(None).print_help()
        return 1
    warnings.formatwarning = _one_line_warning
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        code = (getattr(module, f"run_{args.command}", None) or module.run)(args) or 0
    except MeshfitError as err:
        print(f"meshfit: error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("meshfit: interrupted", file=sys.stderr)
        code = 130
    if code:
        from meshfit.cluster import exit_failed

        exit_failed(code)  # a failed process of a multi-host job must not wait for the others
    return code


if __name__ == "__main__":
    sys.exit(main())
