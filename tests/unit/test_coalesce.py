"""``gym_video_env.coalesce``: identical chat completions within the window go out as one request
with ``n``, each caller gets one choice; others pass through; a failure reaches every caller."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from gym_video_env.coalesce import (
    GROUP_METADATA_KEY,
    CoalescingClient,
    group_metadata,
    merged_stats,
    split_choices,
)

pytestmark = pytest.mark.unit


class RecordingClient:
    """Answers a chat completion with ``n`` choices whose token ids tell them apart."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.fail = fail
        self.max_connection_retries = None

    async def create_chat_completion(self, **body: Any) -> dict[str, Any]:
        self.bodies.append(body)
        await asyncio.sleep(0.01)
        if self.fail is not None:
            raise self.fail
        n = body.get("n", 1)
        start = 10 * (len(self.bodies) - 1)
        return {
            "id": "chatcmpl-1",
            "prompt_token_ids": [1, 2, 3],
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": f"c{i}"},
                    "token_ids": [start + i] * (i + 1),
                }
                for i in range(n)
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": sum(range(1, n + 1)), "total_tokens": 0},
        }


def _body(prompt: str = "p", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": prompt}], "temperature": 1.0, **extra}


async def _gather(client: CoalescingClient, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return await asyncio.gather(*(client.create_chat_completion(**body) for body in bodies))


def test_identical_requests_in_the_window_go_as_one_with_n_and_each_caller_gets_one_choice() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.05)
    answers = asyncio.run(_gather(client, [_body()] * 4 + [_body("q")] * 2))

    assert sorted(body.get("n", 1) for body in inner.bodies) == [2, 4]
    assert all({k: v for k, v in body.items() if k != "n"} in (_body(), _body("q")) for body in inner.bodies)
    for answer in answers:
        (choice,) = answer["choices"]
        assert choice["index"] == 0
        assert answer["usage"]["completion_tokens"] == len(choice["token_ids"])
        assert answer["usage"]["total_tokens"] == 3 + len(choice["token_ids"])
        assert answer["prompt_token_ids"] == [1, 2, 3]
    first_four = [a["choices"][0]["token_ids"] for a in answers[:4]]
    assert len({tuple(ids) for ids in first_four}) == 4, "each caller of a batch gets a different choice"
    assert len({a["id"] for a in answers[:4]}) == 4
    assert (client.requests_sent, client.requests_coalesced) == (2, 6)


def test_a_batch_that_fills_up_goes_at_once() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=10.0, max_n=3)  # the window would outlast the test
    answers = asyncio.run(asyncio.wait_for(_gather(client, [_body()] * 3), timeout=5))
    assert [body["n"] for body in inner.bodies] == [3]
    assert len(answers) == 3


def test_requests_with_n_a_seed_or_streaming_pass_through_and_a_lone_request_goes_without_n() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.01)
    bodies = [_body(n=2), _body(n=2), _body(seed=1), _body(seed=1), _body("alone")]
    answers = asyncio.run(_gather(client, bodies))
    assert [len(a["choices"]) for a in answers] == [2, 2, 1, 1, 1]
    assert len(inner.bodies) == 5
    assert "n" not in inner.bodies[-1]


def test_a_conversations_later_turns_go_at_once() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=10.0)  # a held request would outlast the test
    later = {**_body(), "messages": [*_body()["messages"], {"role": "assistant", "content": "B"}]}
    later["messages"].append({"role": "user", "content": "Sure?"})
    answers = asyncio.run(asyncio.wait_for(_gather(client, [later, later]), timeout=5))
    assert [body.get("n", 1) for body in inner.bodies] == [1, 1]
    assert len(answers) == 2
    assert (client.requests_sent, client.requests_coalesced) == (0, 0)


def test_a_failed_batch_fails_each_caller() -> None:
    inner = RecordingClient(fail=RuntimeError("vLLM said no"))
    client = CoalescingClient(inner, window_s=0.01)

    async def run() -> list[Any]:
        return await asyncio.gather(
            *(client.create_chat_completion(**_body()) for _ in range(3)), return_exceptions=True
        )

    results = asyncio.run(run())
    assert len(inner.bodies) == 1
    assert [str(r) for r in results] == ["vLLM said no"] * 3


def test_attributes_are_the_wrapped_clients() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.01)
    client.max_connection_retries = 8
    assert inner.max_connection_retries == 8
    assert client.max_connection_retries == 8


def test_split_refuses_a_response_with_another_number_of_choices() -> None:
    with pytest.raises(ValueError, match="asked vLLM for 3 choices, got 2"):
        split_choices({"choices": [{"index": 0}, {"index": 1}]}, 3)


def test_stats_count_full_batches_and_how_far_apart_a_batchs_callers_arrived() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.3, max_n=3)

    async def scenario() -> None:
        first = [asyncio.create_task(client.create_chat_completion(**_body())) for _ in range(3)]  # full
        late = asyncio.create_task(client.create_chat_completion(**_body("q")))
        await asyncio.sleep(0.12)  # the second "q" joins 0.12 s after the first; the window closes
        await asyncio.gather(*first, late, client.create_chat_completion(**_body("q")))

    asyncio.run(asyncio.wait_for(scenario(), timeout=5))
    stats = client.stats()
    assert (stats["requests_sent"], stats["callers"], stats["full"]) == (2, 5, 1)
    assert 0.12 <= stats["arrival_spread_s_sum"] < 0.3
    buckets = stats["arrival_spread_le_s"]
    assert list(buckets) == ["0.01", "0.05", "0.1", "0.2", "0.5", "1", "2", "inf"]
    assert (buckets["0.01"], buckets["0.2"], sum(buckets.values())) == (1, 1, 2)
    assert sum(stats["late_le_s"].values()) == 0  # both batches held every caller that came


def test_stragglers_of_a_short_batch_count_as_late_by_their_delay_within_the_horizon() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.03, max_n=4, late_horizon_s=0.4)

    async def scenario() -> None:
        calls = [asyncio.create_task(client.create_chat_completion(**_body()))]  # goes short at 0.03 s
        await asyncio.sleep(0.12)
        calls.append(asyncio.create_task(client.create_chat_completion(**_body())))  # late by 0.12 s
        await asyncio.sleep(0.5)
        calls.append(asyncio.create_task(client.create_chat_completion(**_body())))  # past the horizon
        await asyncio.gather(*calls)

    asyncio.run(asyncio.wait_for(scenario(), timeout=5))
    stats = client.stats()
    assert (stats["requests_sent"], stats["callers"], stats["full"]) == (3, 3, 0)
    assert stats["late_le_s"]["0.2"] == 1 and sum(stats["late_le_s"].values()) == 1


def test_merged_stats_add_counts_and_buckets_and_keep_a_flag_true_if_any_is() -> None:
    one = {"enabled": False, "requests_sent": 2, "late_le_s": {"0.1": 1, "inf": 0}}
    two = {"enabled": True, "requests_sent": 3, "late_le_s": {"0.1": 2, "inf": 1}}
    expected = {"enabled": True, "requests_sent": 5, "late_le_s": {"0.1": 3, "inf": 1}}
    assert merged_stats([one, two]) == expected


def _deadlines(max_wait_s: float | None) -> tuple[list[tuple[float, float]], Any, CoalescingClient]:
    """Three identical callers ~0.02 s apart under a 10 s window, then a fourth that fills the
    batch (``max_n=4``): after each of the three, the batch's arrival and timer deadline, both in
    seconds after its first caller; the batch; the client."""
    client = CoalescingClient(RecordingClient(), window_s=10.0, max_n=4, max_wait_s=max_wait_s)
    seen: list[tuple[float, float]] = []

    async def scenario() -> Any:
        calls = []
        for _ in range(3):
            calls.append(asyncio.create_task(client.create_chat_completion(**_body())))
            await asyncio.sleep(0.02)
            (batch,) = client._open.values()
            assert batch.timer is not None
            seen.append((batch.last_arrival - batch.opened, batch.timer.when() - batch.opened))
        calls.append(asyncio.create_task(client.create_chat_completion(**_body())))
        await asyncio.gather(*calls)
        return batch

    batch = asyncio.run(asyncio.wait_for(scenario(), timeout=5))
    return seen, batch, client


@pytest.mark.parametrize("max_wait_s", [None, 20.0, 10.03])
def test_with_max_wait_each_caller_moves_the_deadline_up_to_max_wait(max_wait_s: float | None) -> None:
    """Without ``max_wait_s`` the deadline stays ``window_s`` after the first caller; with it, it
    is ``window_s`` after the latest caller, never past ``max_wait_s`` after the first. A batch that
    fills goes at once and its timer is cancelled. (Deadlines are read, not waited for: nothing
    here depends on how late a loaded machine's timers fire.)"""
    seen, batch, client = _deadlines(max_wait_s)
    for arrival, deadline in seen:
        expected = 10.0 if max_wait_s is None else min(arrival + 10.0, max_wait_s)
        assert deadline == pytest.approx(expected, abs=1e-3)
    if max_wait_s == 10.03:  # the third caller came at least 0.04 s after the first: capped
        assert seen[2][0] >= 0.039 and seen[2][1] == pytest.approx(10.03, abs=1e-3)
    assert batch.sent and batch.timer.cancelled() and client._open == {}
    assert [body["n"] for body in client._client.bodies] == [4]


def test_a_trickle_goes_as_one_batch_once_no_caller_came_for_the_window() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.5, max_n=8, max_wait_s=5.0)

    async def scenario() -> None:
        calls = []
        for _ in range(4):  # 0.05 s apart: each well inside the window the one before restarted
            calls.append(asyncio.create_task(client.create_chat_completion(**_body())))
            await asyncio.sleep(0.05)
        await asyncio.gather(*calls)

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    assert [body["n"] for body in inner.bodies] == [4]
    assert client.stats()["full"] == 0


def test_with_max_wait_batches_that_fill_leave_no_state_for_the_next() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.3, max_n=2, max_wait_s=1.0)

    async def scenario() -> None:
        calls = [asyncio.create_task(client.create_chat_completion(**_body())) for _ in range(3)]
        await asyncio.sleep(0.05)  # the third caller's batch fills now
        calls.append(asyncio.create_task(client.create_chat_completion(**_body())))
        await asyncio.sleep(0.05)  # and a fifth goes alone when its window closes
        calls.append(asyncio.create_task(client.create_chat_completion(**_body())))
        await asyncio.gather(*calls)

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    assert [body.get("n", 1) for body in inner.bodies] == [2, 2, 1]
    assert client._open == {} and client.stats()["callers"] == 5


def test_max_wait_below_the_window_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"max_wait_s=0.01 needs a window_s above 0 and at most it \(it is 0.05\)"
    ):
        CoalescingClient(RecordingClient(), window_s=0.05, max_wait_s=0.01)


def test_stats_keep_each_batchs_send_and_answer_time_and_merging_sorts_them() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.05, max_n=2)
    started = time.time()
    asyncio.run(asyncio.wait_for(_gather(client, [_body(), _body(), _body("q")]), timeout=5))
    sends = client.stats()["sends"]
    assert sorted(n for _, _, n in sends) == [1, 2]
    for sent, answered, _ in sends:  # RecordingClient answers after 0.01 s
        assert started <= sent and answered - sent >= 0.009
    other = {"sends": [[started - 1.0, started - 0.5, 3]]}
    assert merged_stats([client.stats(), other])["sends"] == [other["sends"][0], *sorted(sends)]


def _declared(group: str = "g1", size: int = 4, prompt: str = "p", **metadata: str) -> dict[str, Any]:
    return _body(prompt, metadata={**metadata, **group_metadata(group, size)})


def test_a_declared_group_goes_with_its_first_caller_and_later_callers_take_the_other_choices() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.0)  # no window: only the declaration coalesces

    async def scenario() -> list[dict[str, Any]]:
        first = asyncio.create_task(client.create_chat_completion(**_declared(extra_body="{}")))
        for _ in range(3):  # the caller, then the request's task, run
            await asyncio.sleep(0)
        assert [body["n"] for body in inner.bodies] == [4], "sent with the first caller, no window"
        early = await first
        await asyncio.sleep(0.05)  # the answer came long ago: the others take choices at once
        later = await asyncio.wait_for(_gather(client, [_declared(extra_body="{}")] * 3), timeout=1)
        return [early, *later]

    answers = asyncio.run(asyncio.wait_for(scenario(), timeout=5))
    assert len(inner.bodies) == 1
    sent = inner.bodies[0]
    assert sent["metadata"] == {"extra_body": "{}"}, "the declaration does not reach vLLM"
    assert {k: v for k, v in sent.items() if k not in ("n", "metadata")} == _body()
    tokens = [tuple(answer["choices"][0]["token_ids"]) for answer in answers]
    assert len(set(tokens)) == 4, "each caller gets a different choice"
    stats = client.stats()
    assert (stats["group_requests"], stats["group_callers"], stats["group_choices_unclaimed"]) == (1, 4, 0)
    assert stats["requests_sent"] == 0 and client._groups == {}
    assert [n for _, _, n in stats["sends"]] == [4]


@pytest.mark.parametrize("declared", ["g1", "g1:0", ":4", "g1:four", 7])
def test_a_malformed_declaration_goes_undeclared_counted_and_said_once(
    declared: object, caplog: pytest.LogCaptureFixture
) -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.0)
    body = _body(metadata={GROUP_METADATA_KEY: declared})
    with caplog.at_level(logging.WARNING, logger="gym_video_env.coalesce"):
        asyncio.run(asyncio.wait_for(_gather(client, [body, body]), timeout=5))
    assert [sent.get("n", 1) for sent in inner.bodies] == [1, 1]
    assert all("metadata" not in sent for sent in inner.bodies), "the declaration does not reach vLLM"
    stats = client.stats()
    assert (stats["group_declarations_malformed"], stats["group_requests"]) == (2, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and repr(declared) in warnings[0]


def test_declared_groups_are_told_apart_by_id_and_a_caller_beyond_the_size_opens_a_new_request() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.0)
    bodies = [_declared("a", 2)] * 3 + [_declared("b", 2)] * 2
    answers = asyncio.run(asyncio.wait_for(_gather(client, bodies), timeout=5))
    assert [body["n"] for body in inner.bodies] == [2, 2, 2]
    assert all("metadata" not in body for body in inner.bodies)
    assert len(answers) == 5
    assert client.stats()["group_requests"] == 3


def test_a_failed_group_fails_its_callers_and_a_later_caller_opens_a_new_request() -> None:
    inner = RecordingClient(fail=RuntimeError("vLLM said no"))
    client = CoalescingClient(inner, window_s=0.0)

    async def scenario() -> list[Any]:
        failed = await asyncio.gather(
            *(client.create_chat_completion(**_declared()) for _ in range(2)), return_exceptions=True
        )
        inner.fail = None
        return [*failed, await client.create_chat_completion(**_declared())]

    results = asyncio.run(asyncio.wait_for(scenario(), timeout=5))
    assert [str(r) for r in results[:2]] == ["vLLM said no"] * 2
    assert len(results[2]["choices"]) == 1
    assert [body["n"] for body in inner.bodies] == [4, 4]


def test_a_caller_that_goes_away_leaves_the_request_to_the_others() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.0)

    async def scenario() -> dict[str, Any]:
        gone = asyncio.create_task(client.create_chat_completion(**_declared()))
        await asyncio.sleep(0)
        gone.cancel()
        return await client.create_chat_completion(**_declared())

    answer = asyncio.run(asyncio.wait_for(scenario(), timeout=5))
    assert len(answer["choices"]) == 1 and len(inner.bodies) == 1


def test_unclaimed_choices_are_dropped_after_the_horizon_and_counted() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.0, claim_horizon_s=0.02)

    async def scenario() -> None:
        await client.create_chat_completion(**_declared("a", 4))  # three samples never come
        await asyncio.sleep(0.05)
        await client.create_chat_completion(**_declared("b", 4))  # opening a group drops stale ones

    asyncio.run(asyncio.wait_for(scenario(), timeout=5))
    assert len(client._groups) == 1  # b's
    assert client.stats()["group_choices_unclaimed"] == 3


def test_without_a_window_an_undeclared_request_goes_alone_and_a_malformed_declaration_is_dropped() -> None:
    inner = RecordingClient()
    client = CoalescingClient(inner, window_s=0.0)
    malformed = _body(metadata={GROUP_METADATA_KEY: "no-size"})
    answers = asyncio.run(asyncio.wait_for(_gather(client, [_body(), _body(), malformed]), timeout=5))
    assert [body.get("n", 1) for body in inner.bodies] == [1, 1, 1]
    assert all("metadata" not in body for body in inner.bodies)
    assert len(answers) == 3


def test_group_metadata_refuses_an_id_it_could_not_read_back() -> None:
    assert group_metadata("abc", 8) == {GROUP_METADATA_KEY: "abc:8"}
    for group, size in (("", 8), ("a:b", 8), ("abc", 0)):
        with pytest.raises(ValueError, match="group_metadata"):
            group_metadata(group, size)
