"""Identical chat completions sent to vLLM as one request with ``n`` choices.

GRPO samples each prompt ``G`` times, and each sample is one Gym rollout: the group's first turns
reach the model server as ``G`` identical chat completions within milliseconds. vLLM then loads
the clip, hashes it, looks its processed form up and renders the prompt ``G`` times in its one
API-server process, and answers ``G`` HTTP responses. :class:`CoalescingClient` holds the first
of identical requests for ``window_s``; those that arrive meanwhile (up to ``max_n``) go out as one
request with ``n`` set to their count, and each caller gets a response holding one of the
choices, as if it had asked alone. With ``max_wait_s`` the window restarts at each arrival: a
batch goes once no caller has joined it for ``window_s``, and at the latest ``max_wait_s`` after its
first caller, so a group whose samples come in a steady trickle (each queued behind other groups'
work on its way through the Gym servers) still goes whole, while a group that is complete goes at
once either way. vLLM samples the ``n`` choices independently, so each
caller's sample is distributed as before; only the calls to vLLM are fewer.

:meth:`CoalescingClient.stats` counts how batches went out: full (``max_n`` callers, e.g. a whole
GRPO group) or when the window closed, how far apart a batch's callers arrived, and how late the
stragglers came: a batch opened for a body whose earlier batch went out short (within
``late_horizon_s``) is late by the time since that earlier batch's first caller. A group whose
samples arrive further apart than the window reaches vLLM as several requests, each loading and
processing the clip again; the late counts say by how much a window would have had to be longer
(the model server answers them at ``GET /coalescing``).

**Declared groups.** A caller that knows a request is one of ``G`` samples of a group says so in
its ``metadata`` (:func:`group_metadata`: the group's id and ``G``, under
:data:`GROUP_METADATA_KEY`; Gym's model server passes a Responses request's metadata on to the
chat completion). The group's first caller sends it to vLLM at once with ``n = G``, without a
window; the group's later callers take the other choices, waiting for the answer if it has not come
yet. Generation starts when the group's first sample arrives, however far behind the others come
(a rollout client that posts every group's first sample before any second one starts every group
within the time its first samples take). The key is stripped before the request goes to vLLM.
Choices that no caller claims within ``claim_horizon_s`` (a sample that failed before reaching the
model server) are dropped and counted; a caller beyond ``G`` (a retried sample) opens a new
request. A failed request fails the callers that claimed from it; later ones open a new one.

Requests that already ask for several choices, carry a ``seed`` (one seed gives one sample) or
stream pass through, and so do a conversation's later turns (a request holding an assistant
message): a sample's history is rarely another's, and holding every later turn for the window
would delay each turn of a multi-turn rollout. A failed request fails each of its callers with the
same error.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gym_video_env.affinity import without_metadata

__all__ = [
    "GROUP_METADATA_KEY",
    "CoalescingClient",
    "SENDS_KEPT",
    "SPREAD_BOUNDS_S",
    "check_max_wait",
    "group_metadata",
    "merged_stats",
    "split_choices",
    "without_group",
]

logger = logging.getLogger(__name__)

SPREAD_BOUNDS_S = (0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
"""Upper bounds (seconds) of the arrival-spread and lateness buckets in :meth:`CoalescingClient.stats`."""

SENDS_KEPT = 512
"""Batches whose send and answer times :meth:`CoalescingClient.stats` keeps (the latest ones)."""

GROUP_METADATA_KEY = "rollout_group"
"""Request ``metadata`` key declaring a request one sample of a group: ``"<group id>:<size>"``."""


def group_metadata(group: str, size: int) -> dict[str, str]:
    """The ``metadata`` entry that declares a request one of the ``size`` samples of ``group`` (an
    id unique among the groups in flight, without ``:``)."""
    if size < 1 or not group or ":" in group:
        raise ValueError(
            f"group_metadata: group={group!r} must be non-empty without ':' and size={size} >= 1"
        )
    return {GROUP_METADATA_KEY: f"{group}:{size}"}


def without_group(params: Mapping[str, Any]) -> dict[str, Any]:
    """A request's fields (a chat completion's or a Responses request's) without a group
    declaration in its ``metadata``; the ``metadata`` goes too when nothing else is left in it."""
    return without_metadata(params, GROUP_METADATA_KEY)


def _declared_group(body: dict[str, Any]) -> tuple[dict[str, Any], str | None, int]:
    """``body`` without the group declaration, the declaring ``"<id>:<size>"`` (``None``: none)
    and the size (1 without one).

    Raises:
        ValueError: the declaration is not ``"<id>:<size>"`` with a size of at least 1 (the message
            names it); the caller sends the request undeclared and counts it.
    """
    metadata = body.get("metadata")
    if not isinstance(metadata, dict) or GROUP_METADATA_KEY not in metadata:
        return body, None, 1
    declared = metadata[GROUP_METADATA_KEY]
    group, _, size = str(declared).rpartition(":")
    if not group or not size.isdigit() or int(size) < 1:
        raise ValueError(f"metadata {GROUP_METADATA_KEY}={declared!r} is not '<group id>:<size>' (size >= 1)")
    return without_group(body), declared, int(size)


@dataclass
class _Batch:
    body: dict[str, Any]
    opened: float
    waiters: list[asyncio.Future[dict[str, Any]]] = field(default_factory=list)
    last_arrival: float = 0.0
    sent: bool = False
    timer: asyncio.TimerHandle | None = None
    sent_unix_s: float = 0.0


@dataclass
class _Group:
    """A declared group's request: sent when its first caller came, its choices claimed in order."""

    size: int
    opened: float
    answer: asyncio.Task[list[dict[str, Any]]]
    claimed: int = 0


class CoalescingClient:
    """Wraps a client's ``create_chat_completion``; every other attribute is the wrapped client's.

    Args:
        client: Gym's OpenAI client of one vLLM server (``NeMoGymAsyncOpenAI``).
        window_s: how long the first of identical requests waits for others; 0: no window (only
            declared groups are coalesced, every other request goes alone).
        max_n: most choices in one request (a batch that fills up goes at once; a declared group
            larger than this is sent as several requests).
        max_wait_s: if set (>= ``window_s``), the window restarts at each caller: a batch goes
            ``window_s`` after its last caller, at the latest ``max_wait_s`` after its first.
        late_horizon_s: how long after a short batch's first caller a new batch of the same body
            counts as its stragglers (in ``stats()["late_le_s"]``), not as a new request; at
            least ``max_wait_s`` plus ``window_s``, so a batch sent at its cap still has its
            stragglers counted.
        claim_horizon_s: how long a declared group's unclaimed choices are kept for its callers.
    """

    def __init__(
        self,
        client: Any,
        *,
        window_s: float,
        max_n: int = 64,
        max_wait_s: float | None = None,
        late_horizon_s: float = 2.0,
        claim_horizon_s: float = 60.0,
    ) -> None:
        if window_s < 0 or max_n < 1 or not claim_horizon_s > 0:
            raise ValueError(
                f"CoalescingClient: window_s={window_s} must be >= 0, max_n={max_n} >= 1 and "
                f"claim_horizon_s={claim_horizon_s} > 0"
            )
        if max_wait_s is not None and not max_wait_s >= window_s > 0:
            raise ValueError(
                f"CoalescingClient: max_wait_s={max_wait_s} needs a window_s above 0 and at most it "
                f"(it is {window_s})"
            )
        self._client = client
        self._send: Callable[..., Awaitable[dict[str, Any]]] = client.create_chat_completion
        self.window_s = window_s
        self.max_n = max_n
        self.max_wait_s = max_wait_s
        self._open: dict[str, _Batch] = {}
        self._in_flight: set[asyncio.Task[None]] = set()  # the loop keeps only weak references
        self.requests_sent = 0
        """Requests sent to vLLM for coalesced bodies (one per batch)."""
        self.requests_coalesced = 0
        """Callers whose request went out in a batch (one or more callers each)."""
        self._full_batches = 0
        self._spread_sum_s = 0.0
        self._spread_counts = [0] * (len(SPREAD_BOUNDS_S) + 1)
        self.late_horizon_s = max(late_horizon_s, (max_wait_s or 0.0) + window_s)
        self._short: dict[str, float] = {}  # body -> first caller of its batch that went out short
        self._late_counts = [0] * (len(SPREAD_BOUNDS_S) + 1)
        self._sends: deque[tuple[float, float, int]] = deque(maxlen=SENDS_KEPT)
        self.claim_horizon_s = claim_horizon_s
        self._groups: dict[str, _Group] = {}  # declared group's body -> its open request
        self._group_requests = 0
        self._group_callers = 0
        self._unclaimed = 0
        self._malformed = 0

    def __getattr__(self, name: str) -> Any:
        if name == "_client":  # not set yet
            raise AttributeError(name)
        return getattr(self._client, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in (
            "window_s",
            "max_n",
            "max_wait_s",
            "late_horizon_s",
            "claim_horizon_s",
            "requests_sent",
            "requests_coalesced",
        ):
            object.__setattr__(self, name, value)
        else:  # e.g. max_connection_retries: the wrapped client's
            setattr(self._client, name, value)

    async def create_chat_completion(self, **body: Any) -> dict[str, Any]:
        try:
            body, group, size = _declared_group(body)
        except ValueError as error:  # the sample goes on undeclared: counted, and said once
            if not self._malformed:
                logger.warning("%s: such requests go to vLLM undeclared (counted in stats)", error)
            self._malformed += 1
            body, group, size = without_group(body), None, 1
        if body.get("n", 1) != 1 or body.get("seed") is not None or body.get("stream") or _later_turn(body):
            return await self._send(**body)
        if group is not None and size > 1:
            key = f"{group}\n{json.dumps(body, sort_keys=True, default=str)}"
            return await self._claim(key, body, min(size, self.max_n))
        if self.window_s == 0:
            return await self._send(**body)
        key = json.dumps(body, sort_keys=True, default=str)
        loop = asyncio.get_running_loop()
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch(body, opened=loop.time())
            batch.timer = loop.call_later(self.window_s, self._dispatch, key, batch)
            first = self._short.get(key)
            if first is not None and batch.opened - first <= self.late_horizon_s:
                self._late_counts[bisect.bisect_left(SPREAD_BOUNDS_S, batch.opened - first)] += 1
        waiter: asyncio.Future[dict[str, Any]] = loop.create_future()
        batch.waiters.append(waiter)
        batch.last_arrival = loop.time()
        if len(batch.waiters) >= self.max_n:
            self._dispatch(key, batch)
        elif self.max_wait_s is not None and len(batch.waiters) > 1:  # the window restarts
            assert batch.timer is not None
            batch.timer.cancel()
            deadline = min(batch.last_arrival + self.window_s, batch.opened + self.max_wait_s)
            batch.timer = loop.call_at(deadline, self._dispatch, key, batch)
        return await waiter

    async def _claim(self, key: str, body: dict[str, Any], size: int) -> dict[str, Any]:
        """A declared group's next choice: from its open request, or from one sent now with
        ``n = size`` (see the module docstring)."""
        loop = asyncio.get_running_loop()
        group = self._groups.get(key)
        if group is None:
            self._drop_stale_groups(loop.time())
            group = self._groups[key] = _Group(
                size, loop.time(), loop.create_task(self._send_group(body, size))
            )
            group.answer.add_done_callback(lambda answer: self._forget_failed(key, group, answer))
            self._group_requests += 1
        index = group.claimed
        group.claimed += 1
        self._group_callers += 1
        if group.claimed >= group.size:
            del self._groups[key]
        # Shielded: a caller that goes away (its client disconnected) leaves the request to the others.
        return (await asyncio.shield(group.answer))[index]

    async def _send_group(self, body: dict[str, Any], size: int) -> list[dict[str, Any]]:
        sent = time.time()
        try:
            response = await self._send(**{**body, "n": size})
        finally:
            self._sends.append((sent, time.time(), size))
        return split_choices(response, size)

    def _forget_failed(self, key: str, group: _Group, answer: asyncio.Task[Any]) -> None:
        """After a group's request failed, its later callers open a new one."""
        if (answer.cancelled() or answer.exception() is not None) and self._groups.get(key) is group:
            del self._groups[key]

    def _drop_stale_groups(self, now: float) -> None:
        """Forget the groups opened more than ``claim_horizon_s`` ago, counting their unclaimed choices."""
        for key in [k for k, g in self._groups.items() if now - g.opened > self.claim_horizon_s]:
            group = self._groups.pop(key)
            self._unclaimed += group.size - group.claimed

    def _dispatch(self, key: str, batch: _Batch) -> None:
        if batch.sent:
            return
        batch.sent = True
        if batch.timer is not None:
            batch.timer.cancel()
        if self._open.get(key) is batch:
            del self._open[key]
        self.requests_sent += 1
        self.requests_coalesced += len(batch.waiters)
        self._full_batches += len(batch.waiters) >= self.max_n
        spread = max(0.0, batch.last_arrival - batch.opened)
        self._spread_sum_s += spread
        self._spread_counts[bisect.bisect_left(SPREAD_BOUNDS_S, spread)] += 1
        self._track_short(key, batch)
        batch.sent_unix_s = time.time()
        task = asyncio.get_running_loop().create_task(self._send_batch(batch))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    def _track_short(self, key: str, batch: _Batch) -> None:
        """Remember when a short batch's body was first asked for; forget bodies past the horizon
        (the table holds the bodies of the last ``late_horizon_s`` only)."""
        now = batch.opened
        for stale in [k for k, first in self._short.items() if now - first > self.late_horizon_s]:
            del self._short[stale]
        if len(batch.waiters) >= self.max_n:
            self._short.pop(key, None)
        else:
            self._short.setdefault(key, batch.opened)

    def stats(self) -> dict[str, Any]:
        """Counters since the client was made (monotonic: take differences around a batch).

        ``requests_sent``: requests sent for coalesced bodies; ``callers``: the callers they
        answered; ``full``: of the requests, those sent with ``max_n`` callers, the others went
        when the window closed (or ``max_wait_s`` ran out); ``arrival_spread_s_sum``: over the
        requests, the time from a batch's first caller to its last; ``arrival_spread_le_s``:
        requests per spread bucket, keyed by the bucket's upper bound in seconds (``"inf"`` the
        last); ``late_le_s``: batches opened for a body whose earlier batch went out short, by
        their first caller's delay after that batch's first caller (same buckets; within
        ``late_horizon_s``); ``sends``: for the last :data:`SENDS_KEPT` answered batches, in the
        order they were answered, ``[sent, answered, callers]`` with both times in seconds since
        the epoch (``time.time()``, comparable with another process's on the host): when each
        request went to vLLM and when its answer (or failure) came back (declared groups' too);
        ``group_requests``, ``group_callers``: requests sent for declared groups and the callers
        they answered; ``group_choices_unclaimed``: choices of declared groups that no caller
        claimed within ``claim_horizon_s`` (generated for nothing); ``group_declarations_malformed``:
        requests whose declaration was not ``"<group id>:<size>"``, sent undeclared.
        """
        bounds = [*(f"{bound:g}" for bound in SPREAD_BOUNDS_S), "inf"]
        return {
            "requests_sent": self.requests_sent,
            "callers": self.requests_coalesced,
            "full": self._full_batches,
            "arrival_spread_s_sum": self._spread_sum_s,
            "arrival_spread_le_s": dict(zip(bounds, self._spread_counts, strict=True)),
            "late_le_s": dict(zip(bounds, self._late_counts, strict=True)),
            "sends": [list(send) for send in self._sends],
            "group_requests": self._group_requests,
            "group_callers": self._group_callers,
            "group_choices_unclaimed": self._unclaimed,
            "group_declarations_malformed": self._malformed,
        }

    async def _send_batch(self, batch: _Batch) -> None:
        n = len(batch.waiters)
        try:
            try:
                response = await self._send(**({**batch.body, "n": n} if n > 1 else batch.body))
            finally:
                self._sends.append((batch.sent_unix_s, time.time(), n))
            parts = split_choices(response, n) if n > 1 else [response]
        except BaseException as error:  # noqa: BLE001 (each caller gets the batch's failure)
            for waiter in batch.waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        for waiter, part in zip(batch.waiters, parts, strict=True):
            if not waiter.done():
                waiter.set_result(part)


def check_max_wait(window_ms: float, max_wait_ms: float, *, prefix: str = "") -> None:
    """Refuse a cap (``coalesce_max_wait_ms``, 0: none) without a window or below it; ``prefix``
    names the settings' section in the message (``"rollout."``).

    Raises:
        ValueError: naming both settings.
    """
    if max_wait_ms and not max_wait_ms >= window_ms > 0:
        raise ValueError(
            f"{prefix}coalesce_max_wait_ms={max_wait_ms:g} needs {prefix}coalesce_window_ms above 0 "
            f"and at most it (it is {window_ms:g})"
        )


def merged_stats(stats: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Several :meth:`CoalescingClient.stats` (several vLLM servers, several model-server
    replicas) as one: counts and bucket counts added, flags true if any is, lists (``sends``)
    joined and sorted (by send time)."""
    total: dict[str, Any] = {}
    for one in stats:
        for key, value in one.items():
            if isinstance(value, list):
                total[key] = sorted([*total.get(key, []), *value])
            elif isinstance(value, Mapping):
                bucket = total.setdefault(key, {})
                for bound, count in value.items():
                    bucket[bound] = bucket.get(bound, 0) + count
            elif isinstance(value, bool):
                total[key] = total.get(key, False) or value
            else:
                total[key] = total.get(key, 0) + value
    return total


def _later_turn(body: dict[str, Any]) -> bool:
    """Whether the chat completion continues a conversation (holds an assistant message)."""
    return any(
        isinstance(message, dict) and message.get("role") == "assistant"
        for message in body.get("messages") or ()
    )


def split_choices(response: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """A chat completion with ``n`` choices as ``n`` completions of one choice each (index 0, the
    id suffixed with the choice's index, the usage of that choice: the prompt once, its own
    generated tokens).

    Raises:
        ValueError: the response does not hold exactly ``n`` choices.
    """
    choices = sorted(response.get("choices") or [], key=lambda choice: choice.get("index", 0))
    if len(choices) != n:
        raise ValueError(f"asked vLLM for {n} choices, got {len(choices)}")
    usage = response.get("usage") or {}
    prompt_tokens = usage.get("prompt_tokens")
    parts = []
    for index, choice in enumerate(choices):
        part = {
            **response,
            "id": f"{response.get('id', 'chatcmpl')}-{index}",
            "choices": [{**choice, "index": 0}],
        }
        if usage:
            generated = _generated_tokens(choice)
            if generated is None:
                generated = round((usage.get("completion_tokens") or 0) / n)
            part["usage"] = {
                **usage,
                "completion_tokens": generated,
                "total_tokens": (prompt_tokens or 0) + generated,
            }
        parts.append(part)
    return parts


def _generated_tokens(choice: dict[str, Any]) -> int | None:
    """Tokens one choice generated, from its token ids or its logprobs; ``None`` if it has neither."""
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    content = (choice.get("logprobs") or {}).get("content")
    return len(content) if isinstance(content, list) else None
