"""`--profile START:STOP`: a profiler trace of global train steps START to STOP.

`meshfit.run.spec.profiling_steps` parses the flag (before the engine is chosen). `Profile`, a Keras
callback, starts the engine's profiler before step START and stops it after step STOP:
  JAX         jax.profiler.start_trace / stop_trace, also writing perfetto_trace.json.gz
              (open it at https://ui.perfetto.dev);
  TensorFlow  tf.profiler.experimental.start / stop.
Both write RUN/tensorboard/plugins/profile/<time>/<host>.xplane.pb, which TensorBoard's profile tab
(the tensorboard-plugin-profile package) reads. Steps count from 1 since the run began, as in
checkpoint names; profile a few steps after the first (whose compilation would dominate).

This module imports Keras at the top: import it after `meshfit.connect()` chose the engine.
"""

from __future__ import annotations

import warnings

import keras

from meshfit.errors import MeshfitError
from meshfit.watch.keras_side.report import wait_for_device
from meshfit.watch.keras_side.tensorboard import global_step


def _start(logdir: str) -> None:
    """Start the engine's profiler, tracing into `logdir`."""
    if keras.backend.backend() == "jax":
        import inspect

        import jax

        perfetto = "create_perfetto_trace" in inspect.signature(jax.profiler.start_trace).parameters
        jax.profiler.start_trace(logdir, **({"create_perfetto_trace": True} if perfetto else {}))
    elif keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.profiler.experimental.start(logdir)
    else:
        raise MeshfitError(f"--profile supports the jax and tensorflow engines, not "
                           f"{keras.backend.backend()}; run without --profile")


def _stop(model) -> None:
    """Wait for the dispatched steps, then stop the profiler and write the trace."""
    if keras.backend.backend() == "jax":
        import jax

        wait_for_device(model)  # steps run asynchronously: the trace must hold the last one
        jax.profiler.stop_trace()
    else:
        import tensorflow as tf

        tf.profiler.experimental.stop()


class Profile(keras.callbacks.Callback):
    """Traces global train steps `start` to `stop` (1-based) into `logdir` (RUN/tensorboard).

    With k steps per dispatch the trace covers whole dispatches around the window.
    steps_per_epoch: the run's, when a resumed fit runs only the end of a cut epoch.
    Acts in on_train_batch_begin, which Keras calls in the training loop without logs.
    """

    def __init__(self, logdir: str, start: int, stop: int, steps_per_epoch: int | None = None):
        super().__init__()
        self.logdir, self.start, self.stop = str(logdir), int(start), int(stop)
        self.steps_per_epoch = steps_per_epoch
        self.running = self.done = False
        self._epoch, self._dispatch, self._steps_done = 0, 1, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._dispatch = max(int(getattr(self.model, "steps_per_execution", 1) or 1), 1)

    def on_train_batch_begin(self, batch, logs=None):
        done = global_step(self._epoch, batch, self.params.get("steps"), self.steps_per_epoch) - 1
        self._steps_done = done
        if self.running and done >= self.stop:
            self._finish()
        elif not self.running and not self.done and done + self._dispatch >= self.start:
            if done >= self.stop:  # resumed after the window
                self.done = True
                return
            _start(self.logdir)
            self.running = True

    def on_epoch_end(self, epoch, logs=None):
        steps = self.params.get("steps") or 1
        self._steps_done = global_step(epoch, steps - 1, steps, self.steps_per_epoch)
        if self.running and self._steps_done >= self.stop:
            self._finish()

    def on_train_end(self, logs=None):
        if self.running:
            self._finish()
        elif not self.done:
            self.done = True
            warnings.warn(f"--profile {self.start}:{self.stop}: training ended after step "
                          f"{self._steps_done}, before step {self.start}; no trace written. "
                          "Choose steps within the run")

    def _finish(self):
        self.running, self.done = False, True
        try:
            _stop(self.model)
        except Exception as e:  # a failed export must not end the training
            warnings.warn(f"--profile: the trace could not be written ({e})")

