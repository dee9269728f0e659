"""Checkpoints of the full training state, and exact resume: the `Checkpointer` that saves during
fit and stops training on a signal.

The parts: meshfit.run.checkpoint_format (a checkpoint's folder and files, read back without
Keras), meshfit.run.keras_side.checkpoint_save (writing and committing one, keeping the newest
`keep`), meshfit.run.keras_side.checkpoint_restore (loading one into a model).

`Checkpointer` (a Keras callback) saves every N steps or seconds and at every epoch end (never a
state holding NaN or inf: meshfit.run.keras_side.divergence stops the run instead), and after
a SIGTERM/SIGINT (see `stop_on_signals`) saves at the next step boundary and stops training by
raising `TrainingInterrupted`. It acts in `on_train_batch_begin`, which Keras calls synchronously
without logs, so training pays no per-step host synchronization on JAX.

With `local_every` it also keeps a local copy of the state every N global steps
(meshfit.run.local_copies): each process counts the steps itself, with no vote, and the host's
writer alone copies its own shards off the devices and writes them in a background thread.

In a multi-process job a signal often reaches one process only (a preemption notice, a Ctrl-C on
one host), so the processes vote at every dispatch boundary (`hosts.Vote`, one step behind, so
still without a host sync) and all stop at the same step: every process writes its shards,
process 0 commits, all wait until it has, and all raise `TrainingInterrupted` with the same exit
code.

This module imports Keras at the top: import it after `meshfit.connect()`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import keras

from meshfit.errors import TrainingInterrupted
from meshfit.fit import hosts
from meshfit.parallel import cluster, heartbeat
from meshfit.run import sharded_arrays, spec
from meshfit.run.keras_side import divergence
from meshfit.run.keras_side.checkpoint_restore import check_fits
from meshfit.run.keras_side.checkpoint_save import (PendingSave, begin_save, not_whole_here,
                                                    sync_variables)
from meshfit.run.local_copies import KEEP as LOCAL_KEEP
from meshfit.watch import goodput
from meshfit.watch.keras_side import report


class Checkpointer(keras.callbacks.Callback):
    """Saves the training state into `directory` during fit; stops cleanly on SIGTERM/SIGINT.

    steps_per_epoch: the run's steps per epoch (checkpoints are numbered by global step).
    every_steps / every_seconds: save when the global step reaches a multiple of every_steps (the
    first dispatch boundary at or past it, with several steps per dispatch), or when
    every_seconds have passed since the last save (either, both or neither); always at epoch end
    unless epoch_end=False. keep: how many checkpoints to keep. extra(): JSON data saved with each
    checkpoint (seed, history, settings); extra_arrays(): numpy arrays saved with it (a recipe
    callback's best weights). resume_state: what `restore` returned, when resuming mid-epoch.
    write: False on processes other than 0 (they write their shards only, or nothing with
    sharded=False). sharded: see `begin_save` (default: on JAX). background: save while training
    goes on (the next save, a stop and the end of training wait for it; default: when sharded);
    False: each save is committed before training goes on, as on TensorFlow.
    In a job of several processes a stop requested on any of them stops all at the same step.
    local_every: keep a local copy every N global steps (0: none), written into local_directory
    by the process that has one (its host's writer; None on the others), unless some variable
    is sharded across processes (one line says so at the start of training).
    """

    def __init__(self, directory: str | os.PathLike, steps_per_epoch: int, *,
                 every_steps: int | None = None, every_seconds: float | None = None,
                 epoch_end: bool = True, keep: int = spec.DEFAULT_KEEP_CHECKPOINTS, extra=None,
                 extra_arrays=None, resume_state: dict[str, Any] | None = None, write: bool = True,
                 sharded: bool | None = None, background: bool | None = None,
                 local_every: int = 0, local_directory: str | None = None):
        super().__init__()
        self.directory = os.fspath(directory)
        self.steps_per_epoch = steps_per_epoch
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.epoch_end, self.keep = epoch_end, keep
        self.extra = extra or (lambda: {})
        self.extra_arrays = extra_arrays or (lambda: {})
        self.write = write
        self.sharded, self.background = sharded, background
        self.saving = self.interrupted = False  # see stop_on_signals
        self._pending: PendingSave | None = None
        self.last_saved: str | None = None
        self.stop_signal: int | None = None
        self._resume = resume_state
        self._epoch, self._offset, self._global_step = 0, 0, 0
        self._last_time = time.monotonic()
        self._vote: hosts.Vote | None = None
        self._saves = 0  # saves begun so far
        self._saves_at_cast = 0  # ... when the vote now under way was cast
        self._due = False  # the agreed answer: every_seconds have passed (see agreed_stop)
        self.local_every, self.local_directory = local_every, local_directory
        self._local: PendingSave | None = None
        self._writer: ThreadPoolExecutor | None = None  # the copies' writing thread, kept

    def request_stop(self, signum: int) -> None:
        """Ask training to save and stop at the next step boundary (called by signal handlers)."""
        self.stop_signal = signum

    def save(self, epoch: int, step: int, wait: bool = False) -> str | None:
        """Save now, as the state after `step` steps of epoch `epoch`; with `wait`, return once
        committed. Returns the checkpoint's folder (None on processes other than 0)."""
        self.wait_for_device()  # first: the previous save's write overlaps these steps
        self.wait()
        sync_variables(self.model)
        divergence.check(self.model, epoch * self.steps_per_epoch + step, self.steps_per_epoch,
                         self.directory, self.write)
        self._last_time = time.monotonic()
        self._saves += 1
        self.saving = True  # a Ctrl-C now waits until the write is handed to its threads
        try:
            self._pending = begin_save(self.directory, self.model, epoch=epoch, step=step,
                                       steps_per_epoch=self.steps_per_epoch, extra=self.extra(),
                                       extra_arrays=self.extra_arrays(), keep=self.keep,
                                       sharded=self.sharded, background=self.background,
                                       commit=self.write)
        finally:
            self.saving = False
        if self.interrupted:  # the second signal, held during begin_save
            self.interrupted = False
            raise KeyboardInterrupt
        if wait:
            return self.wait()
        return self._pending.path if self.write else None

    def wait_for_device(self) -> None:
        """Wait for the training steps already dispatched, whose results a save copies. A method
        of its own so that the goodput ledger charges this wait to training, not to the save
        (meshfit.run.keras_side.fit_and_score.charged_to_checkpoint): dispatch is asynchronous,
        so on JAX the first save of a run could otherwise hold many steps' device time."""
        report.wait_for_device(self.model)

    def wait(self) -> str | None:
        """Block until the save in progress (if any) is committed, raising its error; return the
        newest checkpoint saved (None on processes other than 0)."""
        pending = self._pending
        if pending is not None:
            try:
                path = pending.result()
            except KeyboardInterrupt:  # still being written: a later wait waits again
                raise
            except BaseException:
                self._pending = None
                raise
            self._pending = None
            if self.write:
                self.last_saved = path
        return self.last_saved

    def agreed_stop(self, settle: bool = False, due: bool = False) -> int | None:
        """The signal to stop on now, the same on every process of a job; None: go on.

        One process alone: its own stop_signal. Several: the largest signal any process had at
        the previous call (or, with settle, at any call until now); every process calls this at
        the same points of training. due: whether every_seconds have passed on this process's
        clock; `_due` becomes the agreed answer (one process alone: its own; several: any
        process's at the previous call, unless a save began since). A save is a collective: a
        process saving by its own clock while another, whose clock had not yet passed, went on
        to the next step left the job hanging (issue 42's drill, 2 processes on a loaded machine).
        """
        heartbeat.advance()  # progress for meshfit launch's watchdog, before the vote may wait
        if self._vote is None:
            self._due = due
            return self.stop_signal
        packed = self.vote((self.stop_signal or 0) * 2 + int(due), settle)  # signal, due: one max
        saves_then, self._saves_at_cast = self._saves_at_cast, self._saves
        self._due = bool(packed & 1) and saves_then == self._saves
        signum = packed >> 1
        if signum:
            self.stop_signal = signum
        return signum or None

    def vote(self, value: int, settle: bool = False) -> int:
        """Cast this process's `value` in the job's stop vote; the result of the previous cast
        (with settle, the largest of every cast until now). A method of its own so that the
        goodput ledger charges it to train, not to checkpoint
        (meshfit.run.keras_side.fit_and_score.charged_to_checkpoint): reading the previous
        cast's result waits for the training steps dispatched before it (the devices run in
        order), at every step. Charged to checkpoint, that wait made the saves of a 2-process
        job look like 35-44% of its wall time (BENCHMARKS.md section 6); the saves' own work
        was about 0.2 s each."""
        value = self._vote.cast(value)
        if settle:
            value = max(value, self._vote.settle())
        return value

    def local_copy(self, epoch: int, step: int) -> None:
        """Start writing a local copy of the state after `step` steps of epoch `epoch` (the
        writer's; the previous copy is finished first). A copy that cannot be written turns the
        copies off with a warning: the committed checkpoints remain."""
        if self.local_directory is None:
            return
        self.wait_for_device()
        self.wait_local()
        if self.local_directory is None:
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="meshfit-local-copy")
        try:
            self._local = begin_save(self.local_directory, self.model, epoch=epoch, step=step,
                                     steps_per_epoch=self.steps_per_epoch, extra=self.extra(),
                                     extra_arrays=self.extra_arrays(), keep=LOCAL_KEEP,
                                     sharded=False, background=True, writer=self._writer)
        except Exception as e:
            self._local_failed(e)

    def wait_local(self) -> None:
        """Wait until the local copy being written (if any) is committed."""
        pending, self._local = self._local, None
        if pending is not None:
            try:
                pending.result()
            except Exception as e:
                self._local_failed(e)

    def _local_failed(self, error: Exception) -> None:
        warnings.warn(f"no more local copies: {str(error).splitlines()[0]}; the committed "
                      "checkpoints remain", stacklevel=3)
        self.local_directory = None

    def on_train_begin(self, logs=None):
        self._last_time = time.monotonic()
        sharded = not_whole_here(self.model) if self.local_every else None
        if sharded is not None:
            self.local_every, self.local_directory = 0, None
            if self.write:
                print(f"no local copies: {sharded} is sharded across processes (each holds only "
                      "its part); resuming takes the committed checkpoints", flush=True)
        if self._vote is None and cluster.multi_process():
            self._vote = hosts.Vote()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._offset = epoch, 0
        if self._resume is not None and epoch == self._resume["epoch"]:
            self._offset = self._resume["step"]
            values = self._resume["metrics_values"]
            if self._offset and values:  # the interrupted epoch's running totals
                metrics = self.model.metrics_variables
                check_fits(self.directory, "metrics", self._resume["variables"]["metrics"], metrics)
                for v, value in zip(metrics, values):
                    v.assign(value)
            self._resume = None

    def on_train_batch_begin(self, batch, logs=None):
        step = self._offset + batch
        due = bool(self.every_seconds) and time.monotonic() - self._last_time >= self.every_seconds
        if self.agreed_stop(due=due) is not None:
            self._stop(self.save(self._epoch, step, wait=True),
                       self._epoch * self.steps_per_epoch + step)
        global_step = self._epoch * self.steps_per_epoch + step
        previous, self._global_step = self._global_step, global_step
        if not batch:
            return
        # With k steps per dispatch the step advances by k: save when it passes a multiple.
        if (self.every_steps and global_step // self.every_steps > previous // self.every_steps) or \
                self._due:
            self.save(self._epoch, step)
        elif self.local_every and global_step // self.local_every > previous // self.local_every:
            self.local_copy(self._epoch, step)  # not beside a save: that one is newer or as new

    def on_epoch_end(self, epoch, logs=None):
        stop = self.agreed_stop(settle=True) is not None
        if self.epoch_end or stop:
            self.save(epoch + 1, 0)
        if stop:
            self._stop(self.wait(), (epoch + 1) * self.steps_per_epoch)

    def on_train_end(self, logs=None):
        self.wait()
        self.wait_local()
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None

    def _stop(self, path: str | None, global_step: int):
        # Training ends here: Keras' unwinding of fit is no step's time (the epoch's training
        # seconds kept in the checkpoint end at the save, so the goodput ledger's end there too).
        goodput.ledger().switch("other")
        cluster.barrier("meshfit: stop saved")  # no process exits before process 0 has saved
        name = signal.Signals(self.stop_signal).name
        run = os.path.dirname(os.path.abspath(self.directory))
        where = f"saved to {path}" if path else "state saved by process 0"
        raise TrainingInterrupted(
            f"training stopped by {name} after step {global_step}, {where}; continue with: "
            f"meshfit train --resume {run}", self.stop_signal, path)


@contextlib.contextmanager
def stop_on_signals(checkpointer: Checkpointer,
                    signums=(signal.SIGTERM, signal.SIGINT)) -> Iterator[None]:
    """While inside, SIGTERM/SIGINT make `checkpointer` save and stop at the next step boundary.

    A second signal while stopping raises KeyboardInterrupt at once (after finishing the write
    of a checkpoint already begun, which a third signal abandons). Outside the main thread
    (where Python cannot install handlers) this does nothing.
    """
    def handler(signum, frame):
        if checkpointer.stop_signal is not None:
            if checkpointer.saving:  # not inside orbax's own calls: once they have returned
                checkpointer.interrupted = True
                return
            raise KeyboardInterrupt
        checkpointer.request_stop(signum)

    previous = {}
    try:
        for signum in signums:
            previous[signum] = signal.signal(signum, handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield
        checkpointer.wait()
    except KeyboardInterrupt:  # a save being written is finished first (a third signal cuts
        with contextlib.suppress(BaseException):  # it short: the folder stays uncommitted)
            checkpointer.wait()
        if "orbax" in sys.modules:
            sharded_arrays.quiet_after_interrupt()
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            checkpointer.wait()  # commit what was saved before the error
        raise
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
