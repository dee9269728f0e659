"""Bringing a trained model back to the CPU: export (Keras, ONNX) and fast inference; the model
is loaded by meshfit.run.models, Keras imported only when a model needs it."""
