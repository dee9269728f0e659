"""The sharding modes: how a run lays its variables out on the devices (`--sharding`,
`connect(sharding=...)`), one registered `ShardingMode` each (its name, one-line description and
partition rule), and `AUTO`, the policy that picks one per model. "Sharding" means this, the mode;
JAX's placement objects (jax.sharding.NamedSharding, ...) are called placements.

- data: every variable whole on every device of 'batch' (replicated); each device takes 1/N of
  the batch.
- fsdp: large floating-point variables split over 'batch' (meshfit.parallel.sharding.fsdp_spec).
- auto (DEFAULT): data when the memory plan (meshfit.fit.memory_plan.auto_sharding) says its
  step fits each device or the device memory is unknown, else fsdp.

With model parallelism K (`connect(model_parallel=K)`) every mode lays its variables out on a mesh
(N/K) x K with axes 'batch' and 'model', the 2-D layouts 'data x model K' and 'fsdp x model K'
(`ShardingMode.layout_name`): each kernel is split over 'model' by one rule under every mode
(meshfit.parallel.sharding.model_axis), and the mode decides what 'batch' holds.

Flags and config.json hold a mode's name, so saved runs and scripts keep their words; code holds
the objects and compares objects, not names. Adding a mode is one `register(ShardingMode(...))`
and its tests: docs/reference/code.md, "Adding a sharding mode".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from meshfit.errors import MeshfitError
from meshfit.parallel import sharding

# (shape, dtype, batch devices, fsdp_min_bytes, batch axis name, model devices) -> the per-axis
# partition spec: None (whole), an axis name, or a tuple of names (one dimension over both axes).
Rule = Callable[[Sequence[int], Any, int, int, str, int], list]


@dataclass(frozen=True, eq=False)
class ShardingMode:
    """One way to lay variables out: `name` (the flag's and config.json's word), `description`
    (one line, for --help and the device report), `rule` (the partition spec of a variable from
    its shape and dtype alone) and `splits_state` (whether it splits variables over 'batch', which
    needs several devices on JAX; with one, a run falls back to data)."""

    name: str
    description: str
    rule: Rule = field(repr=False)
    splits_state: bool

    def partition(self, shape: Sequence[int], dtype: Any, devices: int, fsdp_min_bytes: int,
                  axis_name: str = "batch", model_devices: int = 1) -> list:
        """The per-axis partition spec of a variable of `shape` and `dtype` on a mesh of
        `devices` along `axis_name` and `model_devices` along 'model' (1: no model axis)."""
        return list(self.rule(tuple(shape), dtype, devices, fsdp_min_bytes, axis_name, model_devices))

    def layout_name(self, model_parallel: int = 1) -> str:
        """'fsdp', or on a mesh with a 'model' axis of K > 1 devices, 'fsdp x model K'."""
        return self.name if model_parallel <= 1 else f"{self.name} x model {model_parallel}"

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other) -> bool:
        # Modes are compared as objects (one per name, from the registry). A name compared with a
        # mode would quietly be unequal, so it fails loudly instead.
        if isinstance(other, str):
            raise TypeError(f"a ShardingMode compared with the string {other!r}: compare with "
                            f"modes.mode_named({other!r}), or compare mode.name")
        return self is other

    __hash__ = object.__hash__


@dataclass(frozen=True, eq=False)
class AutoPolicy:
    """`auto`: lay variables out as `first` until a model's memory plan picks a mode (the choice:
    meshfit.fit.memory_plan.auto_sharding), keeping `first` where its step fits or the device
    memory is unknown and taking `fallback` where it does not. Variables built before the plan
    past MeshParallel.spill_after are laid out as `fallback` too. `candidates`: the modes it
    weighs, in its order of preference."""

    name: str
    description: str
    first: ShardingMode
    fallback: ShardingMode

    @property
    def candidates(self) -> tuple[ShardingMode, ...]:
        return (self.first, self.fallback)

    def __str__(self) -> str:
        return self.name

    __eq__ = ShardingMode.__eq__
    __hash__ = object.__hash__


MODES: dict[str, ShardingMode] = {}  # the registered modes by name, in registration order


def register(mode: ShardingMode) -> ShardingMode:
    """Add `mode` to the registry (a name taken, or 'auto', is a MeshfitError); returns it."""
    if mode.name in MODES or mode.name == "auto" or not mode.name.isidentifier():
        raise MeshfitError(f"sharding mode name {mode.name!r} is taken or not a plain word; "
                           f"registered: {', '.join(MODES)}")
    if not mode.description or "\n" in mode.description:
        raise MeshfitError(f"sharding mode {mode.name!r} needs a one-line description")
    MODES[mode.name] = mode
    return mode


DATA = register(ShardingMode("data", "every variable replicated", sharding.replicated_spec,
                             splits_state=False))
FSDP = register(ShardingMode(
    "fsdp", "large floating-point variables sharded over the devices, the rest replicated",
    sharding.fsdp_spec, splits_state=True))
AUTO = AutoPolicy("auto", "data when the replicated train step fits the device memory, else fsdp",
                  first=DATA, fallback=FSDP)
DEFAULT = AUTO  # the one default of the sharding setting: connect(), Strategy, TrainOptions, plan, info


def names() -> tuple[str, ...]:
    """What `--sharding` accepts: 'auto' and every registered mode's name."""
    return (AUTO.name, *MODES)


def mode_named(name: str | ShardingMode) -> ShardingMode:
    """The registered mode called `name` (a mode is returned as it is); a MeshfitError for another."""
    if isinstance(name, ShardingMode):
        return name
    word = str(name).strip().lower()
    if word not in MODES:
        what = "the policy that picks a mode, not a mode" if word == AUTO.name else "unknown"
        raise MeshfitError(f"sharding mode {name!r} is {what}; use one of: {', '.join(MODES)}")
    return MODES[word]


def sharding_named(name: str | ShardingMode | AutoPolicy | None) -> ShardingMode | AutoPolicy:
    """The sharding asked for: `AUTO` or a registered mode (None: DEFAULT); a MeshfitError listing
    what is accepted for another name."""
    if isinstance(name, (ShardingMode, AutoPolicy)):
        return name
    word = str(name if name is not None else DEFAULT.name).strip().lower()
    if word == AUTO.name:
        return AUTO
    if word not in MODES:
        raise MeshfitError(f"unknown sharding {name!r}; use one of: {', '.join(names())} "
                           "(e.g. --sharding fsdp)")
    return MODES[word]


def weighed(asked: str | ShardingMode | AutoPolicy | None,
            distributed: bool) -> tuple[ShardingMode, ...]:
    """The modes a memory plan compiles for `asked`: auto's candidates and the mode asked, those
    that split variables only where there are several devices (`distributed`) to split them over."""
    asked = sharding_named(asked)
    chosen = AUTO.candidates + (() if asked is AUTO or asked in AUTO.candidates else (asked,))
    return tuple(mode for mode in chosen if distributed or not mode.splits_state)


def check_sharding(name: str | ShardingMode | AutoPolicy | None) -> str:
    """`name` checked and lower-cased: 'auto' or a registered mode's name (None: DEFAULT's), the
    word settings and config.json hold."""
    return sharding_named(name).name


def help_text() -> str:
    """The modes and auto, one clause each, for --sharding's help."""
    return "; ".join(f"{m.name}: {m.description}" for m in (*MODES.values(), AUTO))
