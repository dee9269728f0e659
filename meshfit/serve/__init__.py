"""Bringing a trained model back to the CPU: export (Keras, ONNX) and fast inference."""
