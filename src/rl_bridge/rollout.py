"""Rollout collection from a Gym agent's ``/run`` endpoint: concurrent, bounded, retried, accounted.

:func:`collect_rollouts` posts every row to ``<agent>/run`` with at most ``max_in_flight`` requests
open at a time. Each row ends in exactly one of three states, so a step's metrics account for every
row (``rollout/rows == rollout/ok + rollout/content_failed + rollout/infra_failed``):

- ``ok``: the agent answered 200 with a JSON object (its ``reward``, ``response`` and the row);
- ``content_failed``: the agent refused the row itself (HTTP 4xx, e.g. a video the model server
  rejects, or a 200 without a numeric ``reward``). Retrying cannot help; the row is masked;
- ``infra_failed``: connection errors, timeouts and HTTP 5xx persisted through ``max_attempts``
  dispatches. Each failed attempt is re-dispatched after a backoff; a row that still fails is
  masked.

Uses threads and ``requests``: the agent does the slow work, the client only waits.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Literal

import requests

__all__ = ["RolloutOutcome", "RolloutResult", "RolloutSettings", "RolloutStats", "collect_rollouts"]

RolloutOutcome = Literal["ok", "content_failed", "infra_failed"]


@dataclass(frozen=True)
class RolloutSettings:
    """How rows are dispatched."""

    max_in_flight: int = 8
    """Most ``/run`` requests open at once."""
    max_attempts: int = 3
    """Dispatches per row for infrastructure errors (1 = no retry)."""
    timeout_s: float = 300.0
    """Longest wait for one ``/run`` answer, seconds."""
    backoff_s: float = 0.5
    """Wait before re-dispatch ``k`` (1-based) is ``backoff_s * 2**(k - 1)`` seconds."""

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.max_attempts < 1:
            raise ValueError(
                f"RolloutSettings: max_in_flight={self.max_in_flight} and max_attempts={self.max_attempts} "
                "must be >= 1"
            )
        if not self.timeout_s > 0 or self.backoff_s < 0:
            raise ValueError(
                f"RolloutSettings: timeout_s={self.timeout_s} must be > 0 and backoff_s={self.backoff_s} >= 0"
            )


@dataclass(frozen=True)
class RolloutResult:
    """What became of one row."""

    index: int
    """Position of the row in the list given to :func:`collect_rollouts`."""
    outcome: RolloutOutcome
    attempts: int
    """Dispatches made (1 when the first answer was final)."""
    result: dict[str, Any] | None = None
    """The agent's answer when ``outcome == "ok"``, else ``None``."""
    error: str | None = None
    """The last failure (status and body, or the exception), when not ``ok``."""

    @property
    def reward(self) -> float | None:
        """The agent's reward when ``ok``, else ``None``."""
        return None if self.result is None else float(self.result["reward"])


@dataclass
class RolloutStats:
    """Counts over one :func:`collect_rollouts` call."""

    rows: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    """Re-dispatches after infrastructure errors (all rows together)."""
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """``rollout/rows``, ``rollout/ok``, ``rollout/content_failed``, ``rollout/infra_failed``,
        ``rollout/retries``, ``rollout/wall_s``."""
        return {
            "rollout/rows": float(self.rows),
            **{f"rollout/{name}": float(self.outcomes[name]) for name in ("ok", "content_failed", "infra_failed")},
            "rollout/retries": float(self.retries),
            "rollout/wall_s": self.wall_s,
        }


class _InfraError(Exception):
    """A failure worth re-dispatching (the row itself may be fine)."""


class _ContentError(Exception):
    """A failure caused by the row; re-dispatching gives the same answer."""


def _run_once(session: requests.Session, url: str, row: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    try:
        response = session.post(url, json=row, timeout=timeout_s)
    except (requests.ConnectionError, requests.Timeout) as error:
        raise _InfraError(f"{type(error).__name__}: {error}") from error
    if response.status_code >= 500:
        raise _InfraError(f"HTTP {response.status_code}: {response.text[:500]}")
    if response.status_code != 200:
        raise _ContentError(f"HTTP {response.status_code}: {response.text[:500]}")
    try:
        body = response.json()
    except ValueError as error:
        raise _InfraError(f"HTTP 200 with a body that is not JSON: {response.text[:200]!r}") from error
    reward = body.get("reward") if isinstance(body, dict) else None
    if not isinstance(reward, (int, float)) or isinstance(reward, bool):
        raise _ContentError(f"answer without a numeric reward: {str(body)[:500]}")
    return body


def collect_rollouts(
    agent_url: str,
    rows: Sequence[Mapping[str, Any]],
    settings: RolloutSettings | None = None,
    *,
    on_done: Callable[[RolloutResult], None] | None = None,
) -> tuple[list[RolloutResult], RolloutStats]:
    """Run every row through ``<agent_url>/run``; see the module docstring for the outcomes.

    Args:
        agent_url: the agent server's base URL, e.g. ``http://127.0.0.1:8123``.
        rows: Gym rows (``responses_create_params`` plus the verifier's fields), posted as they are.
        settings: dispatch settings; ``None`` means the defaults.
        on_done: called in the caller's thread once per finished row (e.g. to advance a progress bar).

    Returns:
        One result per row, in row order, and the call's counts.
    """
    settings = settings or RolloutSettings()
    url = agent_url.rstrip("/") + "/run"
    stats = RolloutStats(rows=len(rows))
    started = time.monotonic()

    def run(index: int) -> RolloutResult:
        error = ""
        with requests.Session() as session:
            for attempt in range(1, settings.max_attempts + 1):
                if attempt > 1:
                    time.sleep(settings.backoff_s * 2 ** (attempt - 2))
                try:
                    return RolloutResult(index, "ok", attempt, result=_run_once(session, url, rows[index], settings.timeout_s))
                except _ContentError as failure:
                    return RolloutResult(index, "content_failed", attempt, error=str(failure))
                except _InfraError as failure:
                    error = str(failure)
        return RolloutResult(index, "infra_failed", settings.max_attempts, error=error)

    results: list[RolloutResult | None] = [None] * len(rows)
    with ThreadPoolExecutor(max_workers=settings.max_in_flight, thread_name_prefix="rollout") as pool:
        futures = [pool.submit(run, index) for index in range(len(rows))]
        for future in as_completed(futures):
            result = future.result()
            results[result.index] = result
            stats.outcomes[result.outcome] += 1
            stats.retries += result.attempts - 1
            if on_done is not None:
                on_done(result)
    stats.wall_s = time.monotonic() - started
    return [r for r in results if r is not None], stats
