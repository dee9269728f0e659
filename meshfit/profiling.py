"""`--profile START:STOP`: a profiler trace of global train steps START to STOP.

`profiling_steps` parses the flag (no Keras import, so the CLI can check it before choosing the
engine). `Profile` (a Keras callback, made when first used) starts the engine's profiler before
step START and stops it after step STOP:
  JAX         jax.profiler.start_trace / stop_trace, also writing perfetto_trace.json.gz
              (open it at https://ui.perfetto.dev);
  TensorFlow  tf.profiler.experimental.start / stop.
Both write RUN/tensorboard/plugins/profile/<time>/<host>.xplane.pb, which TensorBoard's profile tab
(the tensorboard-plugin-profile package) reads. Steps count from 1 since the run began, as in
checkpoint names; profile a few steps after the first (whose compilation would dominate).
"""

from __future__ import annotations

import re
import warnings

from meshfit.errors import MeshfitError


def profiling_steps(text: str | None) -> tuple[int, int] | None:
    """(START, STOP) global train steps from "START:STOP" (0 < START < STOP), or None for None."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(text))
    start, stop = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if not 0 < start < stop:
        raise MeshfitError(f"--profile {text!r} is not understood; give the first and last train "
                           "step to trace as START:STOP with 0 < START < STOP, e.g. --profile 10:20")
    return start, stop


def _start(logdir: str) -> None:
    """Start the engine's profiler, tracing into `logdir`."""
    import keras

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
    import keras

    if keras.backend.backend() == "jax":
        import jax

        from meshfit.report import wait_for_device

        wait_for_device(model)  # steps run asynchronously: the trace must hold the last one
        jax.profiler.stop_trace()
    else:
        import tensorflow as tf

        tf.profiler.experimental.stop()


def _profile_class():
    import keras

    from meshfit.tensorboard_log import global_step

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

    return Profile


def __getattr__(name: str):
    # `Profile` subclasses keras.callbacks.Callback, so it is made on first use: importing this
    # module must not import Keras before the engine is chosen.
    if name == "Profile":
        globals()["Profile"] = _profile_class()
        return globals()["Profile"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
