"""Fuzzing the trajectory parser: arbitrary Gym trajectories give a TrajectoryError or turns whose
media agree with the placeholder tokens of their prompts.

Well-formed trajectories are generated from a model of a multi-turn rollout: every media part a
message adds puts one placeholder token into the next call's prompt (``VIDEO`` or ``IMAGE``, never
generated), calls may generate nothing, and a call may re-tokenise the conversation (its prompt then
restates every placeholder shown so far). Ill-formed ones are arbitrary JSON values, and
well-formed ones with one field replaced by junk.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rl_bridge.trajectory import MediaPart, TrajectoryError, parse_rollout, parse_trajectory

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])

VIDEO, IMAGE = 5, 6
PLACEHOLDER = {"video": VIDEO, "image": IMAGE}
TEXT_TOKENS = st.integers(10, 60)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)
KEYS = st.sampled_from(
    [
        "type",
        "role",
        "content",
        "output",
        "prompt_token_ids",
        "generation_token_ids",
        "generation_log_probs",
        "video_url",
        "image_url",
        "path",
        "text",
        "call_id",
    ]
)
VALUES = JSON | st.sampled_from(
    [
        "message",
        "user",
        "assistant",
        "input_video",
        "input_image",
        "input_text",
        "function_call_output",
        "input_audio",
        [],
        {},
        [1, 2],
        [-1],
        [float("nan")],
        [True],
    ]
)


@dataclass
class Expected:
    """What the generator meant: the trainable calls and where the conversation was re-tokenised."""

    calls: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """(prompt, generation) of every call with a non-empty generation."""
    split_at: list[bool] = field(default_factory=list)
    """Per trainable call: whether it re-tokenised the conversation."""


def _media_part(kind: str, name: str) -> dict[str, Any]:
    if kind == "video":
        return {"type": "input_video", "video_url": f"clips/{name}.mp4"}
    return {"type": "input_image", "image_url": f"images/{name}.png"}


@st.composite
def trajectories(draw: st.DrawFn) -> tuple[list[Any], list[Any], Expected]:
    """(prompt, output, expected) of a well-formed multi-turn rollout."""
    expected = Expected()
    counter = iter(range(10**6))

    def message(role: str) -> tuple[dict[str, Any], list[int]]:
        kinds = draw(st.lists(st.sampled_from(["video", "image"]), max_size=3))
        parts: list[Any] = [_media_part(kind, str(next(counter))) for kind in kinds]
        tokens: list[int] = []
        for kind in kinds:
            tokens += draw(st.lists(TEXT_TOKENS, max_size=2)) + [PLACEHOLDER[kind]]
        tokens += draw(st.lists(TEXT_TOKENS, min_size=1, max_size=3))
        parts.insert(draw(st.integers(0, len(parts))), {"type": "input_text", "text": "look"})
        return {"role": role, "content": parts}, tokens

    prompt_items: list[Any] = []
    new_tokens: list[int] = []
    for role in draw(st.lists(st.sampled_from(["system", "user", "developer"]), min_size=1, max_size=2)):
        item, tokens = message(role)
        prompt_items.append(item)
        new_tokens += tokens
    output: list[Any] = []
    seen: list[int] = []
    shown: list[int] = []  # placeholder tokens of every media part so far
    pending: list[int] = [t for t in new_tokens if t in (VIDEO, IMAGE)]
    for _ in range(draw(st.integers(1, 4))):
        retokenise = bool(seen) and draw(st.booleans())
        if retokenise:
            # A chat template re-rendered the conversation: a different first token, every
            # placeholder shown so far restated in order.
            restate: list[int] = []
            for token in shown:
                restate += [draw(TEXT_TOKENS), token]
            prompt = [61, *restate, *new_tokens]
        else:
            prompt = [*seen, *new_tokens]
        generation = draw(st.lists(TEXT_TOKENS, max_size=4))
        output.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "answer"}],
                "prompt_token_ids": prompt,
                "generation_token_ids": generation,
                "generation_log_probs": draw(
                    st.lists(st.floats(-20.0, 0.0), min_size=len(generation), max_size=len(generation))
                ),
            }
        )
        if not generation:
            continue  # trains nothing and is skipped: the next call's prompt extends the last trained one
        expected.calls.append((prompt, generation))
        expected.split_at.append(retokenise)
        shown += pending
        pending = []
        seen = [*prompt, *generation]
        new_tokens = []
        if draw(st.booleans()):
            output.append({"type": "function_call", "call_id": "c", "name": "watch", "arguments": "{}"})
            output.append({"type": "function_call_output", "call_id": "c", "output": "done"})
            new_tokens += draw(st.lists(TEXT_TOKENS, min_size=1, max_size=3))
        if draw(st.booleans()):
            item, tokens = message("user")
            output.append(item)
            new_tokens += tokens
            pending += [t for t in tokens if t in (VIDEO, IMAGE)]
        if not new_tokens:
            new_tokens = draw(st.lists(TEXT_TOKENS, min_size=1, max_size=2))
    return prompt_items, output, expected


def _kinds(parts: tuple[MediaPart, ...]) -> list[int]:
    return [PLACEHOLDER[part.kind] for part in parts]


@FUZZ
@given(trajectories())
def test_turn_media_match_the_placeholders_of_their_prompts(
    case: tuple[list[Any], list[Any], Expected],
) -> None:
    prompt, output, expected = case
    if not expected.calls:
        with pytest.raises(TrajectoryError) as caught:
            parse_trajectory(output, prompt=prompt)
        assert caught.value.reason == "no_trainable_turn"
        return
    trajectory = parse_trajectory(output, prompt=prompt)
    assert len(trajectory.turns) == len(expected.calls)
    for turn in trajectory.turns:
        placeholders = [t for t in turn.new_prompt_ids if t in (VIDEO, IMAGE)]
        assert placeholders == _kinds(turn.new_prompt_media), turn
        assert not set(turn.generation_ids) & {VIDEO, IMAGE}
    # Every media part of the rollout is introduced exactly once, in order.
    all_parts = [
        p
        for item in [*prompt, *output]
        if isinstance(item.get("content"), list)
        for p in item["content"]
        if p["type"] in ("input_video", "input_image")
    ]
    introduced = [part.part for part in trajectory.media]
    assert introduced == all_parts[: len(introduced)]
    # Round trip: each sequence's tokens are its last call's prompt and generation, exactly.
    for sequence in trajectory.sequences:
        last = sequence[-1]
        prompt_ids, generation_ids = expected.calls[last.index]
        assert trajectory.token_ids(last.sequence) == [*prompt_ids, *generation_ids]
        assert last.end == len(prompt_ids) + len(generation_ids)
    assert [turn.sequence for turn in trajectory.turns] == _sequences(expected.split_at)
    # The record form parses the same.
    record = {"responses_create_params": {"input": prompt}, "response": {"output": output}}
    assert parse_rollout(record) == trajectory


def _sequences(split_at: list[bool]) -> list[int]:
    sequence, result = 0, []
    for split in split_at:
        sequence += split
        result.append(sequence)
    return result


@FUZZ
@given(trajectories())
def test_retokenised_prompts_raise_when_asked_to(case: tuple[list[Any], list[Any], Expected]) -> None:
    prompt, output, expected = case
    if any(expected.split_at):
        with pytest.raises(TrajectoryError) as caught:
            parse_trajectory(output, prompt=prompt, retokenized="error")
        assert caught.value.reason == "not_prefix_continuation"
    elif expected.calls:
        assert len(parse_trajectory(output, prompt=prompt, retokenized="error").turns) == len(expected.calls)


def _mutate(value: Any, path: list[Any], junk: Any) -> Any:
    """``value`` with the element at ``path`` replaced by ``junk``."""
    mutated = copy.deepcopy(value)
    target = mutated
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = junk
    return mutated


def _paths(value: Any, prefix: list[Any]) -> list[list[Any]]:
    paths: list[list[Any]] = []
    children = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, child in children:
        paths.append([*prefix, key])
        paths += _paths(child, [*prefix, key])
    return paths


def _parse_or_error(record: Any) -> None:
    try:
        trajectory = parse_rollout(record)
    except TrajectoryError as error:
        assert error.reason and error.location and error.detail
        return
    assert trajectory.turns and all(turn.generation_ids for turn in trajectory.turns)
    assert all(len(t.generation_ids) == len(t.generation_logprobs) for t in trajectory.turns)


@FUZZ
@given(case=trajectories(), data=st.data())
# Unhashable part types and roles (lists, objects) must not reach a set lookup.
@example(case=([{"role": "user", "content": [{"type": ["input_video"]}]}], [], Expected()), data=None).via(
    "unhashable part type"
)
@example(case=([{"role": {"user": 1}, "content": []}], [], Expected()), data=None).via("unhashable role")
@example(case=([], [{"type": "function_call_output", "output": [{"type": {}}]}], Expected()), data=None).via(
    "unhashable tool output part type"
)
# A logprob integer too large for a float.
@example(
    case=(
        [],
        [{"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [10**400]}],
        Expected(),
    ),
    data=None,
).via("huge integer logprob")
# A URL that urllib cannot split.
@example(
    case=(
        [{"role": "user", "content": [{"type": "input_video", "video_url": "http://[::1"}]}],
        [],
        Expected(),
    ),
    data=None,
).via("unsplittable URL")
def test_damaged_trajectories_give_a_trajectory_error_or_valid_turns(
    case: tuple[list[Any], list[Any], Expected], data: st.DataObject | None
) -> None:
    prompt, output, _ = case
    record: dict[str, Any] = {"responses_create_params": {"input": prompt}, "response": {"output": output}}
    if data is not None:
        paths = _paths(record, [])
        path = data.draw(st.sampled_from(paths), label="path")
        record = _mutate(record, path, data.draw(VALUES, label="junk"))
        response = record.get("response")
        items = response.get("output") if isinstance(response, dict) else None
        if isinstance(items, list) and items and data.draw(st.booleans(), label="add a key"):
            item = items[data.draw(st.integers(0, len(items) - 1), label="item")]
            if isinstance(item, dict):
                item[data.draw(KEYS, label="key")] = data.draw(VALUES, label="value")
    _parse_or_error(record)
    _parse_or_error(
        {"responses_create_params": {"input": prompt}, "response": {"output": [*output, *prompt]}}
    )


@FUZZ
@given(record=JSON, prompt=JSON)
def test_arbitrary_json_gives_a_trajectory_error(record: Any, prompt: Any) -> None:
    for candidate in (record, {"responses_create_params": {"input": prompt}, "response": {"output": record}}):
        if isinstance(candidate, dict):
            _parse_or_error(candidate)
    try:
        parse_trajectory(record, prompt=prompt)
    except TrajectoryError:
        pass
