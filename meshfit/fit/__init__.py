"""The Keras side of meshfit, reached only once `meshfit.connect()` has chosen the engine: the
`Strategy` (devices, distribution, `fit`), the variable layouts it gives Keras (strategy), the
memory plan of a train step (memory_plan), the multi-host helpers of fit and predict (hosts), the
hooks on Keras' trainer, placing batches on the devices (sources), the JAX on-device loop, model
outputs over evaluation batches (predict), the TensorFlow engine's micro-batches and bias
gradients, and the one seam to Keras' private code (keras_internals).

Importing this package imports Keras, which fixes its backend at its first import: everything
below the engine line (meshfit.parallel, and the modules of data, run, serve and commands that
run before connect()) imports nothing from here at its top.
"""

import os

from meshfit.parallel import engine

# The package is the engine line: importing any module of fit/ loads Keras, on the backend
# meshfit.connect() chose (engine.activate set it); TensorFlow's load notices are dropped, and in
# meshfit's own processes Keras' optional imports that no command uses are left out.
with engine.tensorflow_notices_dropped(os.environ.get("KERAS_BACKEND") == "tensorflow"), \
        engine.imports_skipped(engine.keras_extras_skipped()):
    import keras

from meshfit.fit import keras_internals  # noqa: E402 (Keras first, on the engine chosen)

if keras.backend.backend() == "jax":
    # Before anything seeds Keras (hosts.agree_on_seed seeds every process of a job as it
    # connects, before meshfit's hooks are installed): on JAX, Keras seeds and recognises
    # TensorFlow only once something has loaded it (keras_internals says why).
    keras_internals.tensorflow_counted_once_loaded()


def __getattr__(name: str):  # a module of this package, imported when first named
    return engine.submodule(__name__, name)
