"""The clipped GRPO policy-gradient loss with its KL penalty, entropy bonus and truncated IS weight,
and the aggregation's denominator (see the package docstring for the three logprob tensors)."""

from __future__ import annotations

from typing import get_args

import torch
from torch import Tensor

from rl_bridge.grpo._checks import check_shape
from rl_bridge.grpo.config import GRPOLossConfig, KLEstimator, LossAggMode
from rl_bridge.grpo.mismatch import train_inference_mismatch

__all__ = ["grpo_loss", "kl_estimate", "loss_denominator"]

_MAX_ABS_LOG_RATIO = 20.0
"""Bound on ``log(pi_theta / pi_old)`` before ``exp``, a numerical guard as in verl's PPO loss."""


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of ``KL(pi_theta || pi_ref)`` from tokens sampled from ``pi_theta``.

    Estimators from J. Schulman, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html),
    with ``log_r = ref_logprobs - logprobs``:

    - ``k1 = -log_r``: unbiased, high variance, can be negative per token.
    - ``k2 = log_r ** 2 / 2``: biased, low variance, >= 0.
    - ``k3 = (exp(log_r) - 1) - log_r``: unbiased, low variance, >= 0 (computed with ``expm1``,
      so it stays >= 0 in floating point). GRPO's default.

    Used as a loss term on tokens from ``pi_theta`` (the sampling not differentiated), the
    expected gradient of ``k1`` is 0, that of ``k2`` is the gradient of ``KL(pi_theta || pi_ref)``
    and that of ``k3`` the gradient of the forward ``KL(pi_ref || pi_theta)``.

    Args:
        logprobs, ref_logprobs: ``[B, T]`` (any equal shapes) logprobs of the sampled tokens.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        Same shape, unmasked.
    """
    check_shape("ref_logprobs", ref_logprobs, logprobs.shape)
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(
        f"Unsupported KL estimator: {estimator!r}. Supported estimators are: {list(get_args(KLEstimator))}"
    )


def loss_denominator(token_mask: Tensor, sample_weights: Tensor | None, config: GRPOLossConfig) -> Tensor:
    """The denominator of ``config.loss_agg_mode`` over these sequences (fp64, 0-dim).

    ``token-mean``: ``sum_i w_i n_i``; ``seq-mean-token-mean`` and ``seq-mean-token-sum``:
    ``sum_i w_i`` over sequences with a valid token; ``seq-mean-token-sum-norm``: that times
    ``loss_norm_tokens``. A token is valid where ``token_mask`` > 0 and its sequence's weight > 0,
    exactly as in :func:`grpo_loss`'s numerator. Sum it over every micro-batch and data-parallel
    rank of a step and pass the sum as :func:`grpo_loss`'s ``normalizer``: the parts' losses then
    sum to the step's loss.

    Args:
        token_mask: ``[B, T]`` bool or 0/1.
        sample_weights: ``[B]`` loss weights; None: all 1.
        config: the loss knobs.
    """
    weights = (
        torch.ones(token_mask.shape[0], dtype=torch.float64, device=token_mask.device)
        if sample_weights is None
        else sample_weights.detach().double()
    )
    check_shape("sample_weights", weights, token_mask.shape[:1])
    valid = (token_mask > 0) & (weights > 0).unsqueeze(-1)  # (B, T)
    tokens = valid.sum(dim=-1).double()  # (B,)
    if config.loss_agg_mode == "token-mean":
        return (weights * tokens).sum()
    sequences = torch.where(tokens > 0, weights, 0.0).sum()
    if config.loss_agg_mode == "seq-mean-token-sum-norm":
        assert config.loss_norm_tokens is not None  # the config's validator
        return sequences * config.loss_norm_tokens
    if config.loss_agg_mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return sequences
    raise ValueError(
        f"Unsupported loss_agg_mode: {config.loss_agg_mode!r}. "
        f"Supported modes are: {list(get_args(LossAggMode))}"
    )


def grpo_loss(
    logprobs: Tensor,
    advantages: Tensor,
    token_mask: Tensor,
    config: GRPOLossConfig,
    *,
    old_logprobs: Tensor | None = None,
    behaviour_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    sample_weights: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GRPO policy-gradient loss with optional KL penalty, entropy bonus and truncated IS
    correction.

    Per valid token, with ``ratio = exp(logprobs - proximal)``::

        pg   = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
        is_w = min(exp(pi_old - behaviour_logprobs), tis_cap)   # detached; 1 if unused
        kl   = kl_estimate(logprobs, ref_logprobs)              # only if kl_coef > 0
        loss = agg(is_w * pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)

    ``proximal`` is, with ``config.proximal_policy="trainer"``, ``old_logprobs`` when given and
    otherwise ``logprobs.detach()`` (one optimizer step per rollout batch: the weights have not
    moved since the tokens' ``pi_old`` was defined, so the ratio is exactly 1 and the gradient is
    the plain policy gradient); with ``"behaviour"`` it is ``behaviour_logprobs`` and no IS weight
    is applied. ``agg`` is the config's ``loss_agg_mode`` (see
    :class:`~rl_bridge.grpo.config.GRPOLossConfig`) weighted by ``sample_weights``; zero-advantage
    sequences stay in it (they add no policy gradient, but their tokens count and their KL term
    acts).

    A token is valid where ``token_mask`` > 0 and its sequence's weight > 0. Masking sequences for
    train/inference mismatch is done by the caller, with weights
    (:func:`~rl_bridge.grpo.mismatch.mismatch_exceeds`).

    Args:
        logprobs: ``[B, T]`` current-policy logprobs of the generated tokens (with gradient).
        advantages: ``[B]`` one advantage per sequence (see
            :func:`~rl_bridge.grpo.advantages.group_advantages`).
        token_mask: ``[B, T]`` bool or 0/1: positions that are trained (generated tokens of
            trainable turns); everything else gets zero gradient.
        config: the loss knobs.
        old_logprobs: ``[B, T]`` the trainer's logprobs before the rollout batch's first update
            (``pi_old``); None: the batch gets one optimizer step and ``logprobs.detach()`` are
            ``pi_old`` (``proximal_policy="trainer"``), or they are not used (``"behaviour"``).
        behaviour_logprobs: ``[B, T]`` vLLM's logprobs (``mu``); needed for the IS weight, the
            mismatch metrics and ``proximal_policy="behaviour"``.
        ref_logprobs: ``[B, T]`` reference-policy logprobs; required if and only if
            ``kl_coef > 0`` (None is accepted and ignored otherwise).
        sample_weights: ``[B]`` loss weight per sequence (0 removes a sequence from numerator and
            denominator); None: all 1.
        normalizer: the aggregation's denominator. None: this call's own
            :func:`loss_denominator`. Pass the sum of :func:`loss_denominator` over the whole
            step's micro-batches (and data-parallel ranks), so the parts sum to the step's loss.
        entropy: ``[B, T]`` each position's entropy of the current policy (with gradient);
            required if and only if ``entropy_coef > 0``; when given, ``loss/entropy`` is reported.

    Returns:
        ``(loss, metrics)``: the 0-dim loss, and detached 0-dim float tensors keyed
        ``loss/total``, ``loss/pg``, ``clip/frac_low``, ``clip/frac_high``, ``clip/frac``,
        ``ratio/mean``, ``tokens/valid``; with ``kl_coef > 0`` also ``loss/kl`` (mean KL estimate
        over valid tokens); with ``entropy`` also ``loss/entropy`` (its mean over valid tokens);
        with IS weights also ``is/weight_mean``, ``is/frac_truncated``; with
        ``behaviour_logprobs`` also ``mismatch/token_mult_prob_error``,
        ``mismatch/seq_mult_prob_error`` (mean over sequences), ``mismatch/seq_mult_prob_error_max``,
        ``mismatch/max_abs_logprob_diff``. Token fractions and means are over this call's valid
        tokens. ``clip/frac_low`` counts tokens whose ratio is below ``1 - eps_low`` with a negative
        advantage, ``clip/frac_high`` above ``1 + eps_high`` with a positive one: exactly the
        tokens the clip takes the gradient from. Group metrics come from
        :meth:`~rl_bridge.grpo.advantages.GroupAdvantages.metrics`.

    Raises:
        ValueError: a shape mismatch (naming the input), ``proximal_policy="behaviour"`` without
            ``behaviour_logprobs``, ``kl_coef > 0`` without ``ref_logprobs``, or
            ``entropy_coef > 0`` without ``entropy``.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    batch_size = logprobs.shape[0]
    check_shape("advantages", advantages, (batch_size,))
    check_shape("token_mask", token_mask, logprobs.shape)
    for name, tensor in (("old_logprobs", old_logprobs), ("behaviour_logprobs", behaviour_logprobs)):
        if tensor is not None:
            check_shape(name, tensor, logprobs.shape)
    pi_old = old_logprobs.detach() if old_logprobs is not None else logprobs.detach()
    proximal = pi_old
    if config.proximal_policy == "behaviour":
        if behaviour_logprobs is None:
            raise ValueError(
                "proximal_policy='behaviour' takes the ratio against vLLM's logprobs: "
                "behaviour_logprobs are required"
            )
        proximal = behaviour_logprobs.detach()
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(f"kl_coef={config.kl_coef} > 0 needs ref_logprobs; got None")
        check_shape("ref_logprobs", ref_logprobs, logprobs.shape)
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} > 0 needs the policy's entropy; got None")
    if entropy is not None:
        check_shape("entropy", entropy, logprobs.shape)
    if sample_weights is None:
        weights = logprobs.new_ones(batch_size)
    else:
        check_shape("sample_weights", sample_weights, (batch_size,))
        weights = sample_weights.to(logprobs.dtype)
    metrics: dict[str, Tensor] = {}
    valid = (token_mask > 0) & (weights > 0).unsqueeze(-1)  # (B, T)
    token_weights = torch.where(valid, weights.unsqueeze(-1), 0.0)  # (B, T)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)  # (B, 1)

    # Train/inference mismatch: the trainer's pi_old against vLLM's mu.
    if behaviour_logprobs is not None:
        stats = train_inference_mismatch(pi_old, behaviour_logprobs, valid)
        with torch.no_grad():
            seq_error = stats.seq_mult_prob_error[valid.any(dim=-1)]
            metrics["mismatch/token_mult_prob_error"] = stats.token_mult_prob_error
            metrics["mismatch/seq_mult_prob_error"] = (
                seq_error.mean() if seq_error.numel() else seq_error.new_ones(())
            )
            metrics["mismatch/seq_mult_prob_error_max"] = (
                seq_error.amax() if seq_error.numel() else seq_error.new_ones(())
            )
            metrics["mismatch/max_abs_logprob_diff"] = stats.max_abs_logprob_diff

    # Policy ratio against the proximal policy, clipped asymmetrically.
    log_ratio = (logprobs - proximal).clamp(-_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)
    ratio = torch.exp(log_ratio)  # (B, T)
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * torch.clamp(ratio, 1 - config.eps_low, 1 + config.eps_high)
    per_token_pg = torch.max(pg_loss1, pg_loss2)

    # Truncated importance weight pi_old / mu for tokens sampled by mu (policy gradient only).
    if (
        config.proximal_policy == "trainer"
        and config.use_importance_sampling
        and behaviour_logprobs is not None
    ):
        raw_is_weight = torch.exp(pi_old - behaviour_logprobs.detach())  # (B, T)
        is_weight = raw_is_weight if config.tis_cap is None else raw_is_weight.clamp(max=config.tis_cap)
        per_token_pg = is_weight * per_token_pg
        with torch.no_grad():
            metrics["is/weight_mean"] = _masked_mean(is_weight, valid)
            truncated = (
                raw_is_weight > config.tis_cap if config.tis_cap is not None else torch.zeros_like(valid)
            )
            metrics["is/frac_truncated"] = _masked_mean(truncated, valid)

    if normalizer is None:
        normalizer = loss_denominator(token_mask, weights, config)
    pg_loss = _aggregate(per_token_pg, token_weights, valid, config.loss_agg_mode, normalizer)
    loss = pg_loss

    per_token_kl: Tensor | None = None
    if config.kl_coef > 0:
        assert ref_logprobs is not None  # checked above
        per_token_kl = kl_estimate(logprobs, ref_logprobs.detach(), config.kl_estimator)
        loss = loss + config.kl_coef * _aggregate(
            per_token_kl, token_weights, valid, config.loss_agg_mode, normalizer
        )

    if config.entropy_coef > 0:
        assert entropy is not None  # checked above
        loss = loss - config.entropy_coef * _aggregate(
            entropy, token_weights, valid, config.loss_agg_mode, normalizer
        )

    with torch.no_grad():
        clipped_low = (ratio < 1 - config.eps_low) & (adv < 0)
        clipped_high = (ratio > 1 + config.eps_high) & (adv > 0)
        metrics["loss/total"] = loss.detach()
        metrics["loss/pg"] = pg_loss.detach()
        metrics["clip/frac_low"] = _masked_mean(clipped_low, valid)
        metrics["clip/frac_high"] = _masked_mean(clipped_high, valid)
        metrics["clip/frac"] = _masked_mean(clipped_low | clipped_high, valid)
        metrics["ratio/mean"] = _masked_mean(ratio, valid)
        metrics["tokens/valid"] = valid.sum().float()
        if per_token_kl is not None:
            metrics["loss/kl"] = _masked_mean(per_token_kl, valid)
        if entropy is not None:
            metrics["loss/entropy"] = _masked_mean(entropy, valid)
    return loss, metrics


def _masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    """Detached fp32 mean of ``values`` over ``valid`` positions (0.0 when there is none)."""
    values = values.detach().float()
    return torch.where(valid, values, 0.0).sum() / valid.sum().clamp(min=1)


def _aggregate(
    per_token: Tensor, token_weights: Tensor, valid: Tensor, mode: LossAggMode, normalizer: float | Tensor
) -> Tensor:
    """Weighted ``[B, T]`` per-token values to a scalar by ``mode`` (see ``GRPOLossConfig.loss_agg_mode``),
    divided by ``normalizer`` (:func:`loss_denominator` of the whole step).

    A zero ``normalizer`` (nothing valid) gives a zero loss that still backpropagates (zeros).
    """
    weighted = torch.where(valid, per_token * token_weights, 0.0)  # (B, T)
    if isinstance(normalizer, Tensor):
        denominator = normalizer.to(per_token.dtype).clamp(min=1e-12)
    else:
        denominator = max(float(normalizer), 1e-12)
    if mode == "seq-mean-token-mean":
        seq_tokens = valid.sum(dim=-1).clamp(min=1)  # (B,)
        return (weighted.sum(dim=-1) / seq_tokens).sum() / denominator
    if mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        return weighted.sum() / denominator
    raise ValueError(
        f"Unsupported loss_agg_mode: {mode!r}. Supported modes are: {list(get_args(LossAggMode))}"
    )
