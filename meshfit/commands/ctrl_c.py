"""Ctrl-C in the command line: at any moment of a command, one line "meshfit: interrupted" and
exit code 130 (`run`), none lost in a callback, none crashing an import (`stops`). meshfit.cli
runs every command inside `run`; training has its own handler (save, then stop).
"""

from __future__ import annotations

import _thread
import contextlib
import importlib.machinery
import os
import signal
import sys
import time
from typing import Callable, Iterator

import meshfit


def run(command: Callable[[], int], ended: Callable[[int], None], process_end: bool = False) -> int:
    """`command()`'s exit code; after a Ctrl-C (at any moment) the line "meshfit: interrupted",
    `ended(130)` (the command's leftovers freed) and 130. process_end: the command is the
    process's own, which ends after it: a Ctrl-C from then on (the atexit handlers, JAX's
    shutdown) ends it at once, with that line and 130 (see _exit_at_once)."""
    global _ending
    with stops(process_end) as handled:
        try:
            code = command()
            if _interrupted and not code:  # its KeyboardInterrupt was swallowed (a library's
                raise KeyboardInterrupt    # `except BaseException`): the command still stops
        except BaseException as error:
            if not (isinstance(error, KeyboardInterrupt) or (_interrupted and _from_interrupt(error))):
                raise
            # First, before any call (where a pending signal's handler runs): from here a second
            # Ctrl-C or a late redelivery raises nothing. One raised here escaped main, and Python
            # ended the process by SIGINT (a parent saw -2, not 130).
            _ending = True
            if handled:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # the process is ending
            print("meshfit: interrupted", file=sys.stderr, flush=True)
            code = 130
            ended(code)
    return code


_interrupted = False  # a SIGINT came while main() ran (its KeyboardInterrupt may have been dropped)


def _from_interrupt(error: BaseException) -> bool:
    """Whether `error` was raised because of a KeyboardInterrupt (its cause or context, at any
    depth): Python 3.11 turns one raised in a class's `__set_name__` (a dataclass field, as Keras'
    import defines JAX's Pallas classes) into "RuntimeError: Error calling __set_name__"."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


_deferred = False  # a SIGINT waits for a compiled module to be loaded
_ending = False  # the command ends on a Ctrl-C: a later SIGINT raises nothing (see run)


def _on_sigint(signum, frame) -> None:
    """Ctrl-C: remembered, and raised as KeyboardInterrupt where the main thread is; not while a
    compiled module is being loaded, where it is delivered again once the module is in
    sys.modules. Raised there (JAX's import: in the Python code jaxlib._jax's C initialisation
    calls, or in importlib just after it), jaxlib._jax failed ("ImportError: Encountered an error
    while initializing the extension") or was dropped, and a later garbage collection crashed
    the process (SIGSEGV)."""
    global _interrupted, _deferred
    _interrupted = True
    if _ending:
        return
    if _in_extension_init(frame or sys._getframe()):
        if not _deferred:
            _deferred = True
            _thread.start_new_thread(_redeliver_after_extension_init, (_thread.get_ident(),))
        return
    raise KeyboardInterrupt


def _in_extension_init(frame) -> bool:
    """Whether `frame` runs inside the loading of a compiled module: from its C initialisation
    until it is in sys.modules (importlib's _load_unlocked), as a module dropped between the two
    leaves jaxlib's C++ state pointing at freed objects."""
    while frame is not None:
        if frame.f_code.co_name in ("_load_unlocked", "module_from_spec", "create_module",
                                    "exec_module"):
            local = frame.f_locals
            loader = getattr(local.get("spec"), "loader", local.get("self"))
            if isinstance(loader, importlib.machinery.ExtensionFileLoader):
                return True
        frame = frame.f_back
    return False


def _redeliver_after_extension_init(main_thread: int) -> None:
    global _deferred
    while _in_extension_init(sys._current_frames().get(main_thread)):
        time.sleep(0.005)
    _deferred = False
    _thread.interrupt_main(signal.SIGINT)


def _exit_at_once(signum, frame) -> None:
    """Ctrl-C once the process's command has returned: its results are written, and Python's own
    handler printed a KeyboardInterrupt traceback from the atexit handler it landed in and ended
    with exit code 0, or (a moment later) was not run at all."""
    print("meshfit: interrupted", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


@contextlib.contextmanager
def stops(process_end: bool = False) -> Iterator[bool]:
    """Inside, every SIGINT ends the command (see run): none is lost in a callback.

    Python raises a signal's KeyboardInterrupt in whatever Python code the main thread runs next;
    when that is a gc callback (JAX's _xla_gc_callback), a weakref callback (importlib's module
    locks) or a __del__, Python prints "Exception ignored ... KeyboardInterrupt" and drops it, and
    the command went on to the end with exit 0. Such a dropped interrupt reaches
    sys.unraisablehook: it is delivered again from there, and lands in the code after the callback.
    Training has its own handler (checkpoints.stop_on_signals: save, then stop) and restores this
    one after. A SIGINT ignored when meshfit started (a background job of a shell) stays ignored.
    Yields whether meshfit handles SIGINT (not outside the main thread, nor where it was ignored);
    once a command has ended on one, SIGINT stays ignored (the process is ending). process_end:
    after the command, SIGINT ends the process at once (_exit_at_once), rather than the handler
    before it coming back.
    """
    global _interrupted, _ending
    _interrupted = _ending = False
    try:
        previous = signal.getsignal(signal.SIGINT)
        if previous is meshfit._ctrl_c_while_starting:  # the process's start (see meshfit/__init__)
            previous = signal.default_int_handler  # restored after: the exit is no start-up
        if previous is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # not the main thread: Python delivers signals to the main thread only
        previous = None
    if previous is not signal.default_int_handler:
        yield False
        return
    hook = sys.unraisablehook

    def unraisable(info) -> None:
        if info.exc_type is not None and issubclass(info.exc_type, KeyboardInterrupt):
            # Delivered again from another thread: the main thread runs the handler at its next
            # check, past this hook and the callback (called here, it would raise in the hook).
            _thread.start_new_thread(_thread.interrupt_main, (signal.SIGINT,))
        else:
            hook(info)

    sys.unraisablehook = unraisable
    try:
        yield True
    finally:
        if signal.getsignal(signal.SIGINT) is _on_sigint:  # else ignored after an interrupt (run)
            signal.signal(signal.SIGINT, _exit_at_once if process_end else previous)
        sys.unraisablehook = hook
