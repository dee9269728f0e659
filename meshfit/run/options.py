"""The settings of a training run, one frozen TrainOptions: one name, one default, one check each.

`meshfit train` builds it from its flags (each field with a help text is a flag, added by
add_flags and read back by from_args), `meshfit info` and `plan` from theirs (the same
declarations: connect()'s settings, CONNECT, and plan's batch and data folder), Python from
train()'s keywords, and the run carries it unchanged. None means "not given": the recipe's value, or on --resume the run's.
What was trained is recorded in config.json by meshfit.run.spec.RunSpec.

Adding a training setting: a field here (its help text makes the flag), a RunSpec field of the
same name when config.json records it, and its use in meshfit.run.train or
meshfit.run.keras_side.fitting.
A setting renamed since a release keeps its old flag (`aliases`) and Python keyword (OLD_NAMES).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from meshfit import data
from meshfit.data import order
from meshfit.errors import MeshfitError
from meshfit.parallel import engine as engine_lib
from meshfit.parallel import modes, planning, sharding
from meshfit.parallel.sharding import DEFAULT_FSDP_MIN_BYTES
from meshfit.run import spec


OLD_NAMES = {"batch_size": "global_batch", "fsdp_min_size": "fsdp_min_bytes"}  # meshfit 0.1's
SHARDING = ("sharding", "fsdp_min_bytes", "device_memory")  # how variables are laid out
# The settings meshfit.connect() takes, by the same names: the flags of `meshfit info`, and of
# `plan` and `train` with theirs.
CONNECT = ("simulate_devices", "precision", "engine", "require", *SHARDING, "model_parallel")
ON_RESUME = "; on --resume the run's"  # in the help of a default a resumed run keeps: train's only


def _setting(default: Any, help: str | None = None, **flag: Any) -> Any:
    """A field; with `help` it is also a flag of `meshfit train` and of the other commands that
    take it (argparse keywords in `flag`; "{default}" in `help` is `default`, the one place it
    is written; `negated=True` makes a True-by-default setting the flag --no-NAME; `aliases` are
    older spellings of the flag, still accepted)."""
    if help is not None:
        help = help.replace("{default}", str(default))
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class TrainOptions:
    """Every setting of a training run (the recipe aside), checked when made.

    See the help text of each field (`meshfit train --help`); callbacks, verbose and command are
    for Python callers and the CLI itself.
    """

    validation_split: float | None = _setting(
        None, "hold out this share of the training data for the per-epoch val_* metrics "
              f"(default: {data.FOLDER_VALIDATION_SPLIT} with --data, else the recipe's)",
        type=float, metavar="F")
    epochs: int | None = _setting(None, "epochs (default: the recipe's)", type=int, metavar="N")
    steps_per_epoch: int | None = _setting(
        None, "train steps per epoch (default: the recipe's, or one pass over the data)",
        type=int, metavar="N")
    global_batch: int | None = _setting(
        None, "samples per step over all replicas (default: the recipe's)", type=int,
        metavar="N", aliases=("--batch-size",))
    data_dir: str | None = _setting(None, "where the dataset is (see meshfit.data.datasets)",
                                    metavar="DIR")
    out: str | None = _setting(None, "the run directory (default: runs/<recipe>-<time>)",
                               metavar="DIR")
    seed: int | None = _setting(None, f"random seed (default: {order.DEFAULT_SEED})", type=int,
                                metavar="S")
    resume: str | None = _setting(None, "continue a run from its newest checkpoint",
                                  metavar="RUN_DIR")
    checkpoint_every: str | int | None = _setting(
        None, "steps (200), time (60s, 5m), 'epoch' or 'off' (default: "
              f"{spec.DEFAULT_CHECKPOINT_EVERY}); epoch ends are always saved unless 'off'",
        metavar="EVERY")
    keep_checkpoints: int | None = _setting(
        None, f"keep the newest K checkpoints (default: {spec.DEFAULT_KEEP_CHECKPOINTS})",
        type=int, metavar="K")
    local_copy_every: int | str | None = _setting(
        None, "also keep the training state on each host's local disk every N steps, the newest "
              "2, which resuming takes when every process has it and it is newer than the newest "
              "checkpoint ('off' or 0: none, the default; meshfit launch --elastic: every step)",
        metavar="N")
    steps_per_dispatch: int | None = _setting(
        None, "train steps per call into the devices, one compiled loop (default: up to "
              f"{planning.AUTO_STEPS_PER_DISPATCH} on a GPU or TPU, 1 on a CPU)",
        type=int, metavar="K")
    micro_batches: int | str | None = _setting(
        None, "sum each batch's gradient over K slices: for cache locality on a CPU (TensorFlow), "
              "or for memory (JAX: each device's share in K) (default: cache-sized on the "
              "TensorFlow engine, else 1 = whole batches)", type=int, metavar="K")
    batch_rounding: bool = _setting(
        True, "fail instead of rounding a batch that does not split across replicas", negated=True)
    tensorboard: bool = _setting(True, "write no TensorBoard logs (default: RUN/tensorboard)",
                                 negated=True)
    log_every: int = _setting(10, "TensorBoard training scalars every N steps (default: {default})",
                              type=int, metavar="N")
    profile: str | None = _setting(
        None, "trace train steps START to STOP with the engine's profiler into RUN/tensorboard "
              "(view in TensorBoard's profile tab or Perfetto)", metavar="START:STOP")
    simulate_devices: int | None = _setting(
        None, "run on N JAX CPU devices standing in for accelerator cores", type=int, metavar="N")
    precision: str = _setting(planning.DEFAULT_PRECISION,
                              f"{', '.join(planning.PRECISIONS[:-1])} or {planning.PRECISIONS[-1]} "
                              "(default: {default})")
    engine: str | None = _setting(
        None, f"Keras backend: {', '.join(engine_lib.ENGINES[:-1])} or {engine_lib.ENGINES[-1]} "
              f"(default: {engine_lib.DEFAULT_ENGINE})")
    require: str | None = _setting(None, "fail unless this platform is present",
                                   choices=("tpu", "gpu", "cpu"))
    sharding: str | None = _setting(
        None, f"{modes.help_text()}; when neither fits (without "
              "--model-parallel), auto takes the smallest --model-parallel K that does (default: "
              f"{modes.DEFAULT.name}{ON_RESUME})", metavar="S")
    fsdp_min_bytes: int | str | None = _setting(
        None, "with fsdp: shard floating-point variables of at least SIZE (default: "
              f"{DEFAULT_FSDP_MIN_BYTES >> 20}MiB{ON_RESUME})", metavar="SIZE",
        aliases=("--fsdp-min-size",))
    device_memory: int | str | None = _setting(
        None, "memory of one device to plan with, e.g. 48MB or 16GB (default: the device's own "
              "figure on TPUs and GPUs; unknown on CPUs)", metavar="SIZE")
    model_parallel: int | None = _setting(
        None, "K devices per model replica: a mesh (devices/K) x K with axes batch and model, every "
              "kernel split over model (tensor parallelism chosen from its shape) and --sharding on "
              "batch (default: 1, or with --sharding auto the smallest K whose step fits where "
              f"data and fsdp do not{ON_RESUME})", type=int, metavar="K")
    callbacks: list | None = _setting(None)  # extra Keras callbacks for fit
    verbose: bool = _setting(True)  # print the devices, the start line and the result
    command: str | None = _setting(None)  # the command line to record (default: the Python call)

    def __post_init__(self) -> None:
        for name in ("epochs", "global_batch", "keep_checkpoints", "steps_per_epoch", "log_every"):
            at_least_one(name, getattr(self, name))
        check_fraction("validation_split", self.validation_split)
        object.__setattr__(self, "precision", planning.precision_name(self.precision))
        spec.check_seed(self.seed)
        spec.parse_every(self.checkpoint_every)
        object.__setattr__(self, "local_copy_every", spec.parse_local_copy_every(self.local_copy_every))
        spec.profiling_steps(self.profile)
        if self.steps_per_dispatch is not None:
            planning.check_steps_per_dispatch(self.steps_per_dispatch)
        if self.micro_batches not in (None, "auto"):
            planning.check_micro_batches(self.micro_batches)
        if self.sharding is not None:
            object.__setattr__(self, "sharding", modes.check_sharding(self.sharding))
        sharding.parse_fsdp_min_bytes(self.fsdp_min_bytes)
        sharding.parse_size(self.device_memory)
        sharding.check_model_parallel(self.model_parallel)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **changes: Any) -> "TrainOptions":
        """The options of parsed flags (each flag's field read by its name), with `changes` on top."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                 if f.metadata.get("help") and hasattr(args, f.name)}
        return cls(**{**given, **changes})

    def connect_settings(self) -> dict[str, Any]:
        """The keywords of meshfit.connect() among these options (CONNECT, and verbose)."""
        return {**of(self, CONNECT), "verbose": self.verbose}

    def given(self) -> dict[str, Any]:
        """The settings that differ from their defaults, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}


def default(name: str) -> Any:
    """The default of setting `name`, as declared above (None: not given, see the module doc)."""
    return TrainOptions.__dataclass_fields__[name].default


def of(settings: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The settings `names` of `settings` (TrainOptions or parsed flags) as keywords."""
    return {name: getattr(settings, name) for name in names}


def current_names(settings: dict[str, Any]) -> dict[str, Any]:
    """Python keywords of TrainOptions with the older spellings (OLD_NAMES) renamed."""
    settings = dict(settings)
    for old, new in OLD_NAMES.items():
        if old in settings:
            if new in settings:
                raise MeshfitError(f"{old} is the older name of {new}; give {new} only")
            settings[new] = settings.pop(old)
    return settings


def flag(name: str) -> str:
    """The command-line flag of setting `name`: --NAME with dashes (--no-NAME when negated)."""
    negated = TrainOptions.__dataclass_fields__[name].metadata.get("negated")
    return f"--{'no-' if negated else ''}{name.replace('_', '-')}"


def add_flags(parser: argparse.ArgumentParser, *names: str) -> None:
    """Add the flags of settings `names` (default: every setting with a help text), in field order;
    a command without --resume gets no help text about it."""
    for f in dataclasses.fields(TrainOptions):
        keywords = dict(f.metadata)
        if keywords.get("help") is None or (names and f.name not in names):
            continue
        aliases = keywords.pop("aliases", ())
        if names and "resume" not in names:
            keywords["help"] = keywords["help"].replace(ON_RESUME, "")
        if keywords.pop("negated", False):
            keywords["action"] = "store_false"
        else:
            keywords["default"] = f.default
        parser.add_argument(flag(f.name), *aliases, dest=f.name, **keywords)


def at_least_one(name: str, value: int | None) -> None:
    """A MeshfitError naming the flag unless `value` is None or at least 1."""
    if value is not None and value < 1:
        raise MeshfitError(f"{flag(name)} must be at least 1, got {value}")


def check_fraction(name: str, value: float | None) -> None:
    """A MeshfitError naming the flag unless `value` is None or in [0, 1)."""
    if value is not None and not 0 <= value < 1:
        raise MeshfitError(f"{flag(name)} must be at least 0 and below 1, got {value}")
