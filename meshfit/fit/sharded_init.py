"""Weights created in their shards: a variable whose layout splits it is drawn by one compiled
program straight into its shards, so no device (and not the host) ever holds it whole.

Keras (keras.src.backend.jax.core) does this only for a variable whose bytes x devices reach
250 MiB (`should_shard_at_init`); a smaller one is drawn whole on one device and then split. A
compile for every variable made building 28 to 57x slower (BENCHMARKS.md 2c): Keras' random
initializers bake their integer seed into the program. Here the seed is an argument instead, so
one compiled draw serves every variable of the same initializer, settings, shape, dtype and
layout (a model's repeated blocks compile once).

Why the values are Keras' own: the key passed in is what Keras' `draw_seed(initializer.seed)`
gives (an int seed: [seed, 0]; a SeedGenerator: its next state, advanced as Keras would), and the
JAX backend's random functions take a key array as it is (`jax_draw_seed`), so the traced program
is the one Keras runs eagerly (compiled, a normal draw's scale and shift are fused into it: the
last bit of a float may differ). JAX's partitionable threefry (the default since JAX 0.5) makes
each device compute only its shard's random bits. Keras' built-in initializers draw once per call,
which is what makes passing one key exact. A user's initializer (a class, a function) is
compiled for its variable alone, or, where a trace would change what it does, left to Keras.
One exception is in the maths: Orthogonal's QR decomposition needs the whole matrix, which each
device then computes while drawing. The Keras side: docs/reference/keras-sharded-init.md.

Active only while a meshfit strategy runs JAX on several devices (`active()` true); otherwise,
and for initializers that take a `layout` themselves (Keras 3.15's public way, which its own
initializers do not take), Keras' own path runs. The patch of Keras' variables, and every private
name used here, is in meshfit.fit.keras_internals. Imports Keras.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding
from keras.initializers import Initializer, Zeros
from keras.random import SeedGenerator

from meshfit.fit import keras_internals, sources


def initializer_hook(active: Callable[[], bool], placed: Callable[[tuple, Any], Any]) -> Callable:
    """The wrapper of Keras' JAX variable initialization (keras_internals.PATCHES) that draws split
    layouts in their shards while `active()`. `placed(shape, layout)` is the NamedSharding the
    variable's layout gives its shape (meshfit holds a dimension its axes do not divide whole:
    meshfit.fit.sources.divisible_sharding)."""

    def draw_variable(initializer, shape: tuple, dtype: str, layout) -> jax.Array | None:
        if not (active() and isinstance(layout, NamedSharding)):
            return None  # Keras' own way
        if _restored_later or type(initializer) is Zeros:
            return zeros(shape, dtype, placed(shape, layout))
        if not layout.is_fully_replicated and "layout" not in _parameters(initializer):
            sharding = placed(shape, layout)
            if not sharding.is_fully_replicated:
                return draw(initializer, shape, dtype, sharding)
        return None

    return keras_internals.variables_drawn_by(draw_variable)


_restored_later = False  # inside values_restored_later()


@contextlib.contextmanager
def values_restored_later() -> Iterator[None]:
    """Inside the block, while a meshfit strategy runs JAX on several devices, variables start
    as zeros placed from the host, not drawn: for the model of a resumed run, every variable of
    which its checkpoint overwrites next (meshfit.run.keras_side.fitting).

    Why: drawing Keras' initial values runs one small program per random operation on each
    process's own device, and JAX's persistent compilation cache keeps only process 0's
    programs (only process 0 writes it; on CPUs a program's key includes its device), so every
    other process compiled about 35 of them again for the tutorial CNN: 1.1 s of each elastic
    generation's start-up (2 x 4 CPU devices, 2-core machine, cProfile, 2026-11-28). Zeros
    compile nothing. The random number generators' states drawn at the layers' construction
    (Python's, seeded alike) are the same either way."""
    global _restored_later
    _restored_later = True
    try:
        yield
    finally:
        _restored_later = False


def zeros(shape: tuple, dtype: str, sharding: NamedSharding) -> jax.Array:
    """An array of zeros laid out by `sharding`, each device's part placed from the host (a
    zeroed buffer that is only read where a part lies): nothing compiled, where Keras' Zeros
    compiles a program per shape and dtype on each process (its optimizer's slots, its metrics'
    totals), which JAX's persistent cache keeps for process 0 only (values_restored_later)."""
    return sources.agreed_placement(np.zeros(shape, jax.numpy.dtype(dtype)), sharding)


def draw(initializer, shape: tuple, dtype: str, sharding: NamedSharding) -> jax.Array | None:
    """`initializer(shape, dtype)` computed on the devices straight into `sharding`; None where
    only Keras' own way is safe (see `_draw_other`)."""
    if not (isinstance(initializer, Initializer) and type(initializer).__module__.startswith("keras.")):
        return _draw_other(initializer, shape, dtype, sharding)
    seed = getattr(initializer, "seed", None)
    # On the host: a key array held on one device is not on the mesh of a job of several hosts.
    key = np.asarray(keras_internals.draw_seed(seed)) if isinstance(seed, (int, SeedGenerator)) else None
    settings = tuple(sorted((k, v) for k, v in initializer.get_config().items() if k != "seed"))
    compile_draw = _compiled
    if not all(isinstance(v, (bool, int, float, str, type(None))) for _, v in settings):
        compile_draw = _compiled.__wrapped__  # e.g. Constant(an array): compiled for this one alone
    return compile_draw(type(initializer), settings, shape, dtype, sharding, key is not None)(key)


@functools.lru_cache(maxsize=1024)
def _compiled(kind: type, settings: tuple, shape: tuple, dtype: str, sharding: NamedSharding,
              seeded: bool) -> Callable:
    """The compiled draw of a `kind(**dict(settings))` initializer, its key an argument when
    `seeded` (seed=0 only so that from_config does not draw a default seed from Python's random
    state); kept for every variable of the same initializer, settings, shape, dtype and layout."""
    initializer = kind.from_config({**dict(settings), "seed": 0} if seeded else dict(settings))

    def values(key):
        if seeded:
            initializer.seed = key  # a key array: Keras' JAX random functions use it as given
        return initializer(shape, dtype=dtype)

    return jax.jit(values, out_shardings=sharding)


def _draw_other(initializer, shape: tuple, dtype: str, sharding: NamedSharding) -> jax.Array | None:
    """A user's initializer (a function or class), compiled for this variable alone; None (Keras'
    way: whole, then split) where compiling it would change what it does: one that holds a
    SeedGenerator would advance it inside the trace (a leaked tracer), and one that cannot be
    traced (unseeded keras.random, a NumPy conversion) raises there and runs eagerly instead."""
    if any(isinstance(v, SeedGenerator) for v in getattr(initializer, "__dict__", {}).values()):
        return None
    try:
        return jax.jit(lambda: initializer(shape, dtype=dtype), out_shardings=sharding)()
    except Exception:  # noqa: BLE001 - an error of the initializer itself recurs in Keras' way
        return None


def _parameters(initializer) -> tuple:
    """The names `initializer` is called with (empty where they cannot be read)."""
    try:
        return tuple(inspect.signature(initializer).parameters)
    except (TypeError, ValueError):
        return ()
