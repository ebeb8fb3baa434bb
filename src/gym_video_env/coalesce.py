"""Identical chat completions sent to vLLM as one request with ``n`` choices.

GRPO samples each prompt ``G`` times, and each sample is one Gym rollout: the group's first turns
reach the model server as ``G`` identical chat completions within milliseconds. vLLM then loads
the clip, hashes it, looks its processed form up and renders the prompt ``G`` times in its one
API-server process, and answers ``G`` HTTP responses. :class:`CoalescingClient` holds the first
of identical requests for ``window_s``; those that arrive meanwhile (up to ``max_n``) go out as one
request with ``n`` set to their count, and each caller gets a response holding one of the
choices, as if it had asked alone. vLLM samples the ``n`` choices independently, so each
caller's sample is distributed as before; only the calls to vLLM are fewer.

Requests that already ask for several choices, carry a ``seed`` (one seed gives one sample) or
stream pass through, and so do a conversation's later turns (a request holding an assistant
message): a sample's history is rarely another's, and holding every later turn for the window
would delay each turn of a multi-turn rollout. A failed request fails each of its callers with the
same error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CoalescingClient", "split_choices"]


@dataclass
class _Batch:
    body: dict[str, Any]
    waiters: list[asyncio.Future[dict[str, Any]]] = field(default_factory=list)
    sent: bool = False


class CoalescingClient:
    """Wraps a client's ``create_chat_completion``; every other attribute is the wrapped client's.

    Args:
        client: Gym's OpenAI client of one vLLM server (``NeMoGymAsyncOpenAI``).
        window_s: how long the first of identical requests waits for others; > 0.
        max_n: most choices in one request (a batch that fills up goes at once).
    """

    def __init__(self, client: Any, *, window_s: float, max_n: int = 64) -> None:
        if window_s <= 0 or max_n < 1:
            raise ValueError(f"CoalescingClient: window_s={window_s} must be > 0 and max_n={max_n} >= 1")
        self._client = client
        self._send: Callable[..., Awaitable[dict[str, Any]]] = client.create_chat_completion
        self.window_s = window_s
        self.max_n = max_n
        self._open: dict[str, _Batch] = {}
        self._in_flight: set[asyncio.Task[None]] = set()  # the loop keeps only weak references
        self.requests_sent = 0
        """Requests sent to vLLM for coalesced bodies (one per batch)."""
        self.requests_coalesced = 0
        """Callers whose request went out in a batch (one or more callers each)."""

    def __getattr__(self, name: str) -> Any:
        if name == "_client":  # not set yet
            raise AttributeError(name)
        return getattr(self._client, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in ("window_s", "max_n", "requests_sent", "requests_coalesced"):
            object.__setattr__(self, name, value)
        else:  # e.g. max_connection_retries: the wrapped client's
            setattr(self._client, name, value)

    async def create_chat_completion(self, **body: Any) -> dict[str, Any]:
        if body.get("n", 1) != 1 or body.get("seed") is not None or body.get("stream") or _later_turn(body):
            return await self._send(**body)
        key = json.dumps(body, sort_keys=True, default=str)
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch(body)
            asyncio.get_running_loop().call_later(self.window_s, self._dispatch, key, batch)
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        batch.waiters.append(waiter)
        if len(batch.waiters) >= self.max_n:
            self._dispatch(key, batch)
        return await waiter

    def _dispatch(self, key: str, batch: _Batch) -> None:
        if batch.sent:
            return
        batch.sent = True
        if self._open.get(key) is batch:
            del self._open[key]
        self.requests_sent += 1
        self.requests_coalesced += len(batch.waiters)
        task = asyncio.get_running_loop().create_task(self._send_batch(batch))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _send_batch(self, batch: _Batch) -> None:
        n = len(batch.waiters)
        try:
            response = await self._send(**({**batch.body, "n": n} if n > 1 else batch.body))
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
