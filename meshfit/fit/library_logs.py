"""Log lines of the libraries under meshfit that a user cannot act on, dropped, each with its
cause and a reproduction to report upstream.

- grain's "prefetch_buffer_size=8 is smaller than num_threads=16 ..." (absl, a warning): keras-hub
  0.32 reads a task's string inputs through `grain.ReadOptions(prefetch_buffer_size=8)`
  (keras_hub/src/utils/pipeline_model.py, its _READ_AHEAD_BATCHES, chosen to bound the read-ahead)
  and leaves num_threads at grain's default, 16; grain 0.2.18 warns at every such ReadOptions, so
  each fit, evaluate, predict and generate on strings printed it (1-3 times a call, between
  meshfit's lines). Reproduction: `python -c "import grain; grain.ReadOptions(prefetch_buffer_size=8)"`;
  the fix upstream is to pass num_threads=8 with it. Only that pair (8, 16) is dropped: a user's
  own ReadOptions still warns.
"""

from __future__ import annotations

import logging

KERAS_HUB_READ_AHEAD = (8, 16)  # keras-hub's prefetch_buffer_size, grain's default num_threads


def _not_keras_hub_read_ahead(record: logging.LogRecord) -> bool:
    args = record.args if isinstance(record.args, tuple) else ()
    return not (str(record.msg).startswith("prefetch_buffer_size=%s is smaller than num_threads=%s")
                and args[:2] == KERAS_HUB_READ_AHEAD)


def drop() -> None:
    """Drop the lines above from here on (once: a filter added twice is kept once)."""
    logging.getLogger("absl").addFilter(_not_keras_hub_read_ahead)
