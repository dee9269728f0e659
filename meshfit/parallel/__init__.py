"""The light core, everything that runs before Keras: finding the devices, choosing the engine,
planning the batch and the precision, the sharding modes (modes) and their rules as pure
functions of shapes (sharding), and joining a job of several hosts (cluster, heartbeat);
jax_internals is the one seam to JAX's private code. No module here imports Keras, JAX or
TensorFlow at its top, nor any meshfit package above this one (fit, watch, data, run, serve,
commands), at its top or inside a function: the packages that need Keras come after it.
"""
