"""The loop's rank launcher on CPU: the policy as two gloo ranks in child processes, data parallel
with Megatron's distributed optimizer, and as two pipeline stages, against one rank on the same
batch.

:class:`rl_bridge.backends.policy_ranks.LocalPolicyRanks` starts the ranks as ``video-grpo train``
does for ``model.cpu_policy_ranks=2``, and :class:`~rl_bridge.backends.policy_ranks.RankedPolicy`
splits the batch over them. The batch is the tiny Qwen2.5-VL's video batch of ``tp_check`` (4
samples, micro-batches of 1), the loss the default GRPO loss, one Adam step at a learning rate of
1e-3 in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# fp32: the two runs sum the same gradients in a different order (two half-batch reductions and an
# all-reduce against one pass), so parameters differ in the last bits after the step; the logprobs
# of the tiny model's ~60-token samples then agree to a few 1e-6 (measured: 1.9e-6).
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Launch:
    layouts: list[Any]
    before: list[torch.Tensor]
    metrics: Any
    after: list[torch.Tensor]
    state: list[dict[str, int]]
    failure: BaseException


def _launch(
    model: Any, batch: list[Any], ranks: int, *, distributed_optimizer: bool, pipeline_parallel: int = 1
) -> Launch:
    from rl_bridge.backends.policy_ranks import LocalPolicyRanks, RankedPolicy
    from rl_bridge.grpo import GRPOLossConfig
    from rl_bridge.megatron.policy import PolicyConfig
    from rl_bridge.megatron.policy_loss import GRPOPolicyLoss
    from rl_bridge.placement import PolicyRank

    config = PolicyConfig(learning_rate=1e-3, micro_batch_size=1, distributed_optimizer=distributed_optimizer)
    data_parallel = ranks // pipeline_parallel
    plan_ranks = [
        PolicyRank(
            r,
            None,
            tensor_rank=0,
            pipeline_rank=r // data_parallel,
            data_rank=r % data_parallel,
            expert_rank=0,
        )
        for r in range(ranks)
    ]
    with LocalPolicyRanks(
        plan_ranks,
        tensor_parallel=1,
        pipeline_parallel=pipeline_parallel,
        seed=0,
        model_dir=model,
        config=config,
        with_reference=False,
    ) as launched:
        policy = RankedPolicy("policy", launched.call, launched.layouts)
        before = policy.logprobs(batch)
        metrics = policy.train_step(batch, GRPOPolicyLoss(GRPOLossConfig()))
        after = policy.logprobs(batch)
        state = policy.state_bytes()
        with pytest.raises(AttributeError) as failure:
            launched.call("policy", "no_such_method", [()] * ranks, {})
    return Launch(launched.layouts, before, metrics, after, state, failure.value)


@pytest.fixture(scope="module")
def model_and_batch() -> tuple[Any, list[Any]]:
    """The tiny Qwen2.5-VL and ``tp_check``'s 4-sample video batch for it."""
    from tests.fixtures.tp_check import synthetic_batch
    from video_grpo_demo.tiny_models import build_tiny_model

    model = build_tiny_model("qwen2_5_vl")
    return model, synthetic_batch(model, num_samples=4)


@pytest.fixture(scope="module")
def launches(model_and_batch: tuple[Any, list[Any]]) -> tuple[Launch, Launch]:
    model, batch = model_and_batch
    return (
        _launch(model, batch, 1, distributed_optimizer=False),
        _launch(model, batch, 2, distributed_optimizer=True),
    )


@pytest.fixture(scope="module")
def pipeline(model_and_batch: tuple[Any, list[Any]]) -> Launch:
    """The same batch and step on two pipeline stages (the tiny model's two language layers, one
    each; the vision tower on the first)."""
    model, batch = model_and_batch
    return _launch(model, batch, 2, distributed_optimizer=False, pipeline_parallel=2)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [t.shape for t in a] == [t.shape for t in b]
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_two_ranks_form_one_data_parallel_group(launches: tuple[Launch, Launch]) -> None:
    _, dp2 = launches
    assert [
        (layout.rank, layout.world_size, layout.data_parallel, layout.data_parallel_rank)
        for layout in dp2.layouts
    ] == [
        (0, 2, 2, 0),
        (1, 2, 2, 1),
    ]
    assert {layout.backend for layout in dp2.layouts} == {"gloo"}


def test_the_data_parallel_step_equals_the_single_rank_step(launches: tuple[Launch, Launch]) -> None:
    dp1, dp2 = launches
    assert _max_diff(dp1.before, dp2.before) < TOLERANCE
    moved = _max_diff(dp1.before, dp1.after)
    assert moved > 100 * TOLERANCE, f"the step barely moved the logprobs ({moved:.2e}): the check is void"
    assert _max_diff(dp1.after, dp2.after) < TOLERANCE
    assert dp2.metrics.loss == pytest.approx(dp1.metrics.loss, rel=1e-5)
    assert dp2.metrics.grad_norm == pytest.approx(dp1.metrics.grad_norm, rel=1e-5)
    assert (dp2.metrics.num_samples, dp2.metrics.num_target_tokens) == (4, dp1.metrics.num_target_tokens)


def test_the_distributed_optimizer_holds_half_the_state_on_each_rank(launches: tuple[Launch, Launch]) -> None:
    dp1, dp2 = launches
    (single,) = dp1.state
    for rank in dp2.state:
        assert rank["parameters"] == single["parameters"]
        # Adam's two fp32 moments, sharded over 2 ranks (bucket padding: a few elements off half).
        assert rank["optimizer"] == pytest.approx(single["optimizer"] / 2, rel=1e-3)


def test_a_rank_that_raises_fails_the_call_with_the_rank_named(launches: tuple[Launch, Launch]) -> None:
    _, dp2 = launches
    assert "no_such_method" in str(dp2.failure)
    assert any("raised in policy rank" in note for note in getattr(dp2.failure, "__notes__", []))


def test_two_pipeline_stages_take_the_single_rank_step(
    launches: tuple[Launch, Launch], pipeline: Launch
) -> None:
    """The last stage computes logprobs and the loss and hands them to the first; the stages hold
    the model's parameters between them, once."""
    single, _ = launches
    assert [
        (layout.pipeline_parallel, layout.pipeline_parallel_rank, layout.data_parallel)
        for layout in pipeline.layouts
    ] == [
        (2, 0, 1),
        (2, 1, 1),
    ]
    assert _max_diff(single.before, pipeline.before) < TOLERANCE
    assert _max_diff(single.after, pipeline.after) < TOLERANCE
    assert _max_diff(single.before, single.after) > 100 * TOLERANCE
    assert pipeline.metrics.loss == pytest.approx(single.metrics.loss, rel=1e-5)
    assert pipeline.metrics.grad_norm == pytest.approx(single.metrics.grad_norm, rel=1e-5)
    first, last = pipeline.state
    assert first["parameters"] + last["parameters"] == single.state[0]["parameters"]
    assert 0 < last["parameters"] < first["parameters"]  # the vision tower and embedding are first
