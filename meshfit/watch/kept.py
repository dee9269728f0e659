"""Figures measured once and kept between runs: small JSON files in $XDG_CACHE_HOME/meshfit/
(default ~/.cache/meshfit/), one per kind (peak.json: a CPU's peak FLOP/s, flops.json: a train
step's FLOP count), each a dict from a key naming what was measured to the figure.

Reads never fail (an unreadable file is an empty one); writes replace the file atomically and
are skipped where the folder is not writable, so the figure is measured again next time.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from meshfit import env
from meshfit.errors import MeshfitError
from meshfit.files import atomic_path


def path(name: str) -> str:
    """$XDG_CACHE_HOME/meshfit/NAME.json (default ~/.cache/meshfit/NAME.json)."""
    return os.path.join(env.cache_home(), f"{name}.json")


def read(name: str) -> dict[str, Any]:
    """Every figure kept under NAME ({} when none or unreadable)."""
    try:
        with open(path(name)) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def keep(name: str, key: str, value: Any) -> None:
    """Keep `value` under `key` in NAME, beside the figures already there."""
    kept = read(name)
    kept[key] = value
    # No writable cache: measured again next time.
    with contextlib.suppress(MeshfitError, OSError), atomic_path(path(name), ".json") as tmp, \
            open(tmp, "w") as f:
        json.dump(kept, f, indent=1)
