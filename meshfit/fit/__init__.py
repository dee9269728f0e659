"""What meshfit adds inside Keras' fit, evaluate and predict once `connect()` has chosen the engine:
the hooks on Keras' trainer, placing batches on the devices (sources), the JAX on-device loop, and
the TensorFlow engine's micro-batches and bias gradients. Reached only after `connect()`.
"""
