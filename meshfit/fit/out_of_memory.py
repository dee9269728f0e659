"""A device out of memory during training (XLA's RESOURCE_EXHAUSTED, raised at a step's
compilation or allocation, where meshfit's memory plan did not see it coming: an unknown device
memory, another process on the GPU): recognised, and the fixes meshfit has for it, as a note on
JAX's own error in a user's fit, evaluate and predict, and as one line ending `meshfit train`."""

from __future__ import annotations

import contextlib
from typing import Iterator

from meshfit.errors import MeshfitError, troubleshooting

ENTRY = "out-of-device-memory"  # docs/troubleshooting.md


def first_line(error: BaseException) -> str | None:
    """The first line of XLA's out-of-memory message in `error` (up to 200 characters), else None.
    Keras may put its own line first ("Exception encountered when calling ..."). The line must
    speak of memory (GPUs: "Out of memory while trying to allocate", TPUs: "Ran out of memory in
    memory space hbm"): gRPC, which JAX's coordination service speaks, has a RESOURCE_EXHAUSTED
    of its own (a message too large)."""
    text = str(error).strip()
    at = text.find("RESOURCE_EXHAUSTED")
    if at < 0 or at > 200:
        return None
    line = text[at:].splitlines()[0][:200]
    return line if "memory" in line.lower() else None


@contextlib.contextmanager
def noted() -> Iterator[None]:
    """Around a user's fit, evaluate or predict: JAX's out-of-memory error, raised as it is, with
    a note naming meshfit's fixes (printed under the traceback; Python 3.11 on)."""
    try:
        yield
    except Exception as error:
        if first_line(error) is not None and hasattr(error, "add_note"):
            error.add_note("meshfit: the devices ran out of memory: use a smaller batch_size, or "
                           "strategy.fit(..., micro_batches=K) (the same training in K slices per "
                           "device), or meshfit.connect(sharding='fsdp'); meshfit.plan(...) prints "
                           "what a step needs" + troubleshooting(ENTRY))
        raise


def run_error(error: BaseException, run: str) -> MeshfitError | None:
    """`meshfit train`'s one line for a device out of memory in its run `run`, else None."""
    line = first_line(error)
    if line is None:
        return None
    return MeshfitError(f"out of device memory ({line}); its committed checkpoints are intact: "
                        f"continue with a smaller share of each batch per device, meshfit train "
                        f"--resume {run} --micro-batches 2 (the same training; not with batch "
                        "normalization), or train again with a smaller --global-batch or "
                        "--sharding fsdp (meshfit plan prints what fits)", see=ENTRY)
