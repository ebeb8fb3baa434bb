"""Trajectory parsing: turns, new prompt tokens and per-turn media from Gym output items.

Hypothesis builds random multi-turn trajectories (media in the prompt, in injected user messages,
in messages after tool outputs; function calls, reasoning and text-only tool outputs in between;
calls without a generation; items after the last turn) shaped as Gym output items, and checks that
parsing recovers every turn exactly, then that each kind of corruption raises its typed error.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_bridge.trajectory import TrajectoryError, parse_rollout, parse_trajectory, prompt_media

pytestmark = pytest.mark.unit

VIDEO_SOURCES = st.sampled_from(
    [
        {"video_url": "file:///media/clip-{n}.mp4"},
        {"video_url": {"url": "file:///media/clip-{n}.mp4"}},
        {"path": "clips/clip-{n}.mp4"},
        {"frames_manifest": "frames/clip-{n}.json"},
        {"video": "data:video/mp4;base64,AAAA{n}"},
    ]
)
IMAGE_SOURCES = st.sampled_from(
    [
        {"image_url": "data:image/png;base64,iVBO{n}"},
        {"path": "images/{n}.png"},
        {"image_url": "file:///i/{n}.png"},
    ]
)


@st.composite
def media_parts(draw: st.DrawFn) -> dict[str, Any]:
    """One media content part with a unique source (so the parts of a trajectory are tellable)."""
    kind = draw(st.sampled_from(["input_video", "input_image"]))
    template = draw(VIDEO_SOURCES if kind == "input_video" else IMAGE_SOURCES)
    number = draw(st.integers(0, 10**9))
    ((key, value),) = template.items()
    if isinstance(value, dict):
        value = {"url": value["url"].format(n=number)}
    else:
        value = value.format(n=number)
    return {"type": kind, key: value}


def _user(content: list[dict[str, Any]], role: str = "user") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": content}


TEXT = {"type": "input_text", "text": "look"}
FILLERS = st.sampled_from(
    [
        {"type": "function_call", "name": "zoom", "arguments": "{}", "call_id": "c1", "id": "f1"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}]},
        {"type": "reasoning", "id": "r1", "summary": [{"type": "summary_text", "text": "hm"}]},
        {"role": "assistant", "content": "plain text, no tokens"},
        _user([TEXT]),
    ]
)
TOKENS = st.lists(st.integers(0, 50_000), min_size=1, max_size=6)


@dataclass
class Expected:
    new_prompt_ids: list[int]
    generation_ids: list[int]
    logprobs: list[float]
    media: list[dict[str, Any]]


@st.composite
def trajectories(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Expected]]:
    """``(prompt, output items, expected turns)``."""
    prompt_parts = draw(st.lists(media_parts(), max_size=3))
    prompt = [_user([TEXT, *prompt_parts])]
    output: list[dict[str, Any]] = []
    expected: list[Expected] = []
    seen: list[int] = []
    for number in range(draw(st.integers(1, 4))):
        media = list(prompt_parts) if number == 0 else []
        for _ in range(draw(st.integers(0, 3))):
            choice = draw(st.sampled_from(["filler", "injected", "relocated"]))
            if choice == "filler":
                output.append(draw(FILLERS))
                continue
            parts = draw(st.lists(media_parts(), min_size=1, max_size=3))
            if choice == "relocated":  # a tool output whose media moved into the next user message
                note = {"type": "input_text", "text": "[moved to the next user message]"}
                output.append({"type": "function_call_output", "call_id": "c", "output": [note]})
            role = draw(st.sampled_from(["user", "system", "developer"]))
            output.append(_user([*parts, TEXT] if draw(st.booleans()) else [TEXT, *parts], role=role))
            media += parts
        new_prompt = draw(TOKENS)
        if draw(st.booleans()):  # a call that generated nothing: not a turn, and seen stays unchanged
            output.append(
                {
                    "prompt_token_ids": seen + new_prompt[:1],
                    "generation_token_ids": [],
                    "generation_log_probs": [],
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                }
            )
        generation = draw(TOKENS)
        logprobs = draw(st.lists(st.floats(-30.0, 0.0), min_size=len(generation), max_size=len(generation)))
        item_type = draw(st.sampled_from(["message", "function_call", "reasoning"]))
        output.append(
            {
                "type": item_type,
                "role": "assistant",
                "prompt_token_ids": seen + new_prompt,
                "generation_token_ids": generation,
                "generation_log_probs": logprobs,
            }
        )
        expected.append(Expected(new_prompt, generation, logprobs, media))
        seen = seen + new_prompt + generation
    if draw(st.booleans()):  # never sent to the model: ignored
        output.append(_user([draw(media_parts())]))
    return prompt, output, expected


def _source(part: dict[str, Any]) -> tuple[str, Any]:
    return next((key, value) for key, value in part.items() if key != "type")


@settings(max_examples=300, deadline=None)
@given(trajectories())
def test_parsing_recovers_every_turn_and_its_media(case: tuple[list[Any], list[Any], list[Expected]]) -> None:
    prompt, output, expected = case
    trajectory = parse_trajectory(output, prompt=prompt)

    assert len(trajectory.turns) == len(expected)
    offset = 0
    for turn, want in zip(trajectory.turns, expected, strict=True):
        assert list(turn.new_prompt_ids) == want.new_prompt_ids
        assert list(turn.generation_ids) == want.generation_ids
        assert list(turn.generation_logprobs) == want.logprobs
        assert [_source(dict(m.part)) for m in turn.media] == [_source(p) for p in want.media]
        assert [m.kind for m in turn.media] == [p["type"].removeprefix("input_") for p in want.media]
        assert turn.prompt_start == offset and turn.generation_start == offset + len(want.new_prompt_ids)
        assert turn.sequence == 0 and turn.restated_media == ()
        offset = turn.end
    assert trajectory.token_ids() == output_tokens(output)
    assert len(trajectory.sequences) == 1
    locations = [m.location for m in trajectory.media]
    assert len(set(locations)) == len(locations)


def output_tokens(output: list[dict[str, Any]]) -> list[int]:
    """The last trainable call's prompt plus generation: the whole token sequence."""
    last = [item for item in output if item.get("generation_token_ids")][-1]
    return last["prompt_token_ids"] + last["generation_token_ids"]


def _trainable(output: list[dict[str, Any]]) -> list[int]:
    return [i for i, item in enumerate(output) if item.get("generation_token_ids")]


@settings(max_examples=150, deadline=None)
@given(trajectories(), st.data())
def test_a_prompt_that_does_not_continue_the_seen_tokens_starts_a_sequence_or_is_rejected(
    case: tuple[list[Any], list[Any], list[Expected]], data: st.DataObject
) -> None:
    prompt, output, _ = case
    later = _trainable(output)[1:]
    if not later:
        return
    index = data.draw(st.sampled_from(later))
    item = dict(output[index])
    previous = output[_trainable(output)[_trainable(output).index(index) - 1]]
    seen = len(previous["prompt_token_ids"]) + len(previous["generation_token_ids"])
    position = data.draw(st.integers(0, seen - 1))
    ids = list(item["prompt_token_ids"])
    ids[position] = ids[position] + 1
    output[index] = {**item, "prompt_token_ids": ids}

    trajectory = parse_trajectory(output, prompt=prompt)
    (turn,) = [t for t in trajectory.turns if t.item_index == index]
    assert turn.sequence == 1 and turn.prompt_start == 0 and list(turn.new_prompt_ids) == ids
    earlier = [t for t in trajectory.turns if t.index < turn.index]
    assert turn.restated_media == tuple(part for t in earlier for part in t.media)
    assert turn.new_prompt_media == turn.restated_media + turn.media
    assert [t.sequence for t in earlier] == [0] * len(earlier)
    assert all(b.sequence - a.sequence in (0, 1) for a, b in itertools.pairwise(trajectory.turns))
    assert trajectory.token_ids(trajectory.turns[-1].sequence) == output_tokens(output)
    assert trajectory.media == tuple(part for t in trajectory.turns for part in t.media)

    with pytest.raises(TrajectoryError) as raised:
        parse_trajectory(output, prompt=prompt, retokenized="error")
    assert raised.value.reason == "not_prefix_continuation"
    assert raised.value.location == f"output[{index}].prompt_token_ids"
    assert f"position {position}" in raised.value.detail


@settings(max_examples=100, deadline=None)
@given(trajectories(), st.data())
def test_bad_logprobs_are_rejected(
    case: tuple[list[Any], list[Any], list[Expected]], data: st.DataObject
) -> None:
    prompt, output, _ = case
    index = data.draw(st.sampled_from(_trainable(output)))
    item = output[index]
    bad = data.draw(st.sampled_from(["short", "nan", "inf"]))
    logprobs = list(item["generation_log_probs"])
    if bad == "short":
        logprobs.pop()
    else:
        logprobs[data.draw(st.integers(0, len(logprobs) - 1))] = math.nan if bad == "nan" else -math.inf
    output[index] = {**item, "generation_log_probs": logprobs}
    with pytest.raises(TrajectoryError) as raised:
        parse_trajectory(output, prompt=prompt)
    assert raised.value.reason == ("logprob_length_mismatch" if bad == "short" else "non_finite_logprob")
    assert raised.value.location.startswith(f"output[{index}]")


def _turn(prompt_ids: list[int], generation: list[int]) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "prompt_token_ids": prompt_ids,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.5] * len(generation),
    }


VIDEO = {"type": "input_video", "video_url": "file:///m/a.mp4"}


@pytest.mark.parametrize(
    ("output", "reason", "location"),
    [
        ([], "no_trainable_turn", "output"),
        ([{"type": "message", "role": "assistant", "content": "hi"}], "no_trainable_turn", "output"),
        ("not a list", "malformed", "output"),
        ([{**_turn([1], [2]), "generation_log_probs": None}], "malformed", "output[0]"),
        ([_turn([1, -2], [3])], "malformed", "output[0].prompt_token_ids[1]"),
        ([_turn([1], [True])], "malformed", "output[0].generation_token_ids[0]"),
        ([_turn([], [3])], "malformed", "output[0].prompt_token_ids"),
        ([_turn([1, 2], [3]), _turn([1], [4])], "not_prefix_continuation", "output[1].prompt_token_ids"),
        (
            [_user([{"type": "input_audio", "input_audio": {}}]), _turn([1], [2])],
            "unsupported_content",
            "output[0].content[0]",
        ),
        (
            [_user([{"type": "input_video", "path": "a", "video_url": "file:///a"}]), _turn([1], [2])],
            "invalid_media",
            "output[0].content[0]",
        ),
        (
            [_user([{"type": "input_video", "video_url": "ftp://host/a.mp4"}]), _turn([1], [2])],
            "invalid_media",
            "output[0].content[0]",
        ),
        ([_user([{"type": "input_image"}]), _turn([1], [2])], "invalid_media", "output[0].content[0]"),
        (["text item"], "malformed", "output[0]"),
        ([_user("fine"), {**_user([]), "content": 3}, _turn([1], [2])], "malformed", "output[1].content"),
    ],
)
def test_violations_raise_typed_errors(output: Any, reason: str, location: str) -> None:
    with pytest.raises(TrajectoryError) as raised:
        parse_trajectory(output, prompt=None, retokenized="error")
    assert raised.value.reason == reason
    assert raised.value.location == location
    assert location in str(raised.value) and reason in str(raised.value)


def test_media_in_a_tool_output_count_where_the_model_server_relocated_them() -> None:
    """A stock agent records the tool output as the tool returned it; the model server moved its
    media into a user message right after it before prompting vLLM. The trainer applies the same
    relocation: the turn after the tool output gets the media, in order, as with the relocated items."""
    second = {"type": "input_video", "video_url": "file:///m/b.mp4"}
    call = {"type": "function_call", "call_id": "c", "name": "watch", "arguments": "{}"}
    raw = {"type": "function_call_output", "call_id": "c", "output": [TEXT, VIDEO, second]}
    recorded = parse_trajectory([_turn([1], [2]), call, raw, _turn([1, 2, 3], [4])], prompt="p")
    relocated_items = [
        {"type": "function_call_output", "call_id": "c", "output": [TEXT]},
        _user([VIDEO, second]),
    ]
    relocated = parse_trajectory([_turn([1], [2]), call, *relocated_items, _turn([1, 2, 3], [4])], prompt="p")
    assert [[p.ref.value for p in t.media] for t in recorded.turns] == [[], ["/m/a.mp4", "/m/b.mp4"]]
    assert [[p.ref.value for p in t.media] for t in relocated.turns] == [[], ["/m/a.mp4", "/m/b.mp4"]]


def test_media_after_the_last_turn_and_in_later_tool_outputs_are_ignored() -> None:
    trailing = [_user([VIDEO]), {"type": "function_call_output", "call_id": "c", "output": [VIDEO]}]
    trajectory = parse_trajectory([_turn([1], [2]), *trailing], prompt="plain text prompt")
    assert trajectory.media == () and trajectory.token_ids() == [1, 2]


def test_parse_rollout_reads_a_gym_record_and_prompt_media_lists_the_prompt_parts() -> None:
    prompt = [{"role": "system", "content": "be brief"}, _user([TEXT, VIDEO])]
    record = {"responses_create_params": {"input": prompt}, "response": {"output": [_turn([5, 6], [7])]}}
    trajectory = parse_rollout(record)
    ((part,),) = [turn.media for turn in trajectory.turns]
    assert part.kind == "video" and part.ref.kind == "file" and part.ref.value == "/m/a.mp4"
    assert part.location == "input[1].content[1]"
    assert prompt_media(prompt) == (part,)
    with pytest.raises(TrajectoryError, match="responses_create_params") as raised:
        parse_rollout({"response": {"output": []}})
    assert raised.value.reason == "malformed"
