"""Bringing a trained model back to the CPU: export (Keras, ONNX) and fast inference; the model
is loaded by meshfit.run.models, Keras imported only when a model needs it."""

from meshfit.parallel import engine as _engine


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
