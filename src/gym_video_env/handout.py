"""A model server's answers handed to their callers one at a time, each response sent before the next.

A GRPO batch's samples end within a few decode steps of each other, so a model server gets many
of vLLM's answers at once (a coalesced group's ``n`` choices arrive together). Turning an answer
into its Responses API response is synchronous Python (stock Gym's conversion: about 2 ms a
sample on a 2-core box), and the response then crosses the server's middleware over several turns
of the event loop. With every caller ready at once, the loop converts all of them before the
first response's bytes leave, and the agents, verifiers and rollout client downstream start only
when the last one is converted (``benchmarks/model_server_group.py``).

:class:`Handout` gives the answers out in turn: a caller takes its answer once the previous
caller's response was sent (:class:`ResponseSentMiddleware`, the server's outermost middleware,
tells), or ``bound_s`` after the previous caller took its own if that caller still awaits
something else (a ``/tokenize`` call, say). The loop converts no more and no less than before; the
first responses leave earlier, and the work downstream overlaps the rest. Outside a server with the
middleware (a caller with no request), answers are handed out at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any

__all__ = ["Handout", "ResponseSentMiddleware", "on_response_sent"]

_SENT_HOOKS: ContextVar[list[Callable[[], None]] | None] = ContextVar(
    "gym_video_env_sent_hooks", default=None
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


class ResponseSentMiddleware:
    """ASGI middleware: runs the callbacks registered while serving a request
    (:func:`on_response_sent`) once its response's last body part is sent, or when the request ends
    without one (an error, a client gone). Add it last, so that it is the outermost."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hooks: list[Callable[[], None]] = []
        token = _SENT_HOOKS.set(hooks)

        async def sending(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                _run(hooks)

        try:
            await self.app(scope, receive, sending)
        finally:
            _SENT_HOOKS.reset(token)
            _run(hooks)


def _run(hooks: list[Callable[[], None]]) -> None:
    while hooks:
        hooks.pop(0)()


def on_response_sent(callback: Callable[[], None]) -> bool:
    """Run ``callback`` once the current request's response is sent; ``False`` (and not run) when
    no :class:`ResponseSentMiddleware` serves the current request."""
    hooks = _SENT_HOOKS.get()
    if hooks is None:
        return False
    hooks.append(callback)
    return True


class Handout:
    """Callers take their answers in turn (first come, first served); see the module docstring.

    Args:
        bound_s: longest a caller holds the turn after taking it, if its response has not been sent
            by then; 0: no turns, every caller takes its answer at once.
    """

    def __init__(self, bound_s: float = 0.005) -> None:
        if bound_s < 0:
            raise ValueError(f"Handout: bound_s={bound_s} must be >= 0")
        self.bound_s = bound_s
        self._turn: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    async def take(self) -> None:
        """Returns when it is this caller's turn, which lasts until its response is sent (at most
        ``bound_s``); at once without turns or outside a request served with the middleware."""
        if self.bound_s == 0 or _SENT_HOOKS.get() is None:
            return
        loop = asyncio.get_running_loop()
        if self._turn is None or self._turn[0] is not loop:
            self._turn = loop, asyncio.Lock()
        turn = self._turn[1]
        await turn.acquire()
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                timer.cancel()
                turn.release()

        timer = loop.call_later(self.bound_s, release)
        on_response_sent(release)
