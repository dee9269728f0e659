"""JAX: compile the steps of a model that Keras runs op by op only because one of its own layers
declines XLA.

Keras' image augmentation and preprocessing layers (RandomRotation, RandomZoom, RandomTranslation,
RandomCrop, StringLookup, ...) set `supports_jit = False` for TensorFlow's sake, and one such layer
makes Keras' `jit_compile="auto"` run the whole model's train, test and predict steps op by op,
on JAX too, where most of them trace: keras-io's Vision Transformer and Compact Convolutional
Transformer put them inside the model. Each op is then a program of its own on every device: a
small CNN with RandomFlip, RandomRotation and RandomZoom trained 8.4x slower op by op than
compiled on 8 simulated CPU devices (benchmarks/declined_jit.py, BENCHMARKS.md section 2). So
while a meshfit Strategy is active on JAX, such a model's step functions are compiled anyway,
with Keras' own `make_*_function`: the same step, one program.

Where a layer does not trace (Keras 3.15's RandomCrop cutting a larger image slices with traced
offsets: IndexError), the first call's tracing fails before anything runs (no buffer donated), and
that function runs op by op from then on, as Keras would have, with one warning naming the layer
and the fix (upstream-ready report: docs/reference/keras-augmentation-jit.md). Not compiled
anyway: a model compiled with `jit_compile=False` or `run_eagerly=True` (the user's choice), and
one whose own layers (not Keras') decline XLA, which may rely on running eagerly (Python side
effects per call).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re
import warnings
from typing import Any, Callable

import jax

from meshfit.fit import keras_internals


def recording_compile(compile: Callable) -> Callable:
    """Keras' `compile`, remembering whether the user asked for `jit_compile=False` outright."""
    signature = inspect.signature(compile)

    @functools.wraps(compile)
    def compile_recorded(self, *args, **kwargs):
        asked = signature.bind(self, *args, **kwargs).arguments.get("jit_compile", "auto")
        object.__setattr__(self, "_meshfit_jit_refused", asked is False)  # not tracked by Keras
        return compile(self, *args, **kwargs)

    return compile_recorded


def declining_layers(model) -> list[str]:
    """The class names of Keras' own layers that make Keras run `model` op by op, where meshfit
    compiles it anyway; [] where Keras compiles it, or where the user's choice or a layer of the
    user's own keeps it op by op."""
    if model.run_eagerly or model.jit_compile or getattr(model, "_meshfit_jit_refused", False):
        return []
    declining = keras_internals.layers_declining_jit(model)
    if not declining or not all(keras_internals.is_keras_layer(type(layer)) for layer in declining):
        return []
    return sorted({type(layer).__name__ for layer in declining})


def make(make_function: Callable, model, force: bool, attribute: str, layers: list[str]) -> None:
    """Keras' `make_<attribute>` of `model` compiled, falling back to its op-by-op function where
    the first call does not trace (see the module)."""
    make_function(model, force)
    eager = getattr(model, attribute)
    with keras_internals.jit_compiled(model):
        make_function(model, True)
    compiled = getattr(model, attribute)
    setattr(model, attribute, _CompiledElseEager(model, compiled, eager, layers, attribute))


class _CompiledElseEager:
    """`function(state, iterator)`: the compiled one, or from a first call that fails to trace,
    the op-by-op one, given the batches that call read."""

    def __init__(self, model, compiled: Callable, eager: Callable, layers: list[str], attribute: str):
        self.model, self.compiled, self.eager = model, compiled, eager
        self.layers, self.attribute = layers, attribute
        self.chosen: Callable | None = None

    def __call__(self, state, iterator):
        if self.chosen is not None:
            return self.chosen(state, iterator)
        read: list[Any] = []
        try:
            result = self.compiled(state, _remembered(iterator, read))
        except jax.errors.JaxRuntimeError:  # raised by XLA compiling or running it: not tracing
            raise
        except Exception as error:  # noqa: BLE001 (tracing fails with any error the layer raises)
            if any(a.is_deleted() for a in jax.tree.leaves(state) if isinstance(a, jax.Array)):
                raise  # a step ran (donating the state) before this failed: nothing to redo
            keras_internals.forget_failed_trace(self.model)  # else op by op drops add_loss terms
            result = self.eager(state, itertools.chain(read, iterator))  # its own error, if any
            self.chosen = self.eager
            warnings.warn(self._warning(error), stacklevel=2)
            return result
        self.chosen = self.compiled
        return result

    def _warning(self, error: Exception) -> str:
        what = {"train_function": "training", "test_function": "evaluation",
                "predict_function": "prediction"}[self.attribute]
        # Keras wraps a layer's error in "Exception encountered when calling X.call()", its own
        # line in bold (ANSI codes): the line after that says what failed.
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
        lines = [line for line in lines if line and not line.startswith("Exception encountered")]
        cause = f"{type(error).__name__}: {lines[0][:160]}" if lines else type(error).__name__
        failing = re.search(r"calling (\w+)\.call\(\)", str(error))  # the layer, where Keras says
        names = failing.group(1) if failing and failing.group(1) in self.layers else ", ".join(self.layers)
        return (f"{names} declined XLA and this model's {what} step does not trace on JAX ({cause}), "
                f"so it runs op by op, many times slower than compiled; apply {names} to the data "
                f"(e.g. in tf.data's map) rather than inside the model, and the rest compiles")


def _remembered(iterator, read: list):
    """`iterator`'s items, each also appended to `read` as it is taken."""
    for item in iterator:
        read.append(item)
        yield item
