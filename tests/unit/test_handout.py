"""``gym_video_env.handout``: answers that arrive together are handed to their requests in turn,
each request's response sent before the next answer is taken; without turns (or outside a server
with the middleware) every request takes its answer at once. A Starlette app with a
``BaseHTTPMiddleware`` inside (as Gym's servers have) over an in-process ASGI transport."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gym_video_env.handout import Handout, ResponseSentMiddleware, on_response_sent

REQUESTS = 6


async def _serve(handout: Handout, *, hang: int | None = None) -> list[tuple[str, int]]:
    """``REQUESTS`` requests whose answers arrive at one moment; each takes its turn, then
    converts (1 ms of CPU). The log of conversions and of responses sent, in order."""
    log: list[tuple[str, int]] = []
    answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    arrived = 0

    async def endpoint(request: Request) -> JSONResponse:
        nonlocal arrived
        index = int(request.query_params["i"])
        arrived += 1
        if arrived == REQUESTS:
            answer.set_result(None)
        await answer
        await handout.take()
        if index == hang:  # this request awaits something else after taking its turn
            await asyncio.sleep(0.2)
        log.append(("convert", index))
        started = time.perf_counter()
        while time.perf_counter() - started < 0.001:
            pass
        on_response_sent(lambda: log.append(("sent", index)))
        return JSONResponse({"i": index})

    class Inner(BaseHTTPMiddleware):  # a response crosses it over several turns of the loop
        async def dispatch(self, request: Request, call_next: Any) -> Any:
            return await call_next(request)

    app = Starlette(routes=[Route("/", endpoint, methods=["POST"])])
    app.add_middleware(Inner)
    app.add_middleware(ResponseSentMiddleware)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        answers = await asyncio.gather(*(http.post("/", params={"i": i}) for i in range(REQUESTS)))
    assert sorted(response.json()["i"] for response in answers) == list(range(REQUESTS))
    return log


def test_in_turn_each_response_is_sent_before_the_next_answer_is_converted() -> None:
    log = asyncio.run(_serve(Handout(bound_s=1.0)))
    assert [event for event, _ in log] == ["convert", "sent"] * REQUESTS
    assert [index for _, index in log[::2]] == [index for _, index in log[1::2]]  # each its own


def test_without_turns_every_answer_is_converted_before_the_first_response_is_sent() -> None:
    log = asyncio.run(_serve(Handout(bound_s=0.0)))
    assert [event for event, _ in log] == ["convert"] * REQUESTS + ["sent"] * REQUESTS


def test_a_request_busy_elsewhere_holds_its_turn_only_for_the_bound() -> None:
    started = time.perf_counter()
    log = asyncio.run(_serve(Handout(bound_s=0.01), hang=0))
    assert time.perf_counter() - started < 1.0
    assert log.index(("convert", 0)) > log.index(("sent", 1)), "the others went on after the bound"
    assert log.count(("sent", 0)) == 1


def test_outside_a_request_served_with_the_middleware_answers_are_taken_at_once() -> None:
    async def take_twice() -> float:
        handout = Handout(bound_s=10.0)
        started = time.perf_counter()
        await handout.take()
        await handout.take()  # no turn was held: no request to send a response
        return time.perf_counter() - started

    assert asyncio.run(take_twice()) < 1.0
    with pytest.raises(ValueError, match="bound_s"):
        Handout(bound_s=-1.0)
