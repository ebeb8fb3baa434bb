"""GRPO maths: group advantages, the clipped policy-gradient loss, KL, importance sampling, mismatch.

Pure torch functions with documented shapes; nothing here touches a model, a process group or a
service. Shape letters: ``B`` sequences (samples) in a batch, ``T`` token positions per sequence
(padded), ``V`` vocabulary, ``G`` samples per group (one prompt's generations).

Three log-probability tensors of the generated tokens meet in the loss, as in decoupled PPO
(Hilton et al., "Batch size-invariance for policy optimization", 2021; AReaL uses it for async RL):

- ``behaviour_logprobs``: what vLLM returned when it sampled the tokens (policy ``mu``). In async
  training ``mu`` is an older version of the weights, and even in sync training vLLM's numerics
  differ from the trainer's.
- ``old_logprobs``: the trainer's own logprobs with the weights at the start of the rollout
  batch's updates (the proximal policy ``pi_old``). With several optimizer steps per rollout
  batch (PPO mini-batches or epochs) they come from a separate forward pass before the first
  update; with one step they are the training forward's own detached logprobs (the same values,
  one forward fewer), which is what ``old_logprobs=None`` means with
  ``proximal_policy="trainer"``.
- ``logprobs``: the trainer's current policy ``pi_theta``, the only tensor with a gradient.

The PPO ratio ``pi_theta / pi_old`` is clipped (trust region around the proximal policy); the
importance-sampling weight ``pi_old / mu`` (detached, truncated at ``tis_cap``) corrects for the
tokens having been sampled from ``mu``; and the train/inference mismatch metrics compare ``mu``
with the trainer's ``pi_old``. With ``proximal_policy="behaviour"`` vLLM's ``mu`` is itself the
proximal policy (decoupled PPO's "bypass" mode, as in AReaL and verl): the ratio
``pi_theta / mu`` is clipped and there is no separate IS weight.

Aggregation (``loss_agg_mode``) follows verl's names; numerator and denominator always run over
the same tokens (those of sequences with a positive weight), and the denominator of a step split
into micro-batches and data-parallel ranks is the sum of :func:`loss_denominator` over all of them,
so the loss and its gradient do not depend on the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator
from torch import Tensor

__all__ = [
    "GRPOLossConfig",
    "GroupAdvantages",
    "KLEstimator",
    "LossAggMode",
    "MismatchStats",
    "ProximalPolicy",
    "group_advantages",
    "grpo_loss",
    "kl_estimate",
    "loss_denominator",
    "mismatch_exceeds",
    "needs_reference",
    "selective_log_softmax",
    "train_inference_mismatch",
]

KLEstimator = Literal["k1", "k2", "k3"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
ProximalPolicy = Literal["trainer", "behaviour"]

_MAX_ABS_LOG_RATIO = 20.0
"""Bound on ``log(pi_theta / pi_old)`` before ``exp``, a numerical guard as in verl's PPO loss."""


class GRPOLossConfig(BaseModel):
    """Every knob of the GRPO advantages and loss. Frozen; unknown fields are rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    normalize_std: bool = True
    """Divide each group's advantages by the group's reward std (Bessel-corrected, valid samples
    only) plus ``std_eps``, as in GRPO. False keeps the raw ``reward - baseline``: one half of
    Dr. GRPO (Liu et al. 2025); its other half is ``loss_agg_mode="seq-mean-token-sum-norm"``."""
    leave_one_out: bool = False
    """Baseline each sample with the mean of the *other* valid samples of its group (RLOO,
    Ahmadian et al. 2024) instead of the group mean including itself."""
    std_eps: float = Field(default=1e-6, ge=0.0)
    """Added to the group std before dividing, in reward units."""

    eps_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Lower clip: the ratio ``pi_theta / pi_old`` is clipped below at ``1 - eps_low``."""
    eps_high: float = Field(default=0.28, ge=0.0)
    """Upper clip: the ratio is clipped above at ``1 + eps_high``. Defaults to DAPO's
    "clip-higher" value (Yu et al. 2025), which keeps low-probability tokens able to grow."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses ``l[i, t]`` of sequences ``i`` (weights ``w_i``, ``n_i`` valid tokens)
    become a scalar; names and meanings as in verl's ``agg_loss``:

    - ``"token-mean"``: ``sum_i w_i sum_t l / sum_i w_i n_i``: every token weighs the same, over
      the whole step (DAPO, Yu et al. 2025; TRL's ``loss_type="dapo"``);
    - ``"seq-mean-token-mean"``: ``sum_i w_i (sum_t l / n_i) / sum_i w_i``: every sequence weighs
      the same (the original GRPO, Shao et al. 2024; TRL's ``loss_type="grpo"``);
    - ``"seq-mean-token-sum"``: ``sum_i w_i sum_t l / sum_i w_i``: longer sequences weigh more;
    - ``"seq-mean-token-sum-norm"``: ``sum_i w_i sum_t l / (L * sum_i w_i)`` with the constant
      ``L = loss_norm_tokens``: Dr. GRPO's length-unbiased normaliser (Liu et al. 2025; TRL's
      ``loss_type="dr_grpo"``), paired with ``normalize_std=False`` for the whole of Dr. GRPO.
    """
    loss_norm_tokens: PositiveInt | None = None
    """The constant ``L`` of ``seq-mean-token-sum-norm`` (Dr. GRPO uses the generation budget, the
    most tokens a response may have); required by that mode, unused by the others."""
    proximal_policy: ProximalPolicy = "trainer"
    """The policy the PPO ratio is taken against. ``"trainer"``: ``pi_old``, the trainer's own
    logprobs before the rollout batch's first update, with the truncated IS weight ``pi_old / mu``
    for the tokens having been sampled by vLLM (standard PPO/GRPO). ``"behaviour"``: vLLM's
    logprobs ``mu`` (decoupled PPO's bypass mode, for async runs whose groups are several weight
    versions old): the clipped ratio ``pi_theta / mu`` corrects for the staleness itself, no IS
    weight is applied and no recomputation of ``pi_old`` is ever needed."""

    kl_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the KL penalty to the reference policy. 0 disables it and the reference
    logprobs are then not needed at all (see :func:`needs_reference`)."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL estimator, see :func:`kl_estimate`."""

    entropy_coef: float = Field(default=0.0, ge=0.0)
    """Weight of an entropy bonus: ``loss -= entropy_coef * agg(H)``, with ``H`` each trained
    token's entropy (nats) of the distribution it was sampled from (after temperature, over the
    sampling support and grammar masks), aggregated like the policy gradient. It keeps the policy
    from turning deterministic before the reward has taught it (PPO's entropy term, Schulman et al.
    2017; verl's ``entropy_coeff``). A departure from the textbook GRPO loss, off by default;
    ``loss/entropy`` is reported whether or not it is on."""

    use_importance_sampling: bool = True
    """With ``proximal_policy="trainer"``, weight each token's policy-gradient term by
    ``pi_old / mu`` when vLLM's ``behaviour_logprobs`` are given (off-policy correction for
    async samples and for vLLM/trainer numerics). The KL term is never IS-weighted."""
    tis_cap: float | None = Field(default=2.0, gt=0.0)
    """Truncate the importance weight at this value (truncated IS, "TIS"); None: no truncation."""

    seq_mismatch_threshold: float | None = Field(default=None, gt=1.0)
    """Mask (loss weight 0) every sequence whose sequence multiplicative probability error
    ``exp(|sum_t (trainer - vLLM logprob)|)`` exceeds this, before the step (the loop counts them
    in ``mismatch/masked_seqs``; masked sequences leave numerator and denominator alike: see
    :func:`mismatch_exceeds`); None: only log the error. A departure from the textbook loss, off
    by default."""

    @model_validator(mode="after")
    def _check(self) -> GRPOLossConfig:
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_norm_tokens is None:
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' divides by a constant token count: set "
                "loss_norm_tokens (Dr. GRPO uses the generation budget, rollout.max_output_tokens)"
            )
        return self


def needs_reference(config: GRPOLossConfig) -> bool:
    """Whether the loop must compute reference-policy logprobs for this config (``kl_coef > 0``)."""
    return config.kl_coef > 0


# ---------------------------------------------------------------------------------------------
# Per-token logprobs
# ---------------------------------------------------------------------------------------------


def selective_log_softmax(
    logits: Tensor, ids: Tensor, *, temperature: float = 1.0, chunk_tokens: int = 512
) -> Tensor:
    """Log-probability of ``ids`` under ``softmax(logits / temperature)``, in fp32.

    Naive equivalent (the test oracle)::

        torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    The naive form materialises a full fp32 ``[..., V]`` log-softmax; here the positions are
    processed ``chunk_tokens`` at a time and only a logsumexp per position is kept, so the extra
    forward memory is ``chunk_tokens * V * 4`` bytes (about 311 MB for 512 positions of a
    151,936-token vocabulary). Under autograd each chunk's fp32 copy is still saved for backward.

    Temperature: vLLM's ``--logprobs-mode raw_logprobs`` (its default) returns logprobs of the
    *unscaled* logits, while ``processed_logprobs`` returns them after temperature (and after
    top-k/top-p and penalties, which this function does not apply). Pass the sampling
    temperature here when vLLM runs with ``processed_logprobs``, and 1.0 with ``raw_logprobs``, so
    the trainer's logprobs are comparable with vLLM's. The importance weights and mismatch
    metrics of :func:`grpo_loss` assume vLLM's logprobs are those of the distribution the tokens
    were sampled from, so sampling at a temperature other than 1 calls for ``processed_logprobs``
    (without top-k/top-p) and the same temperature here.

    Args:
        logits: ``[..., V]`` any float dtype; position ``t`` scores token ``ids[..., t]`` (shift
            the model's output by one before calling).
        ids: ``[...]`` integer token ids, the leading shape of ``logits``.
        temperature: divides the logits, > 0.
        chunk_tokens: positions processed per chunk, > 0.

    Returns:
        ``[...]`` fp32 logprobs, differentiable with respect to ``logits``.
    """
    if logits.shape[:-1] != ids.shape:
        raise ValueError(
            f"ids must have the leading shape of logits: logits {tuple(logits.shape)}, ids {tuple(ids.shape)}"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor, got {ids.dtype}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V)
    flat_ids = ids.reshape(-1)  # (N,)
    if flat_ids.numel() == 0:
        return logits.new_zeros(ids.shape, dtype=torch.float32)
    chunks = []
    for chunk_logits, chunk_ids in zip(
        flat_logits.split(chunk_tokens), flat_ids.split(chunk_tokens), strict=True
    ):
        scaled = chunk_logits.float() / temperature  # (n, V) fp32
        picked = scaled.gather(-1, chunk_ids.unsqueeze(-1)).squeeze(-1)  # (n,)
        chunks.append(picked - torch.logsumexp(scaled, dim=-1))
    return torch.cat(chunks).reshape(ids.shape)


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of a batch of groups and which groups carry no learning signal."""

    advantages: Tensor
    """Shape of the rewards given (``[num_groups * G]`` or ``[num_groups, G]``); 0 for masked
    samples and for every sample of a zero-signal group."""
    zero_signal: Tensor
    """``[num_groups]`` bool: the group has fewer than two valid samples, or all its valid
    rewards are equal, so its advantages are exactly 0 and it contributes no gradient."""

    def metrics(self) -> dict[str, Tensor]:
        """``groups/zero_signal`` (count) and ``groups/zero_signal_frac``, detached 0-dim floats."""
        zero = self.zero_signal.float()
        return {"groups/zero_signal": zero.sum(), "groups/zero_signal_frac": zero.mean()}


def group_advantages(
    rewards: Tensor,
    *,
    group_size: int | None = None,
    sample_mask: Tensor | None = None,
    normalize_std: bool = True,
    leave_one_out: bool = False,
    std_eps: float = 1e-6,
) -> GroupAdvantages:
    """Group-normalised advantages: ``(reward - baseline) / (group std + std_eps)``.

    Over the valid samples of a group (``n`` of them): the baseline is the group mean, or with
    ``leave_one_out`` the mean of the other ``n - 1`` (RLOO; the advantage is then
    ``n / (n - 1)`` times the mean-baseline one). The std, when ``normalize_std``, is the
    Bessel-corrected std of the valid rewards (``n - 1`` in the denominator), in both cases.

    Masked samples (``sample_mask`` 0, e.g. a clip the policy could not process) do not enter
    their group's baseline or std, get advantage 0, and may carry any reward, NaN included. A
    group with a single valid sample (always the case when ``G == 1``) or with identical valid
    rewards has no signal: its advantages are exactly 0 (not ``tiny / eps``) and it is flagged in
    ``zero_signal`` so the trainer can count it.

    Args:
        rewards: ``[num_groups * G]`` (groups contiguous) or ``[num_groups, G]``.
        group_size: ``G``; required for 1-D rewards, and must match ``rewards.shape[1]`` if given
            with 2-D rewards.
        sample_mask: rewards' shape, bool or loss weights; a sample is valid where it is > 0.
            None: all valid.
        normalize_std: divide by the group std (GRPO); False keeps ``reward - baseline``.
        leave_one_out: use the RLOO baseline.
        std_eps: added to the std, in reward units, >= 0.

    Raises:
        ValueError: bad shapes, ``group_size``, ``std_eps``, or a non-finite valid reward.
    """
    if std_eps < 0:
        raise ValueError(f"std_eps must be >= 0, got {std_eps}")
    grouped = _as_groups(rewards, group_size)  # (num_groups, G)
    if sample_mask is None:
        valid = torch.ones_like(grouped, dtype=torch.bool)
    else:
        _check_shape("sample_mask", sample_mask, rewards.shape)
        valid = sample_mask.reshape(grouped.shape) > 0
    r = grouped if grouped.dtype.is_floating_point else grouped.float()
    if not torch.isfinite(r[valid]).all():
        raise ValueError("rewards of valid samples must be finite (mask unscorable samples instead)")

    n = valid.sum(dim=-1, keepdim=True)  # (num_groups, 1)
    r_valid = torch.where(valid, r, 0.0)
    total = r_valid.sum(dim=-1, keepdim=True)
    mean = total / n.clamp(min=1)
    baseline = (total - r_valid) / (n - 1).clamp(min=1) if leave_one_out else mean
    advantages = r - baseline
    if normalize_std:
        sq_dev = torch.where(valid, r - mean, 0.0).square()
        std = (sq_dev.sum(dim=-1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        advantages = advantages / (std + std_eps)

    r_max = torch.where(valid, r, -torch.inf).amax(dim=-1)
    r_min = torch.where(valid, r, torch.inf).amin(dim=-1)
    zero_signal = (n.squeeze(-1) < 2) | (r_max == r_min)  # (num_groups,)
    advantages = torch.where(valid & ~zero_signal.unsqueeze(-1), advantages, 0.0)
    return GroupAdvantages(advantages=advantages.reshape(rewards.shape), zero_signal=zero_signal)


def _as_groups(rewards: Tensor, group_size: int | None) -> Tensor:
    """``rewards`` viewed as ``[num_groups, G]``, with the shape checks of :func:`group_advantages`."""
    if rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(
                f"group_size {group_size} disagrees with 2-D rewards of shape {tuple(rewards.shape)}"
            )
        return rewards
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be [num_groups * G] or [num_groups, G], got shape {tuple(rewards.shape)}"
        )
    if group_size is None:
        raise ValueError("group_size is required for 1-D rewards")
    if group_size <= 0 or rewards.numel() % group_size:
        raise ValueError(f"group_size must be > 0 and divide the {rewards.numel()} rewards, got {group_size}")
    return rewards.reshape(-1, group_size)


# ---------------------------------------------------------------------------------------------
# KL and mismatch
# ---------------------------------------------------------------------------------------------


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
    _check_shape("ref_logprobs", ref_logprobs, logprobs.shape)
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


@dataclass(frozen=True)
class MismatchStats:
    """Train/inference mismatch between the trainer's and vLLM's logprobs of the same tokens."""

    token_mult_prob_error: Tensor
    """0-dim: mean over valid tokens of ``exp(|trainer - vLLM|)`` (1.0 means identical; NeMo RL's
    TMPE). 1.0 when there is no valid token."""
    seq_mult_prob_error: Tensor
    """``[B]``: per sequence ``exp(|sum over valid tokens of (trainer - vLLM)|)``, the ratio of the
    two sequence probabilities (1.0 for a sequence without valid tokens). May be ``inf`` for a
    long, badly mismatched sequence; it is logged raw."""
    max_abs_logprob_diff: Tensor
    """0-dim: largest ``|trainer - vLLM|`` over valid tokens (0.0 when there is none)."""


def train_inference_mismatch(
    trainer_logprobs: Tensor, behaviour_logprobs: Tensor, token_mask: Tensor
) -> MismatchStats:
    """Mismatch statistics over the valid tokens, computed without gradient.

    Args:
        trainer_logprobs: ``[B, T]`` the trainer's logprobs of the generated tokens (``pi_old``).
        behaviour_logprobs: ``[B, T]`` vLLM's logprobs of the same tokens.
        token_mask: ``[B, T]`` bool or 0/1; which positions are generated tokens.
    """
    _check_shape("behaviour_logprobs", behaviour_logprobs, trainer_logprobs.shape)
    _check_shape("token_mask", token_mask, trainer_logprobs.shape)
    with torch.no_grad():
        valid = token_mask > 0
        diff = torch.where(valid, trainer_logprobs.float() - behaviour_logprobs.float(), 0.0)  # (B, T)
        abs_diff = diff.abs()
        num_valid = valid.sum()
        token_error = torch.where(valid, abs_diff.exp(), 0.0).sum() / num_valid.clamp(min=1)
        return MismatchStats(
            token_mult_prob_error=torch.where(num_valid > 0, token_error, 1.0),
            seq_mult_prob_error=diff.sum(dim=-1).abs().exp(),
            max_abs_logprob_diff=abs_diff.amax() if abs_diff.numel() else abs_diff.new_zeros(()),
        )


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def mismatch_exceeds(
    trainer_logprobs: Tensor, behaviour_logprobs: Tensor, token_mask: Tensor, threshold: float | None
) -> Tensor:
    """``[B]`` bool: sequences whose multiplicative probability error exceeds ``threshold``.

    The error is :attr:`MismatchStats.seq_mult_prob_error`, ``exp(|sum_t (trainer - vLLM)|)`` over
    the valid tokens. The loop gives such sequences loss weight 0 *before* the step
    (``GRPOLossConfig.seq_mismatch_threshold``), so they leave the loss's numerator and its
    denominator (:func:`loss_denominator`) alike. ``threshold=None``: none exceeds.
    """
    stats = train_inference_mismatch(trainer_logprobs, behaviour_logprobs, token_mask)
    if threshold is None:
        return torch.zeros_like(stats.seq_mult_prob_error, dtype=torch.bool)
    return (token_mask > 0).any(dim=-1) & (stats.seq_mult_prob_error > threshold)


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
    _check_shape("sample_weights", weights, token_mask.shape[:1])
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
        f"Unsupported loss_agg_mode: {config.loss_agg_mode!r}. Supported modes are: {list(get_args(LossAggMode))}"
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
    is applied. ``agg`` is the config's ``loss_agg_mode`` (see :class:`GRPOLossConfig`) weighted by
    ``sample_weights``; zero-advantage sequences stay in it (they add no policy gradient, but
    their tokens count and their KL term acts).

    A token is valid where ``token_mask`` > 0 and its sequence's weight > 0. Masking sequences for
    train/inference mismatch is done by the caller, with weights (:func:`mismatch_exceeds`).

    Args:
        logprobs: ``[B, T]`` current-policy logprobs of the generated tokens (with gradient).
        advantages: ``[B]`` one advantage per sequence (see :func:`group_advantages`).
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
        :meth:`GroupAdvantages.metrics`.

    Raises:
        ValueError: a shape mismatch (naming the input), ``proximal_policy="behaviour"`` without
            ``behaviour_logprobs``, ``kl_coef > 0`` without ``ref_logprobs``, or
            ``entropy_coef > 0`` without ``entropy``.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    batch_size = logprobs.shape[0]
    _check_shape("advantages", advantages, (batch_size,))
    _check_shape("token_mask", token_mask, logprobs.shape)
    for name, tensor in (("old_logprobs", old_logprobs), ("behaviour_logprobs", behaviour_logprobs)):
        if tensor is not None:
            _check_shape(name, tensor, logprobs.shape)
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
        _check_shape("ref_logprobs", ref_logprobs, logprobs.shape)
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} > 0 needs the policy's entropy; got None")
    if entropy is not None:
        _check_shape("entropy", entropy, logprobs.shape)
    if sample_weights is None:
        weights = logprobs.new_ones(batch_size)
    else:
        _check_shape("sample_weights", sample_weights, (batch_size,))
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


def _check_shape(name: str, tensor: Tensor, shape: tuple[int, ...] | torch.Size) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")
