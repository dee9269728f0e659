"""The train step lowered and compiled (never run) on abstract arrays, and XLA's account of it:
its memory analysis (bytes per device) and cost analysis (flops, bytes accessed), and the
collectives in its per-device program.

The model's own stateless `train_step` is lowered with `jax.ShapeDtypeStruct` arguments carrying
a mode's shardings (the batch split over the devices, every variable laid out by
meshfit.parallel.sharding), so nothing is allocated.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import jax
import keras
from jax.sharding import NamedSharding, PartitionSpec

from meshfit.errors import MeshfitError
from meshfit.parallel import sharding
from meshfit.watch.keras_side import report


def step_arguments(model, global_batch: int, mesh=None, specs: dict | None = None,
                   one_hot: bool = False, data=None, input_shapes=None) -> tuple:
    """(state, data) of the model's stateless `train_step` as abstract arrays for a global batch.

    mesh: a jax Mesh to give them shardings on (the batch split along axis 'batch'; variable
    `v` laid out by `specs[id(v)]`, replicated when absent); None: no shardings.
    data: the batch as fit reads it ((x, y) or (x, y, sample_weight): any structure of arrays or
    jax.ShapeDtypeStruct, whose first dimension is replaced by global_batch); None: made from the
    model's inputs and outputs, their unknown dimensions taken from `input_shapes`
    (see `input_structs`), with labels of the outputs' shape (one_hot: float, like the outputs;
    else sparse integer labels without the last axis).
    """
    def placed(spec):
        return None if mesh is None else NamedSharding(mesh, PartitionSpec(*spec))

    def variable(v):
        spec = (specs or {}).get(id(v), [None] * len(v.shape))
        return jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=placed(spec))

    # A batch whose rows do not split over the batch axis is placed whole on every device
    # (meshfit.fit.batch_placement), and planned so: its sharded placement does not lower.
    rows = "batch" if mesh is None or global_batch % dict(mesh.shape).get("batch", 1) == 0 else None

    def batch(shape, dtype):
        shape = (global_batch,) + tuple(shape[1:])
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed([rows] + [None] * (len(shape) - 1)))

    state = tuple([variable(v) for v in group] for group in state_groups(model))
    if data is not None:
        return state, jax.tree.map(lambda a: batch(a.shape, a.dtype), data)
    x = input_structs(model, input_shapes)
    known = next(iter(jax.tree.leaves(x)), None)
    def label(o):  # unknown output dimensions (a sequence) as the first input's
        shape = [d if d is not None else (known.shape[i] if known is not None and i < len(known.shape)
                                          else None) for i, d in enumerate(o.shape)]
        if any(d is None for d in shape[1:]):
            raise MeshfitError(f"cannot plan for an output of shape {tuple(o.shape)}: give its "
                               "unknown dimensions in input_shapes (e.g. input_shapes={'token_ids': (1024,)})")
        return batch(shape, "float32") if one_hot else batch(shape[:-1], "int32")
    x = jax.tree.map(lambda a: batch(a.shape, a.dtype), x)
    y = [label(o) for o in model.outputs]
    return state, (x, y[0] if len(y) == 1 else y)


def input_structs(model, input_shapes=None):
    """The model's inputs as jax.ShapeDtypeStruct (batch dimension 1, replaced later), in the
    structure the model takes them (a dict by name for keras-hub models). input_shapes: each
    input's shape without the batch dimension, for the dimensions `keras.Input` leaves unknown
    (None, e.g. a sequence length): a dict by input name, a list in the inputs' order, or one
    shape for every input. A MeshfitError names an input whose shape is still unknown."""
    inputs = model.inputs
    names = [t.name for t in inputs]
    structure = getattr(model, "_inputs_struct", None)
    if isinstance(input_shapes, dict):
        given = [input_shapes.get(name) for name in names]
    elif input_shapes is not None and all(isinstance(d, int) for d in input_shapes):
        given = [input_shapes] * len(inputs)
    else:
        given = list(input_shapes) if input_shapes is not None else [None] * len(inputs)
    structs = {}
    for t, name, shape in zip(inputs, names, given):
        shape = tuple(t.shape[1:]) if shape is None else tuple(shape)
        if any(d is None for d in shape):
            raise MeshfitError(f"cannot plan for input {name!r} of shape {tuple(t.shape)}: give its "
                               f"unknown dimensions, e.g. input_shapes={{{name!r}: (1024,)}} (without "
                               "the batch)")
        structs[id(t)] = jax.ShapeDtypeStruct((1,) + shape, t.dtype)
    if structure is not None:
        return keras.tree.map_structure(lambda t: structs[id(t)], structure)
    leaves = [structs[id(t)] for t in inputs]
    return leaves[0] if len(leaves) == 1 else leaves


def state_groups(model) -> tuple:
    """The train step's state: trainable, non-trainable, optimizer and metrics variables."""
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    return (model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
            model.metrics_variables)


def variable_specs(model, mode: str, strategy) -> dict[int, list]:
    """Each variable's partition spec under `mode`, by id: its rule (meshfit.parallel.modes), except
    where it is laid out otherwise (a LayoutMap's entry, or an optimizer slot of one), which
    keeps its layout, as Strategy.relayout keeps it. A variable laid out on a mesh of another
    shape than this strategy's (a plain fit's model planned for another K) takes the user's
    layout_map entry there, else the rule."""
    specs = {}
    distribution = strategy.distribution
    for group in state_groups(model):
        for v in group:
            shape = tuple(v.shape)
            if distribution is None:
                specs[id(v)] = [None] * len(shape)
                continue
            layout = getattr(v, "_layout", None)
            mesh = getattr(layout, "device_mesh", None)
            if layout is None or (mesh is not None and tuple(mesh.shape) != tuple(distribution.device_mesh.shape)):
                entry = distribution._layout_map[v.path]
                specs[id(v)] = (list(entry.axes) if entry is not None
                                else distribution.spec(shape, v.dtype, mode))
                continue
            # The layout, not the value's sharding: an abstract model's (plan_build) variables
            # have no value, and reading .value would make one.
            specs[id(v)] = distribution.axes_under(shape, v.dtype, getattr(layout, "axes", None) or [], mode)
    return specs


def axis_sizes(strategy) -> dict[str, int]:
    """The mesh's axis sizes by name ({'batch': 1} without a distribution)."""
    return strategy.distribution.axis_sizes if strategy.distribution is not None else {"batch": 1}


# The collectives of a compiled (per-device) HLO program and their result type: `%name = TYPE
# all-reduce(`; an asynchronous one is counted at its -done, whose type is its result alone.
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute|collective-broadcast)(-done)?\(", re.MULTILINE)
_ARRAY = re.compile(r"\b(pred|[a-z]+(\d+)[a-z\d]*)\[([\d,]*)\]")  # f32[64,128], bf16[8], pred[4]


def step_cost(compiled) -> dict[str, Any]:
    """XLA's cost estimate of a compiled step per device: flops and bytes accessed (its cost
    analysis; None where the backend gives none), and the collectives in its program: how many,
    and the bytes of their results (what the devices exchange, as XLA compiled it)."""
    try:
        cost = compiled.cost_analysis()
        cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
    except Exception:  # a backend without a cost model
        cost = {}
    count, moved = 0, 0
    try:
        text = compiled.as_text()
    except Exception:
        text = ""
    for result, _, _ in _COLLECTIVE.findall(text):
        count += 1
        for dtype, bits, dims in _ARRAY.findall(result):
            size = 1 if dtype == "pred" else max(int(bits) // 8, 1)
            moved += math.prod(int(d) for d in dims.split(",") if d) * size
    flops, accessed = cost.get("flops"), cost.get("bytes accessed")
    return {"flops": None if flops is None else float(flops),
            "bytes_accessed": None if accessed is None else float(accessed),
            "collectives": count if text else None, "collective_bytes": moved if text else None}


def compiled_bytes(model, global_batch: int, mesh, specs, data=None,
                   input_shapes=None) -> tuple[int, int, dict]:
    """(total, temporaries, step_cost) per device of the compiled step for a global batch (bytes).
    total = XLA's arguments + outputs not aliased to them (the state is donated) + temporaries."""
    errors = {}
    for one_hot in (False, True) if data is None else (False,):  # sparse labels first, as meshfit's recipes use
        arguments = step_arguments(model, global_batch, mesh, specs, one_hot, data, input_shapes)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # donation notes
                compiled = report.lower_train_step(model, *arguments, donate_argnums=0).compile()
            stats = compiled.memory_analysis()
            break
        except Exception as error:  # a loss wanting the other label shape
            errors["labels shaped as the outputs" if one_hot else "sparse labels"] = error
    else:  # each try's own error: either may be the one that says why (a label shape, or not)
        said = "; ".join(f"with {labels}: {(str(e).splitlines() or [type(e).__name__])[0][:200]}"
                         for labels, e in errors.items())
        raise MeshfitError(f"cannot plan the memory of this model's train step ({said})")
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
             + stats.temp_size_in_bytes)
    return int(total), int(stats.temp_size_in_bytes), step_cost(compiled)


def batch_bytes(model, rows: int, data=None, input_shapes=None) -> int:
    """Bytes of `rows` samples of the model's inputs (labels not counted)."""
    x = data[0] if data is not None else input_structs(model, input_shapes)
    return sum(rows * math.prod(t.shape[1:]) * sharding.itemsize(t.dtype) for t in jax.tree.leaves(x))
