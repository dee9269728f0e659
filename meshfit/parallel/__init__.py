"""The light core: finding the devices, choosing the engine, planning batch, precision and memory,
and spreading a model over the devices (`connect`, `Strategy`, data-parallel or fsdp layouts), on
one host or several (cluster, heartbeat). Nothing here imports Keras, JAX or TensorFlow at import
time; the engine is chosen first, and the packages that need it (fit, run, watch, serve) come after.
"""
