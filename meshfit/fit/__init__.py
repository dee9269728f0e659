"""The Keras side of meshfit, reached only once `meshfit.connect()` has chosen the engine: the
`Strategy` (devices, distribution, `fit`), the variable layouts it gives Keras (strategy), the
memory plan of a train step (memory_plan), the multi-host helpers of fit and predict (hosts), the
hooks on Keras' trainer, placing batches on the devices (sources), the JAX on-device loop, model
outputs over evaluation batches (predict), and the TensorFlow engine's micro-batches and bias
gradients.

Importing this package imports Keras, which fixes its backend at its first import: everything
below the engine line (meshfit.parallel, and the modules of data, run, serve and commands that
run before connect()) imports nothing from here at its top.
"""

import keras  # the package is the engine line: importing any module of fit/ loads Keras
