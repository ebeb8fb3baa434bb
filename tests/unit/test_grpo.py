"""GRPO maths: hand-computed values and hypothesis properties of advantages, loss, KL, IS and mismatch."""

from __future__ import annotations

import ast
import inspect
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rl_bridge import grpo
from rl_bridge.grpo import (
    GRPOLossConfig,
    group_advantages,
    grpo_loss,
    kl_estimate,
    loss_denominator,
    mismatch_exceeds,
    needs_reference,
    train_inference_mismatch,
)

pytestmark = pytest.mark.unit

PROPERTY = settings(max_examples=40, deadline=None)

# Two sequences of three tokens. Sequence 0 (A = +1) has ratios 1.0, 1.5 and a masked 0.5;
# sequence 1 (A = -1) has ratios 0.5, 1.1, 2.0. With eps_low 0.2 and eps_high 0.3 the per-token
# losses are -1, -1.3 (clipped high), 0.8 (clipped low), 1.1, 2.0 (negative advantage: the upper
# clip does not apply): sum 1.6 over 5 tokens.
OLD = torch.log(torch.tensor([[0.4, 0.2, 0.3], [0.6, 0.5, 0.1]]))
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [0.5, 1.1, 2.0]])
MASK = torch.tensor([[True, True, False], [True, True, True]])
ADV = torch.tensor([1.0, -1.0])
CLIP = GRPOLossConfig(eps_low=0.2, eps_high=0.3)


def _current() -> torch.Tensor:
    return (OLD + RATIOS.log()).requires_grad_()


def _random_batch(seed: int, batch: int, length: int) -> tuple[torch.Tensor, ...]:
    """Logprobs (current, old, behaviour, reference), a token mask with >= 1 token per row, advantages."""
    gen = torch.Generator().manual_seed(seed)
    base = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    old = base + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    behaviour = old + 0.1 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    ref = base + 0.5 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=gen) < 0.7
    mask[:, 0] = True
    adv = torch.randn(batch, generator=gen, dtype=torch.float64)
    return base, old, behaviour, ref, mask, adv


# ------------------------------------------------------------------------------------ advantages


def test_group_mean_and_std_advantages_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # mean 0.5, Bessel std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    out = group_advantages(rewards, std_eps=0.0)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / std)
    raw = group_advantages(rewards, normalize_std=False)
    torch.testing.assert_close(raw.advantages, torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    assert not out.zero_signal.any()


def test_leave_one_out_baseline_by_hand() -> None:
    # baselines (2+3+6)/3, (1+3+6)/3, (1+2+6)/3, (1+2+3)/3
    out = group_advantages(
        torch.tensor([1.0, 2.0, 3.0, 6.0]), group_size=4, normalize_std=False, leave_one_out=True
    )
    torch.testing.assert_close(out.advantages, torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0]))
    # with std: same numerators over the group std (sqrt(14 / 3)); the std is not leave-one-out
    scaled = group_advantages(
        torch.tensor([1.0, 2.0, 3.0, 6.0]), group_size=4, leave_one_out=True, std_eps=0.0
    )
    torch.testing.assert_close(
        scaled.advantages, torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0]) / math.sqrt(14 / 3)
    )


def test_masked_samples_stay_out_of_baseline_and_get_zero_advantage() -> None:
    rewards = torch.tensor([[1.0, 0.0, float("nan"), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    mean = group_advantages(rewards, sample_mask=mask, normalize_std=False)
    torch.testing.assert_close(mean.advantages, torch.tensor([[2 / 3, -1 / 3, 0.0, -1 / 3]]))
    loo = group_advantages(rewards, sample_mask=mask, normalize_std=False, leave_one_out=True)
    torch.testing.assert_close(loo.advantages, torch.tensor([[1.0, -0.5, 0.0, -0.5]]))


def test_groups_without_signal_are_zero_and_flagged() -> None:
    # G = 1: every group has a single sample.
    single = group_advantages(torch.tensor([3.0, 5.0]), group_size=1, leave_one_out=True)
    assert torch.equal(single.advantages, torch.zeros(2))
    assert single.zero_signal.tolist() == [True, True]
    # identical rewards (0.1 is not exact in binary: the mean may differ from it by an ulp),
    # a group with one valid sample, and a normal group.
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 0.0], [1.0, 0.0, 0.5]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 1]])
    out = group_advantages(rewards, sample_mask=mask, std_eps=1e-12)
    assert torch.equal(out.advantages[:2], torch.zeros(2, 3))
    assert out.zero_signal.tolist() == [True, True, False]
    assert out.advantages[2].abs().min() == 0 and out.advantages[2].abs().max() > 0.9
    metrics = out.metrics()
    assert metrics["groups/zero_signal"].item() == 2
    assert metrics["groups/zero_signal_frac"].item() == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("rewards", "kwargs", "message"),
    [
        (torch.ones(4), {}, "group_size is required"),
        (torch.ones(5), {"group_size": 2}, "divide the 5 rewards"),
        (torch.ones(2, 3), {"group_size": 4}, "disagrees"),
        (torch.ones(2, 2, 2), {}, "got shape"),
        (torch.tensor([1.0, float("nan")]), {"group_size": 2}, "must be finite"),
        (torch.ones(4), {"group_size": 2, "sample_mask": torch.ones(2, 2)}, "sample_mask must have"),
    ],
)
def test_bad_advantage_inputs_raise(rewards: torch.Tensor, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, **kwargs)


@PROPERTY
@given(
    rewards=st.lists(st.floats(-10, 10), min_size=8, max_size=8),
    shifts=st.lists(st.floats(-100, 100), min_size=2, max_size=2),
    normalize_std=st.booleans(),
    leave_one_out=st.booleans(),
)
def test_advantages_are_invariant_to_a_per_group_shift(
    rewards: list[float], shifts: list[float], normalize_std: bool, leave_one_out: bool
) -> None:
    r = torch.tensor(rewards, dtype=torch.float64).reshape(2, 4)
    shifted = r + torch.tensor(shifts, dtype=torch.float64).unsqueeze(-1)
    kwargs = {"normalize_std": normalize_std, "leave_one_out": leave_one_out, "std_eps": 1e-3}
    a, b = group_advantages(r, **kwargs), group_advantages(shifted, **kwargs)
    torch.testing.assert_close(a.advantages, b.advantages, atol=1e-6, rtol=1e-6)
    # a group whose rewards are all equal stays all equal after the shift
    assert torch.equal(a.zero_signal[r.amax(-1) == r.amin(-1)], b.zero_signal[r.amax(-1) == r.amin(-1)])


# -------------------------------------------------------------------------------------- the loss


def test_clipped_loss_and_clip_fractions_by_hand() -> None:
    logprobs = _current()
    loss, metrics = grpo_loss(logprobs, ADV, MASK, CLIP, old_logprobs=OLD)
    assert loss.item() == pytest.approx(1.6 / 5)
    assert metrics["clip/frac_high"].item() == pytest.approx(1 / 5)
    assert metrics["clip/frac_low"].item() == pytest.approx(1 / 5)
    assert metrics["tokens/valid"].item() == 5
    loss.backward()
    # d loss / d logprob = -A * ratio / 5 where unclipped, 0 where clipped or masked
    expected = torch.tensor([[-1.0, 0.0, 0.0], [0.0, 1.1, 2.0]]) / 5
    torch.testing.assert_close(logprobs.grad, expected)


# Per-token losses of the fixture batch: sequence 0 (2 valid tokens) -1 and -1.3, sum -2.3;
# sequence 1 (3 valid tokens) 0.8, 1.1 and 2.0, sum 3.9.
AGGREGATIONS = [
    # DAPO (Yu et al. 2025, "DAPO", eq. 8; verl agg_loss "token-mean"; TRL loss_type="dapo"):
    # sum over every token of the batch / number of tokens.
    ("token-mean", {}, 1.6 / 5),
    # GRPO (Shao et al. 2024, "DeepSeekMath", eq. 3; verl "seq-mean-token-mean"; TRL "grpo"):
    # per-sequence token mean, then the mean over sequences.
    ("seq-mean-token-mean", {}, (-2.3 / 2 + 3.9 / 3) / 2),
    # verl "seq-mean-token-sum": per-sequence token sum, then the mean over sequences.
    ("seq-mean-token-sum", {}, (-2.3 + 3.9) / 2),
    # Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", eq. 3 and its code's
    # constant normaliser; verl "seq-mean-token-sum-norm"; TRL "dr_grpo"): token sums over
    # G * L with the constant L (here 4).
    ("seq-mean-token-sum-norm", {"loss_norm_tokens": 4}, (-2.3 + 3.9) / (2 * 4)),
]


@pytest.mark.parametrize(("mode", "extra", "expected"), AGGREGATIONS)
def test_each_aggregation_by_hand(mode: str, extra: dict, expected: float) -> None:
    """Each ``loss_agg_mode`` against its published formula, by hand: DAPO's token mean (Yu et al.
    2025, eq. 8; verl ``token-mean``; TRL ``loss_type="dapo"``), GRPO's sequence mean of token means
    (Shao et al. 2024, eq. 3; verl ``seq-mean-token-mean``; TRL ``"grpo"``), verl's
    ``seq-mean-token-sum``, and Dr. GRPO's constant normaliser (Liu et al. 2025, eq. 3; verl
    ``seq-mean-token-sum-norm``; TRL ``"dr_grpo"``); the gradient and the denominator too."""
    config = CLIP.model_copy(update={"loss_agg_mode": mode, **extra})
    logprobs = _current()
    loss, _ = grpo_loss(logprobs, ADV, MASK, config, old_logprobs=OLD)
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    # d loss / d logprob = -A * ratio * (the token's weight in the aggregation) where unclipped
    per_token = {
        "token-mean": torch.full((2, 3), 1 / 5),
        "seq-mean-token-mean": torch.tensor([[1 / (2 * 2)] * 3, [1 / (3 * 2)] * 3]),
        "seq-mean-token-sum": torch.full((2, 3), 1 / 2),
        "seq-mean-token-sum-norm": torch.full((2, 3), 1 / 8),
    }[mode]
    unclipped = torch.tensor([[-1.0, 0.0, 0.0], [0.0, 1.1, 2.0]])  # -A * ratio; 0 where clipped/masked
    torch.testing.assert_close(logprobs.grad, unclipped * per_token)
    # the denominator the policy sums over micro-batches
    denominators = {
        "token-mean": 5.0,
        "seq-mean-token-mean": 2.0,
        "seq-mean-token-sum": 2.0,
        "seq-mean-token-sum-norm": 8.0,
    }
    assert loss_denominator(MASK, None, config).item() == denominators[mode]


def test_dr_grpo_needs_its_constant_normaliser() -> None:
    with pytest.raises(ValidationError, match="loss_norm_tokens"):
        GRPOLossConfig(loss_agg_mode="seq-mean-token-sum-norm")


def test_zero_weight_sample_is_the_same_as_dropping_it() -> None:
    weights = torch.tensor([1.0, 0.0])
    weighted, _ = grpo_loss(_current(), ADV, MASK, CLIP, old_logprobs=OLD, sample_weights=weights)
    dropped, _ = grpo_loss(_current()[:1], ADV[:1], MASK[:1], CLIP, old_logprobs=OLD[:1])
    assert weighted.item() == pytest.approx(dropped.item()) == pytest.approx(-2.3 / 2)
    # and with the step's denominator computed as the policy computes it (summed per micro-batch)
    total = sum(loss_denominator(MASK[j : j + 1], weights[j : j + 1], CLIP) for j in range(2))
    parts = [
        grpo_loss(
            _current()[i : i + 1],
            ADV[i : i + 1],
            MASK[i : i + 1],
            CLIP,
            old_logprobs=OLD[i : i + 1],
            sample_weights=weights[i : i + 1],
            normalizer=total,
        )[0]
        for i in range(2)
    ]
    assert sum(p.item() for p in parts) == pytest.approx(-2.3 / 2)


@pytest.mark.parametrize(("mode", "extra", "expected"), AGGREGATIONS)
def test_loss_and_gradient_do_not_depend_on_the_micro_batch_split(
    mode: str, extra: dict, expected: float
) -> None:
    """One micro-batch of four sequences and four of one give the same loss and gradient."""
    config = GRPOLossConfig(loss_agg_mode=mode, kl_coef=0.05, **extra)  # type: ignore[arg-type]
    base, old, behaviour, ref, mask, adv = _random_batch(7, batch=4, length=6)
    weights = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    kwargs = {"old_logprobs": old, "behaviour_logprobs": behaviour, "ref_logprobs": ref}
    whole = base.clone().requires_grad_()
    loss, _ = grpo_loss(whole, adv, mask, config, sample_weights=weights, **kwargs)
    loss.backward()
    split = base.clone().requires_grad_()
    total = sum(loss_denominator(mask[i : i + 1], weights[i : i + 1], config) for i in range(4))
    parts = [
        grpo_loss(
            split[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            config,
            sample_weights=weights[i : i + 1],
            normalizer=total,
            **{k: v[i : i + 1] for k, v in kwargs.items()},
        )[0]
        for i in range(4)
    ]
    split_loss = sum(parts)
    split_loss.backward()
    assert split_loss.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(split.grad, whole.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    # logprobs log 0.5, reference log 0.25: log r = log 0.5
    [("k1", math.log(2)), ("k2", 0.5 * math.log(2) ** 2), ("k3", (0.5 - 1) + math.log(2))],
)
def test_kl_estimators_by_hand(estimator: str, expected: float) -> None:
    value = kl_estimate(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]), estimator)  # type: ignore[arg-type]
    assert value.item() == pytest.approx(expected)


def test_kl_term_enters_the_loss_with_its_coefficient() -> None:
    ref = OLD - math.log(2)  # log r = ref - logprobs
    base = CLIP.model_copy(update={"kl_coef": 0.1, "kl_estimator": "k3"})
    loss, metrics = grpo_loss(_current(), ADV, MASK, base, old_logprobs=OLD, ref_logprobs=ref)
    log_r = (ref - (OLD + RATIOS.log()))[MASK]
    mean_k3 = (log_r.exp() - 1 - log_r).mean().item()
    assert metrics["loss/kl"].item() == pytest.approx(mean_k3)
    assert metrics["loss/pg"].item() == pytest.approx(1.6 / 5)
    assert loss.item() == pytest.approx(1.6 / 5 + 0.1 * mean_k3)


def test_kl_term_is_not_importance_weighted() -> None:
    ref = OLD - math.log(2)
    config = CLIP.model_copy(update={"kl_coef": 0.1, "tis_cap": None})
    behaviour = OLD - math.log(3)  # IS weight 3 on every token
    loss, metrics = grpo_loss(
        _current(), ADV, MASK, config, old_logprobs=OLD, behaviour_logprobs=behaviour, ref_logprobs=ref
    )
    assert metrics["is/weight_mean"].item() == pytest.approx(3.0)
    log_r = (ref - (OLD + RATIOS.log()))[MASK]
    mean_k3 = (log_r.exp() - 1 - log_r).mean().item()
    # the policy-gradient term is weighted by 3, the KL term is not
    assert loss.item() == pytest.approx(3 * 1.6 / 5 + 0.1 * mean_k3)


def test_entropy_bonus_enters_the_loss_with_its_coefficient_and_is_off_by_default() -> None:
    entropy = torch.linspace(0.1, 1.0, MASK.numel()).reshape(MASK.shape).requires_grad_()
    mean_entropy = entropy[MASK].mean().item()
    plain, metrics = grpo_loss(_current(), ADV, MASK, CLIP, old_logprobs=OLD, entropy=entropy)
    assert metrics["loss/entropy"].item() == pytest.approx(mean_entropy)  # the metric without the bonus
    assert plain.item() == pytest.approx(1.6 / 5)
    plain.backward()
    assert entropy.grad is None  # not part of the loss
    bonus = CLIP.model_copy(update={"entropy_coef": 0.01})
    loss, metrics = grpo_loss(_current(), ADV, MASK, bonus, old_logprobs=OLD, entropy=entropy)
    # token-mean over the valid tokens, subtracted: more entropy, lower loss
    assert loss.item() == pytest.approx(1.6 / 5 - 0.01 * mean_entropy)
    loss.backward()
    expected = torch.where(MASK, -0.01 / MASK.sum(), 0.0)
    torch.testing.assert_close(entropy.grad, expected.to(entropy.grad.dtype))
    assert GRPOLossConfig().entropy_coef == 0.0
    with pytest.raises(ValueError, match="entropy_coef=0.01 > 0 needs the policy's entropy"):
        grpo_loss(_current(), ADV, MASK, bonus, old_logprobs=OLD)


def test_reference_is_needed_only_with_a_kl_weight() -> None:
    assert not needs_reference(GRPOLossConfig())
    assert needs_reference(GRPOLossConfig(kl_coef=0.01))
    loss, metrics = grpo_loss(_current(), ADV, MASK, CLIP, old_logprobs=OLD, ref_logprobs=None)
    assert "loss/kl" not in metrics and torch.isfinite(loss)
    with pytest.raises(ValueError, match="kl_coef=0.05 > 0 needs ref_logprobs"):
        grpo_loss(_current(), ADV, MASK, GRPOLossConfig(kl_coef=0.05), old_logprobs=OLD)


def test_truncated_importance_weights_by_hand() -> None:
    # IS weights pi_old / mu of 3 (truncated to 2) and 0.5 on the two valid tokens of one sequence.
    old = torch.log(torch.tensor([[0.3, 0.2]]))
    behaviour = old - torch.log(torch.tensor([[3.0, 0.5]]))
    logprobs = old.clone().requires_grad_()  # ratio 1: per-token pg loss is -A
    config = GRPOLossConfig(tis_cap=2.0)
    loss, metrics = grpo_loss(
        logprobs,
        torch.tensor([1.0]),
        torch.ones(1, 2, dtype=torch.bool),
        config,
        old_logprobs=old,
        behaviour_logprobs=behaviour,
    )
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert metrics["is/frac_truncated"].item() == pytest.approx(0.5)
    assert metrics["is/weight_mean"].item() == pytest.approx(1.25)
    untruncated, _ = grpo_loss(
        old.clone(),
        torch.tensor([1.0]),
        torch.ones(1, 2, dtype=torch.bool),
        GRPOLossConfig(tis_cap=None),
        old_logprobs=old,
        behaviour_logprobs=behaviour,
    )
    assert untruncated.item() == pytest.approx(-(3.0 + 0.5) / 2)
    # without old_logprobs (one optimizer step per rollout batch) the current logprobs, detached,
    # are pi_old: the ratio is exactly 1 and the IS weight is the same pi_old / mu
    current = old.clone().requires_grad_()
    one_step, one_step_metrics = grpo_loss(
        current,
        torch.tensor([1.0]),
        torch.ones(1, 2, dtype=torch.bool),
        config,
        behaviour_logprobs=behaviour,
    )
    assert one_step.item() == pytest.approx(loss.item())
    assert one_step_metrics["ratio/mean"].item() == 1.0
    one_step.backward()
    torch.testing.assert_close(current.grad, -torch.tensor([[2.0, 0.5]]) / 2)
    # proximal_policy="behaviour": vLLM's logprobs are the proximal policy, no IS weight
    bypass_config = GRPOLossConfig(tis_cap=2.0, proximal_policy="behaviour")
    bypass, bypass_metrics = grpo_loss(
        old.clone(),
        torch.tensor([1.0]),
        torch.ones(1, 2, dtype=torch.bool),
        bypass_config,
        behaviour_logprobs=behaviour,
    )
    assert "is/weight_mean" not in bypass_metrics
    # ratios pi / mu = 3 (clipped to 1.28 for A > 0) and 0.5: -(1.28 + 0.5) / 2
    assert bypass.item() == pytest.approx(-(1.28 + 0.5) / 2)
    with pytest.raises(ValueError, match="behaviour_logprobs are required"):
        grpo_loss(
            old.clone(),
            torch.tensor([1.0]),
            torch.ones(1, 2, dtype=torch.bool),
            bypass_config,
            old_logprobs=old,
        )


def test_mismatch_metrics_by_hand() -> None:
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
    vllm = torch.tensor([[-1.1, -2.0, -2.8], [-1.0, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the 9.0 gap is masked
    stats = train_inference_mismatch(trainer, vllm, mask)
    # |deltas| 0.1, 0, 0.2, 0, 0.5 ; sequence sums 0.1 - 0.2 = -0.1 and -0.5
    expected_token = (math.exp(0.1) + 1 + math.exp(0.2) + 1 + math.exp(0.5)) / 5
    assert stats.token_mult_prob_error.item() == pytest.approx(expected_token)
    torch.testing.assert_close(stats.seq_mult_prob_error, torch.tensor([math.exp(0.1), math.exp(0.5)]))
    assert stats.max_abs_logprob_diff.item() == pytest.approx(0.5)


def test_sequence_mismatch_threshold_selects_the_sequences_to_mask() -> None:
    behaviour = OLD.clone()
    behaviour[1, 0] -= 1.0  # sequence 1 has error e^1
    assert mismatch_exceeds(OLD, behaviour, MASK, 2.0).tolist() == [False, True]
    assert mismatch_exceeds(OLD, behaviour, MASK, 3.0).tolist() == [False, False]
    assert mismatch_exceeds(OLD, behaviour, MASK, None).tolist() == [False, False]
    # masking is a weight: the masked sequence leaves numerator and denominator alike (-2.3 / 2,
    # not -2.3 / 5 as when the denominator was counted before the mask was applied)
    weights = (~mismatch_exceeds(OLD, behaviour, MASK, 2.0)).float()
    loss, metrics = grpo_loss(
        _current(),
        ADV,
        MASK,
        CLIP,
        old_logprobs=OLD,
        behaviour_logprobs=behaviour,
        sample_weights=weights,
        normalizer=loss_denominator(MASK, weights, CLIP),
    )
    assert loss.item() == pytest.approx(-2.3 / 2)  # sequence 0 has IS weight 1
    assert metrics["mismatch/seq_mult_prob_error_max"].item() == pytest.approx(1.0)
    _, unmasked = grpo_loss(_current(), ADV, MASK, CLIP, old_logprobs=OLD, behaviour_logprobs=behaviour)
    assert unmasked["mismatch/seq_mult_prob_error_max"].item() == pytest.approx(math.e)
    assert unmasked["mismatch/seq_mult_prob_error"].item() == pytest.approx((1 + math.e) / 2)


def test_metrics_are_detached_and_work_under_no_grad() -> None:
    config = GRPOLossConfig(kl_coef=0.1)
    behaviour = OLD - 0.05
    kwargs = {"old_logprobs": OLD, "behaviour_logprobs": behaviour, "ref_logprobs": OLD - 0.1}
    logprobs = _current()
    loss, metrics = grpo_loss(logprobs, ADV, MASK, config, **kwargs)
    assert loss.requires_grad and not any(v.requires_grad for v in metrics.values())
    assert all(v.dim() == 0 for v in metrics.values())
    loss.backward()
    assert logprobs.grad is not None and logprobs.grad.abs().sum() > 0
    with torch.no_grad():
        no_grad_loss, no_grad_metrics = grpo_loss(_current(), ADV, MASK, config, **kwargs)
    assert no_grad_loss.item() == pytest.approx(loss.item())
    assert no_grad_metrics.keys() == metrics.keys()


def test_bad_loss_inputs_raise() -> None:
    with pytest.raises(ValueError, match=r"advantages must have shape \(2,\)"):
        grpo_loss(_current(), ADV.unsqueeze(-1), MASK, CLIP, old_logprobs=OLD)
    with pytest.raises(ValueError, match="token_mask must have shape"):
        grpo_loss(_current(), ADV, MASK[:, :2], CLIP, old_logprobs=OLD)


def test_config_is_frozen_validated_and_rejects_unknown_fields() -> None:
    config = GRPOLossConfig()
    with pytest.raises(ValidationError):
        config.kl_coef = 1.0  # type: ignore[misc]
    with pytest.raises(ValidationError):
        GRPOLossConfig(clip_ratio=0.2)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        GRPOLossConfig(loss_agg_mode="seq-sum")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        GRPOLossConfig(seq_mismatch_threshold=0.5)


@PROPERTY
@given(
    seed=st.integers(0, 2**31),
    mode=st.sampled_from(
        ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
    ),
)
def test_zero_advantage_gives_zero_gradient(seed: int, mode: str) -> None:
    base, old, behaviour, _, mask, _ = _random_batch(seed, batch=3, length=5)
    logprobs = base.clone().requires_grad_()
    config = GRPOLossConfig(loss_agg_mode=mode, loss_norm_tokens=5)  # type: ignore[arg-type]
    loss, _ = grpo_loss(
        logprobs,
        torch.zeros(3, dtype=torch.float64),
        mask,
        config,
        old_logprobs=old,
        behaviour_logprobs=behaviour,
    )
    loss.backward()
    assert loss.item() == 0 and torch.equal(logprobs.grad, torch.zeros_like(base))


@PROPERTY
@given(seed=st.integers(0, 2**31), eps_low=st.floats(0.0, 0.5), eps_high=st.floats(0.0, 0.5))
def test_ratio_one_is_unclipped_and_loss_is_minus_mean_advantage(
    seed: int, eps_low: float, eps_high: float
) -> None:
    _, old, _, _, mask, adv = _random_batch(seed, batch=4, length=6)
    tokens = mask.sum(-1).to(adv.dtype)
    for mode, expected in (
        ("token-mean", -(adv * tokens).sum() / tokens.sum()),  # each token weighs the same
        ("seq-mean-token-mean", -adv.mean()),  # each sequence weighs the same
    ):
        config = GRPOLossConfig(eps_low=eps_low, eps_high=eps_high, loss_agg_mode=mode)  # type: ignore[arg-type]
        logprobs = old.clone().requires_grad_()
        loss, metrics = grpo_loss(logprobs, adv, mask, config, old_logprobs=old)
        assert metrics["clip/frac_low"].item() == 0 and metrics["clip/frac_high"].item() == 0
        assert metrics["ratio/mean"].item() == pytest.approx(1.0)
        assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
        loss.backward()
        assert torch.all(
            torch.sign(logprobs.grad[mask]) == -torch.sign(adv).unsqueeze(-1).expand_as(mask)[mask]
        )


@PROPERTY
@given(seed=st.integers(0, 2**31), estimator=st.sampled_from(["k1", "k2", "k3"]), kl_coef=st.floats(0.0, 1.0))
def test_masked_tokens_get_zero_gradient(seed: int, estimator: str, kl_coef: float) -> None:
    base, old, behaviour, ref, mask, adv = _random_batch(seed, batch=3, length=7)
    logprobs = base.clone().requires_grad_()
    config = GRPOLossConfig(kl_coef=kl_coef, kl_estimator=estimator, tis_cap=1.5)  # type: ignore[arg-type]
    loss, _ = grpo_loss(
        logprobs,
        adv,
        mask,
        config,
        old_logprobs=old,
        behaviour_logprobs=behaviour,
        ref_logprobs=ref,
        sample_weights=torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64),
    )
    loss.backward()
    assert torch.all(logprobs.grad[~mask] == 0)
    assert torch.all(logprobs.grad[1] == 0)  # the zero-weight sequence


@PROPERTY
@given(log_r=st.floats(-30, 30, allow_subnormal=True))
def test_k3_and_k2_are_non_negative(log_r: float) -> None:
    logprobs = torch.tensor([0.0, -5.0])
    ref = logprobs + log_r
    assert torch.all(kl_estimate(logprobs, ref, "k3") >= 0)
    assert torch.all(kl_estimate(logprobs, ref, "k2") >= 0)


def test_module_imports_only_torch_pydantic_and_the_standard_library() -> None:
    # The trainer's pure maths must load without vLLM, NeMo Gym or Megatron.
    imported: set[str] = set()
    for path in Path(inspect.getfile(grpo)).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported |= {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    outside = {name.split(".")[0] for name in imported if not name.startswith("rl_bridge.grpo")}
    third_party = {name for name in outside if name not in sys.stdlib_module_names and name != "__future__"}
    assert third_party == {"torch", "pydantic"}
