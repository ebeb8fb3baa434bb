"""Rollout collection from a Gym agent's ``/run`` endpoint: concurrent, bounded, retried, accounted.

:func:`collect_rollouts` posts every row to ``<agent>/run`` with at most ``max_in_flight`` requests
open at a time. Each row ends in exactly one of four states, so a step's metrics account for every
row (``rollout/rows == rollout/ok + rollout/policy_fault + rollout/content_failed +
rollout/infra_failed``):

- ``ok``: the agent answered 200 with a JSON object (its ``reward``, ``response`` and the row);
- ``policy_fault``: the same, but the agent reports that the policy made the episode fail
  (``"policy_fault": reason`` in its answer, e.g. ``video_tools_agent``'s ``context_overflow``):
  the answer's reward is the failure reward and the trajectory so far is trained with it, like any
  other scored rollout. A malformed tool call or a missing answer is not a fault of this kind:
  the agent passes the error back to the model and the verifier scores the answer;
- ``content_failed``: the agent refused the row itself (HTTP 4xx, or a 200 without a numeric
  ``reward``), or an inner server did: Gym's agents answer HTTP 500 for any failed inner call and
  quote the inner answer, so a 5xx that quotes an OpenAI-style client error (``invalid_request_error``,
  as the model server's media refusals, or ``BadRequestError``) is the row's fault too. Retrying
  cannot help; the row is masked;
- ``infra_failed``: connection errors, timeouts and HTTP 5xx persisted through ``max_attempts``
  dispatches. Each failed attempt is re-dispatched after a backoff; a row that still fails is
  masked.

With a ``supervisor`` (e.g. a :class:`~rl_bridge.services.supervisor.ServiceSupervisor` of the vLLM
server behind the agent), every infrastructure failure first asks it to make sure its server is
healthy, restarting it if it died; that call blocks while a restart runs. A row whose failure came
with a restart (the server's generation changed since the row was dispatched) is re-dispatched
without using one of its ``max_attempts``: the row was fine, the server was not. Unless the row
itself kills the server: the supervisor counts the restarts each prompt was in flight for
(:meth:`~rl_bridge.services.supervisor.ServiceSupervisor.dispatch`, keyed by :func:`prompt_key`),
dispatches a prompt with ``crash_budget`` of them alone, and convicts it if the server dies then;
a convicted prompt's rows end ``content_failed`` with that reason (``crashed_server``), now and in
later calls, and the run goes on. Each row still ends exactly once, in one result.

The requests go out from one asyncio event loop (aiohttp, one connection pool) on a thread of
its own, while the caller's thread collects the results: a batch's 128 rollouts cost the client
a few milliseconds of CPU each way instead of a thread and a ``requests`` session per row, whose
start-up and parsing under the GIL delayed the batch's first and last requests. The supervisor's
calls, which block (a restart, a suspect holding the server alone), run on a thread pool of
``max_in_flight`` threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import aiohttp
import pydantic_core

from gym_video_env.affinity import MODEL_REPLICA_KEY, pick
from gym_video_env.coalesce import without_group
from rl_bridge.services.supervisor import Dispatch, InputCrashedServer

__all__ = [
    "ROLLOUT_OUTCOMES",
    "RolloutOutcome",
    "RolloutResult",
    "RolloutSettings",
    "RolloutStats",
    "ServerGuard",
    "collect_rollouts",
    "prompt_key",
    "spread_prompts",
]

RolloutOutcome = Literal["ok", "policy_fault", "content_failed", "infra_failed"]
ROLLOUT_OUTCOMES: tuple[RolloutOutcome, ...] = ("ok", "policy_fault", "content_failed", "infra_failed")


class ServerGuard(Protocol):
    """Keeps a server behind the agent healthy (:class:`rl_bridge.services.supervisor.ServiceSupervisor`)."""

    @property
    def generation(self) -> int:
        """Restarts so far (0 for the first launch)."""
        ...

    def ensure_healthy(self) -> int:
        """Block until the server is healthy, restarting it if it is down; return its generation.
        Raises ``rl_bridge.services.process.ServiceError`` when it cannot be brought back."""
        ...

    def dispatch(self, key: str) -> contextlib.AbstractContextManager[Dispatch]:
        """Hold while a request for input ``key`` is in flight (alone when it is a suspect); raises
        :class:`~rl_bridge.services.supervisor.InputCrashedServer` for a convicted input."""
        ...

    def restarted_under(self, dispatch: Dispatch) -> bool:
        """After a failed request: was the server restarted under it? Raises
        :class:`~rl_bridge.services.supervisor.InputCrashedServer` when that convicts its input."""
        ...


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
    spread_group_samples: bool = False
    """With several agent replicas, deal each prompt's rows over them in dispatch order, starting at
    the prompt's replica, each row naming that replica's model server
    (``gym_video_env.affinity.MODEL_REPLICA_KEY``), so the group still meets in one model server
    while its samples' agent and verifier work runs in several processes. ``False``: all of a
    prompt's rows go to its replica."""

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
    """Dispatches counted against ``max_attempts`` (1 when the first answer was final)."""
    redispatches: int = 0
    """Further dispatches after the supervised server was restarted under the row (not counted
    in ``attempts``)."""
    result: dict[str, Any] | None = None
    """The agent's answer when ``outcome`` is ``"ok"`` or ``"policy_fault"``, else ``None``."""
    error: str | None = None
    """The last failure (status and body, or the exception), when not ``ok``."""
    crashed_server: bool = False
    """``content_failed`` because the row's prompt was convicted of killing the server."""

    @property
    def reward(self) -> float | None:
        """The agent's reward when the rollout was scored (``ok`` or ``policy_fault``), else ``None``."""
        return None if self.result is None else float(self.result["reward"])

    @property
    def mask_reason(self) -> str:
        """Why the trainer masks the row when it has no result: ``rollout_crashed_server`` for a
        prompt convicted of killing the server, else ``rollout_<outcome>``."""
        return "rollout_crashed_server" if self.crashed_server else f"rollout_{self.outcome}"

    @property
    def policy_fault(self) -> str | None:
        """The reason the agent gave for a ``policy_fault`` rollout, else ``None``."""
        return None if self.result is None else self.result.get("policy_fault")


@dataclass
class RolloutStats:
    """Counts over one :func:`collect_rollouts` call."""

    rows: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    """Re-dispatches after infrastructure errors, counted against ``max_attempts`` (all rows)."""
    redispatches: int = 0
    """Re-dispatches after a restart of the supervised server (all rows)."""
    server_restarts: int = 0
    """Restarts of the supervised server during the call."""
    crashed_server: int = 0
    """Rows masked because their prompt kills the server (among ``content_failed``)."""
    wall_s: float = 0.0
    started_at: float = 0.0
    """When the call started (``time.time()``)."""

    @classmethod
    def combined(cls, calls: Sequence[RolloutStats], *, concurrent: bool = False) -> RolloutStats:
        """The counts of several calls together. Calls made one after the other add up their
        restarts and seconds; ``concurrent`` calls (the async collector's groups) overlap, so a
        restart is counted once (the most any call saw) and the seconds are the span from the first
        start to the last end."""
        total = cls(started_at=min((c.started_at for c in calls), default=0.0))
        for call in calls:
            total.rows += call.rows
            total.outcomes.update(call.outcomes)
            total.retries += call.retries
            total.redispatches += call.redispatches
            total.crashed_server += call.crashed_server
        if concurrent:
            total.server_restarts = max((c.server_restarts for c in calls), default=0)
            ends = [c.started_at + c.wall_s for c in calls]
            total.wall_s = max(ends, default=total.started_at) - total.started_at
        else:
            total.server_restarts = sum(c.server_restarts for c in calls)
            total.wall_s = sum(c.wall_s for c in calls)
        return total

    def as_dict(self) -> dict[str, float]:
        """``rollout/rows``, ``rollout/ok``, ``rollout/policy_fault``, ``rollout/content_failed``,
        ``rollout/infra_failed``, ``rollout/retries``, ``rollout/redispatches``,
        ``rollout/server_restarts``, ``rollout/crashed_server``, ``rollout/wall_s``."""
        return {
            "rollout/rows": float(self.rows),
            **{f"rollout/{name}": float(self.outcomes[name]) for name in ROLLOUT_OUTCOMES},
            "rollout/retries": float(self.retries),
            "rollout/redispatches": float(self.redispatches),
            "rollout/server_restarts": float(self.server_restarts),
            "rollout/crashed_server": float(self.crashed_server),
            "rollout/wall_s": self.wall_s,
        }


# Error types of an inner server's client-error answer, as quoted in a Gym agent's HTTP 500 body.
_INNER_CLIENT_ERROR_MARKERS = ("invalid_request_error", "BadRequestError")


class _InfraError(Exception):
    """A failure worth re-dispatching (the row itself may be fine)."""


class _ContentError(Exception):
    """A failure caused by the row; re-dispatching gives the same answer."""


def prompt_key(row: Mapping[str, Any]) -> str:
    """What identifies a row's input for the server: a digest of its ``responses_create_params``
    without the sampling settings and the group declaration (the G samples of a prompt share it,
    and so do its groups in different steps)."""
    params = without_group(row.get("responses_create_params") or row)
    for name in ("temperature", "top_p", "max_output_tokens", "seed"):
        params.pop(name, None)
    encoded = json.dumps(params, sort_keys=True, default=str).encode()
    return hashlib.blake2b(encoded, digest_size=12).hexdigest()


def _naming_replica(row: Mapping[str, Any], replica: int) -> dict[str, Any]:
    """``row`` with its request naming model-server replica ``replica`` in its ``metadata``."""
    params = dict(row.get("responses_create_params") or {})
    params["metadata"] = {**(params.get("metadata") or {}), MODEL_REPLICA_KEY: str(replica)}
    return {**row, "responses_create_params": params}


def spread_prompts(keys: Sequence[str], n: int) -> dict[str, int]:
    """A replica in ``range(n)`` for each distinct prompt key, dealt out in the order the keys first
    come: the first prompt to the replica its key picks (:func:`gym_video_env.affinity.pick`), each
    next one to the next replica. A call's groups are balanced over the replicas, where hashing
    each would leave one replica with 6 of 16 groups over 4 replicas in a typical batch, and a
    group's samples queue behind the others' in each server of its replica; a call with one prompt
    (the async loop's) goes where its key picks."""
    replicas: dict[str, int] = {}
    first = pick(keys[0], n) if keys else 0
    for key in keys:
        if key not in replicas:
            replicas[key] = (first + len(replicas)) % n
    return replicas


def _excerpt(text: str, head: int = 200, tail: int = 600) -> str:
    """``text`` shortened to its start and its end: a Gym agent's error quotes the inner server's
    answer, whose reason comes last."""
    return text if len(text) <= head + tail else f"{text[:head]} ... {text[-tail:]}"


@contextlib.asynccontextmanager
async def _dispatched(
    supervisor: ServerGuard | None, key: str, blocking: ThreadPoolExecutor | None
) -> AsyncIterator[Dispatch | None]:
    """The supervisor's hold on the server for one request of input ``key`` (none without one),
    entered and left on ``blocking``'s threads: both may wait (a suspect holds the server alone)."""
    if supervisor is None:
        yield None
        return
    loop = asyncio.get_running_loop()
    hold = supervisor.dispatch(key)
    held = await loop.run_in_executor(blocking, hold.__enter__)
    try:
        yield held
    except BaseException as error:
        if not await loop.run_in_executor(blocking, hold.__exit__, type(error), error, error.__traceback__):
            raise
    else:
        await loop.run_in_executor(blocking, hold.__exit__, None, None, None)


async def _run_once(session: aiohttp.ClientSession, url: str, row: Mapping[str, Any]) -> dict[str, Any]:
    try:
        async with session.post(url, json=row) as response:
            status, payload = response.status, await response.read()
    except (aiohttp.ClientError, TimeoutError) as error:
        raise _InfraError(f"{type(error).__name__}: {error}") from error
    if status == 200:
        # Parsed in Rust (pydantic's parser; floats as json.loads reads them): a batch's answers
        # come back within a few decode steps of each other, and they are parsed one after
        # another in this thread.
        try:
            body = pydantic_core.from_json(payload)
        except ValueError as error:
            text = payload.decode(errors="replace")
            raise _InfraError(f"HTTP 200 with a body that is not JSON: {text[:200]!r}") from error
        reward = body.get("reward") if isinstance(body, dict) else None
        if not isinstance(reward, (int, float)) or isinstance(reward, bool):
            raise _ContentError(f"answer without a numeric reward: {str(body)[:500]}")
        return body
    text = payload.decode(errors="replace")
    if status >= 500:
        if any(marker in text for marker in _INNER_CLIENT_ERROR_MARKERS):
            raise _ContentError(f"HTTP {status}, an inner client error: {_excerpt(text)}")
        raise _InfraError(f"HTTP {status}: {_excerpt(text)}")
    raise _ContentError(f"HTTP {status}: {_excerpt(text)}")


async def _clock_started(clock: threading.Event) -> None:
    """Returns once ``clock`` is set (polled: a wait of seconds to minutes, read to 50 ms)."""
    while not clock.is_set():
        await asyncio.sleep(0.05)


async def _answer_within(
    answer: Awaitable[dict[str, Any]], timeout_s: float, clock: asyncio.Task[None]
) -> dict[str, Any]:
    """``answer``, allowed ``timeout_s`` seconds from when ``clock`` finishes (from now if it has).

    Raises:
        _InfraError: no answer within that time (the request is cancelled).
    """
    request = asyncio.ensure_future(answer)
    try:
        if not clock.done():
            await asyncio.wait((request, clock), return_when=asyncio.FIRST_COMPLETED)
        return await asyncio.wait_for(request, timeout_s)
    except TimeoutError as error:
        raise _InfraError(f"TimeoutError: no answer within {timeout_s:g} s of vLLM's wake") from error
    finally:
        request.cancel()


def collect_rollouts(
    agent_url: str | Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    settings: RolloutSettings | None = None,
    *,
    supervisor: ServerGuard | None = None,
    on_done: Callable[[RolloutResult], None] | None = None,
    order: Sequence[int] | None = None,
    clock: threading.Event | None = None,
) -> tuple[list[RolloutResult], RolloutStats]:
    """Run every row through ``<agent_url>/run``; see the module docstring for the outcomes.

    Args:
        agent_url: the agent server's base URL, e.g. ``http://127.0.0.1:8123``, or its replicas'
            (``rollout.gym_workers``): the call's prompts are dealt out over them in dispatch order
            (:func:`spread_prompts`), so a group's samples (and a row's retries) all go to one and
            the groups are balanced.
        rows: Gym rows (``responses_create_params`` plus the verifier's fields), posted as they are.
        settings: dispatch settings; ``None`` means the defaults.
        supervisor: keeps the server behind the agent (vLLM) up; rows in flight when it is
            restarted are re-dispatched. ``None``: infrastructure failures are only retried.
        on_done: called in the caller's thread once per finished row (e.g. to advance a progress bar).
        order: the row indices in the order they are posted (a permutation of the rows);
            ``None``: row order. With ``max_in_flight`` below the row count, the first ones go first.
        clock: for requests sent to a vLLM that holds them (asleep, ``rollout.queue_next_step``):
            each request's ``timeout_s`` counts from when this is set (the loop sets it when vLLM's
            KV cache wakes) instead of from its send, so the time they wait through the policy's
            training is not counted. ``None``: from the send.

    Returns:
        One result per row, in row order, and the call's counts.

    Raises:
        rl_bridge.services.process.ServiceError: the supervisor could not bring its server back;
            rows not yet finished are abandoned (no result is returned).
    """
    settings = settings or RolloutSettings()
    urls = [agent_url] if isinstance(agent_url, str) else list(agent_url)
    if not urls:
        raise ValueError("collect_rollouts: no agent URL")
    run_urls = [url.rstrip("/") + "/run" for url in urls]
    dispatch_order = list(range(len(rows))) if order is None else list(order)
    if sorted(dispatch_order) != list(range(len(rows))):
        raise ValueError(f"collect_rollouts: order must be a permutation of the {len(rows)} row indices")
    keys = [prompt_key(row) for row in rows]
    replicas = spread_prompts([keys[index] for index in dispatch_order], len(run_urls))
    targets = {index: (replicas[keys[index]], rows[index]) for index in dispatch_order}
    if settings.spread_group_samples and len(run_urls) > 1:
        dealt: Counter[str] = Counter()
        for index in dispatch_order:  # a prompt's k-th row to the k-th replica from the prompt's
            key = keys[index]
            replica = (replicas[key] + dealt[key]) % len(run_urls)
            targets[index] = replica, _naming_replica(rows[index], replicas[key])
            dealt[key] += 1
    stats = RolloutStats(rows=len(rows), started_at=time.time())
    started = time.monotonic()
    first_generation = supervisor.generation if supervisor is not None else 0

    async def run(
        index: int,
        session: aiohttp.ClientSession,
        limit: asyncio.Semaphore,
        blocking: ThreadPoolExecutor | None,
    ) -> RolloutResult:
        error = ""
        attempts = redispatches = 0
        key = keys[index]
        replica, row = targets[index]
        url = run_urls[replica]
        loop = asyncio.get_running_loop()
        async with limit:
            while attempts < settings.max_attempts:
                try:
                    async with _dispatched(supervisor, key, blocking) as held:
                        try:
                            if clock_task is None:
                                result = await _run_once(session, url, row)
                            else:
                                result = await _answer_within(
                                    _run_once(session, url, row), settings.timeout_s, clock_task
                                )
                        except _ContentError as failure:
                            error = str(failure)
                            return RolloutResult(
                                index, "content_failed", attempts + 1, redispatches, error=error
                            )
                        except _InfraError as failure:
                            error = str(failure)
                            restarted = held is not None and await loop.run_in_executor(
                                blocking, supervisor.restarted_under, held
                            )
                        else:
                            outcome: RolloutOutcome = "policy_fault" if result.get("policy_fault") else "ok"
                            return RolloutResult(index, outcome, attempts + 1, redispatches, result=result)
                except InputCrashedServer as verdict:
                    error = str(verdict)
                    return RolloutResult(
                        index, "content_failed", attempts + 1, redispatches, error=error, crashed_server=True
                    )
                if restarted:
                    redispatches += 1  # the server was restarted under this row: not the row's fault
                    continue
                attempts += 1
                if attempts < settings.max_attempts:
                    await asyncio.sleep(settings.backoff_s * 2 ** (attempts - 1))
        return RolloutResult(index, "infra_failed", attempts, redispatches, error=error)

    finished: queue.SimpleQueue[RolloutResult | BaseException] = queue.SimpleQueue()
    tasks: list[asyncio.Task[RolloutResult]] = []
    loop = asyncio.new_event_loop()
    clock_task: asyncio.Task[None] | None = None

    def cancel() -> None:
        for task in tasks:
            task.cancel()

    async def run_all() -> None:
        limit = asyncio.Semaphore(settings.max_in_flight)
        blocking = (
            ThreadPoolExecutor(settings.max_in_flight, thread_name_prefix="rollout-guard")
            if supervisor is not None
            else None
        )
        nonlocal clock_task
        connector = aiohttp.TCPConnector(limit=settings.max_in_flight)
        # With a clock, _answer_within times each request from it; the session's own limit is off.
        timeout = aiohttp.ClientTimeout(total=settings.timeout_s if clock is None else None)
        if clock is not None:
            clock_task = asyncio.create_task(_clock_started(clock))
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                tasks.extend(
                    asyncio.create_task(run(index, session, limit, blocking)) for index in dispatch_order
                )
                for next_done in asyncio.as_completed(tasks):
                    finished.put(await next_done)
        except BaseException as failure:  # noqa: BLE001 (the caller's thread raises it)
            finished.put(failure)
            cancel()
        finally:
            if clock_task is not None:
                clock_task.cancel()
            if blocking is not None:
                blocking.shutdown(wait=False, cancel_futures=True)

    thread = threading.Thread(target=loop.run_until_complete, args=(run_all(),), name="rollout", daemon=True)
    results: list[RolloutResult | None] = [None] * len(rows)
    thread.start()
    try:
        for _ in range(len(rows)):
            item = finished.get()
            if isinstance(item, BaseException):
                raise item
            results[item.index] = item
            stats.outcomes[item.outcome] += 1
            stats.retries += item.attempts - 1
            stats.redispatches += item.redispatches
            stats.crashed_server += item.crashed_server
            if on_done is not None:
                on_done(item)
    except BaseException:
        loop.call_soon_threadsafe(cancel)
        raise
    finally:
        thread.join(timeout=None if all(r is not None for r in results) else 5.0)
        if not thread.is_alive():
            loop.close()
    if supervisor is not None:
        stats.server_restarts = supervisor.generation - first_generation
    stats.wall_s = time.monotonic() - started
    return [r for r in results if r is not None], stats
