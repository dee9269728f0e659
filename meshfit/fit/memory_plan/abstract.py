"""Abstract models: a compiled model built with variables that have a shape, dtype and layout
but no value (nor its optimizer's), so that planning allocates none of it (`abstract_model`).
The private Keras code this needs is reached through the seam, meshfit.fit.keras_internals.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import keras

from meshfit.errors import MeshfitError
from meshfit.fit import keras_internals
from meshfit.fit.keras_internals import global_state  # Keras' list of variables awaiting values
from meshfit.fit.memory_plan.lowering import state_groups


@contextlib.contextmanager
def _abstract_variables():
    """Variables created inside get a shape, dtype and layout but no value: Keras'
    StatelessScope, left without initializing them. Keras' optimizer makes its step counter and
    learning rate from values (scalars), which that scope refuses, so an optimizer's __init__
    runs outside it (keras_internals)."""
    with (keras_internals.optimizers_made_outside_stateless_scope(),
          keras.StatelessScope(initialize_variables=False)):  # leaving it gives no values
        yield


def abstract_model(strategy, make_model: Callable[[], Any], fallback: bool = False):
    """The compiled model `make_model()` returns, built in `strategy`'s scope with variables that
    have a shape, dtype and layout but no value (its optimizer's too), so nothing of it is
    allocated. fallback: return None, rather than raise, for a model that cannot be built so (one
    that computes with its weights while being built)."""
    waiting = list(global_state.get_global_attribute("uninitialized_variables", []) or [])
    try:
        with strategy.scope(), _abstract_variables():
            model = make_model()
            if getattr(model, "optimizer", None) is None:
                raise MeshfitError("planning needs the model compiled (model.compile(optimizer=..., "
                                   "loss=...) where it is built)")
            state_groups(model)  # the optimizer's variables, abstract too
        return model
    except Exception:
        if fallback:
            return None
        raise
    finally:
        # Forget this model's variables before compiling: Keras initializes every variable on
        # its list when the train step's own StatelessScope ends (here with tracers, leaked).
        global_state.set_global_attribute("uninitialized_variables", waiting)
