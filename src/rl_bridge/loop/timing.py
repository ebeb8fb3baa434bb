"""Stage timing: ``time/<stage>_s`` metrics, and the clock queued rollouts start on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["WakeClock", "timed"]


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


class WakeClock(threading.Event):
    """An event set once vLLM woke for requests queued while it slept (``rollout.queue_next_step``),
    holding when the wake began (:attr:`since`, :func:`time.monotonic`): the queued requests'
    timeouts count from it being set, and their generation from :attr:`since`."""

    def __init__(self) -> None:
        super().__init__()
        self.since: float | None = None

    def start(self, since: float) -> None:
        """Set the event; the wake began at ``since`` (:func:`time.monotonic`)."""
        self.since = since
        self.set()
