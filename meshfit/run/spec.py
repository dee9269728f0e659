"""The run specification: everything that defines a training run, frozen, saved as config.json.

`meshfit train` writes it before the first step; `--resume`, `eval` and `predict` read it back,
and metrics.json is this specification plus the results. A config.json written by an older
meshfit reads back too: keys it lacks take their defaults, keys renamed since are read under
their old names (OLD_KEYS), keys this version does not know (e.g. "started", "resumed") are kept
in the file and ignored here. Each setting has one name from its flag to its key here (see
meshfit.run.options).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from meshfit.data import order
from meshfit.errors import MeshfitError
from meshfit.parallel import modes, planning
from meshfit.run import rundir

DEFAULT_CHECKPOINT_EVERY = "60s"
DEFAULT_KEEP_CHECKPOINTS = 3
OLD_KEYS = {"simulated_devices": "simulate_devices"}  # config.json keys of meshfit 0.1 runs


@dataclass(frozen=True)
class RunSpec:
    """What is trained (recipe and its hyperparameters), on what data, how (batch, epochs, seed,
    precision, engine, replicas) and the checkpoint policy. Sizes are in samples and steps."""

    recipe: str
    dataset: str
    class_names: tuple[str, ...]  # one per model output; () for a model that is no classifier
    input_shape: tuple[int, ...]
    num_classes: int  # what build_model was given (the data's classes)
    epochs: int
    steps_per_epoch: int
    global_batch: int  # samples per step over all replicas
    steps_per_dispatch: int  # train steps per call into the devices
    micro_batches: int  # slices each batch's gradient is summed over (TensorFlow engine)
    seed: int
    precision: str  # compute precision: float32, bfloat16 or float16 (variables stay float32)
    engine: str  # the Keras backend: jax or tensorflow
    replicas: int
    platform: str
    device_kind: str
    # a classifier's outputs, which inference turns into probabilities: probabilities, logits,
    # sigmoid or sigmoid-logits (one output for two classes); values: no classifier
    outputs: str = "probabilities"
    simulate_devices: int | None = None  # JAX CPU devices per process standing in for cores
    data_dir: str | None = None
    validation_split: float = 0.0  # share of the training data held out for val_* (0: none)
    evaluated_on: str = "test"  # the split behind the per-epoch val_* metrics: test or validation
    recipe_file: str | None = None  # the recipe file's copy in the run directory (recipe.py)
    recipe_sha256: str | None = None  # of that copy, checked before it is used again
    recipe_source: str | None = None  # where the recipe file was when the run started
    augment: str = "none"
    crop_padding: int = 4
    flips: str = "random"
    tta_flip: bool = False
    tta_translate: int = 0  # pixels (meshfit.fit.predict.tta_views)
    checkpoint_every: str = DEFAULT_CHECKPOINT_EVERY
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    local_copy_every: int = 0  # steps between copies on each host's local disk (0: none)
    meshfit_version: str = ""
    keras_version: str = ""
    command: str = ""
    # How variables were laid out: a mode's name (meshfit.parallel.modes), never 'auto' (a run
    # records the mode chosen). Not modes.DEFAULT: a config.json without the key predates the
    # setting, and those runs trained data-parallel.
    sharding: str = modes.DATA.name
    fsdp_min_bytes: int | None = None  # fsdp's threshold (bytes); None: the default (older runs)
    model_parallel: int = 1  # devices per model replica (the mesh's 'model' axis)

    @property
    def sample_name(self) -> str:
        """What a sample is called in printed lines: images for (H, W, C) inputs, else samples
        (token sequences, feature rows)."""
        return "images" if len(self.input_shape) == 3 else "samples"

    def to_dict(self) -> dict[str, Any]:
        """The specification as JSON-ready data, in field order."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> "RunSpec":
        """A specification from config.json's data (unknown keys ignored, missing optional ones
        defaulted); `source` names the file in the error for missing required keys."""
        data = {OLD_KEYS.get(key, key): value for key, value in data.items()}  # runs of meshfit 0.1
        fields = dataclasses.fields(cls)
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in data]
        if missing:
            raise MeshfitError(f"{source} lacks {', '.join(missing[:3])}"
                               f"{' and more' if len(missing) > 3 else ''}; {rundir.HINT}")
        values = {f.name: data[f.name] for f in fields if f.name in data}
        for key in ("class_names", "input_shape"):
            if isinstance(values.get(key), list):
                values[key] = tuple(values[key])
        return cls(**values)


def read(run: str) -> tuple[RunSpec, dict[str, Any]]:
    """The run's specification and its whole config.json (with "started" and "resumed")."""
    config = rundir.read_config(run)
    return RunSpec.from_dict(config, os.path.join(run, rundir.CONFIG)), config


def check_resume(saved: RunSpec, run: str, *, recipe: str | None = None,
                 global_batch: int | None = None, seed: int | None = None,
                 precision: str | None = None) -> None:
    """A MeshfitError when a setting asked for on `--resume` contradicts the saved run."""
    hint = f"resume without it, or start a new run instead of --resume {run}"
    if recipe and recipe != saved.recipe:
        raise MeshfitError(f"{run} was trained with recipe {saved.recipe}, not {recipe}; {hint}")
    if global_batch and global_batch != saved.global_batch:
        raise MeshfitError(f"{run} was trained with global batch {saved.global_batch}, not "
                           f"{global_batch} (the data order depends on it); {hint}")
    if seed is not None and seed != saved.seed:
        raise MeshfitError(f"{run} was trained with seed {saved.seed}, not {seed}; {hint}")
    if planning.precision_name(precision) not in ("auto", saved.precision):
        raise MeshfitError(f"{run} was trained in {saved.precision}, not {precision}; {hint}")


def check_seed(seed: int | None) -> int:
    """The seed (default: order.DEFAULT_SEED), checked to be in 0 .. 2**31-1."""
    seed = order.DEFAULT_SEED if seed is None else int(seed)
    if not 0 <= seed < 2 ** 31:
        raise MeshfitError(f"seed {seed} is out of range; use 0 to {2 ** 31 - 1}")
    return seed


def parse_every(text: str | int | None) -> tuple[int | None, float | None, bool]:
    """`--checkpoint-every` as (every N steps, every S seconds, also at epoch ends).

    "200": every 200 steps; "60s", "5m", "1h": every so many seconds, minutes, hours; "epoch":
    only at epoch ends; "off": never (a SIGTERM/SIGINT still saves before stopping). Epoch ends
    are saved unless "off".
    """
    value = str(DEFAULT_CHECKPOINT_EVERY if text is None else text).strip().lower()
    if value in ("off", "none", "never"):
        return None, None, False
    if value == "epoch":
        return None, None, True
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smh]?)", value)
    if not match or float(match.group(1)) <= 0 or (not match.group(2) and "." in match.group(1)):
        raise MeshfitError(f"--checkpoint-every {text!r} is not understood; use a step count (200), "
                           "a time (60s, 5m, 1h), 'epoch' or 'off'")
    number, unit = match.groups()
    if not unit:
        return int(number), None, True
    return None, float(number) * {"s": 1, "m": 60, "h": 3600}[unit], True


def parse_local_copy_every(text: str | int | None) -> int | None:
    """`--local-copy-every` as a step count: "off" or 0 is 0 (no local copies), None stays None
    (not given)."""
    if text is None:
        return None
    value = str(text).strip().lower()
    if value in ("off", "none", "never"):
        return 0
    if not value.isdigit():
        raise MeshfitError(f"--local-copy-every {str(text)!r} is not understood; use a step count (1, "
                           "100) or 'off'")
    return int(value)


def python_command(**kwargs: Any) -> str:
    """How a run started from Python is recorded in `command` (unset arguments left out)."""
    shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if v is not None)
    return f"meshfit.run.train.train({shown})"


def absolute(path: str | None) -> str | None:
    """`path` made absolute (None stays None), so a run can be resumed from another directory."""
    return os.path.abspath(path) if path else None


def profiling_steps(text: str | None) -> tuple[int, int] | None:
    """(START, STOP) global train steps from "START:STOP" (0 < START < STOP), or None for None."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(text))
    start, stop = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if not 0 < start < stop:
        raise MeshfitError(f"--profile {text!r} is not understood; give the first and last train "
                           "step to trace as START:STOP with 0 < START < STOP, e.g. --profile 10:20")
    return start, stop
