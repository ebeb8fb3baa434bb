"""Stage timing: ``time/<stage>_s`` metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["timed"]


@contextmanager
def timed(name: str, timings: dict[str, float], *, add: bool = False) -> Iterator[None]:
    """Record the wall time of the block in ``timings["time/<name>_s"]`` (seconds); ``add``: add it
    to what is there."""
    started = time.monotonic()
    try:
        yield
    finally:
        key = f"time/{name}_s"
        timings[key] = (timings.get(key, 0.0) if add else 0.0) + time.monotonic() - started
