"""Train/inference mismatch: the trainer's logprobs of the generated tokens against vLLM's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rl_bridge.grpo._checks import check_shape

__all__ = ["MismatchStats", "mismatch_exceeds", "train_inference_mismatch"]


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
    check_shape("behaviour_logprobs", behaviour_logprobs, trainer_logprobs.shape)
    check_shape("token_mask", token_mask, trainer_logprobs.shape)
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


def mismatch_exceeds(
    trainer_logprobs: Tensor, behaviour_logprobs: Tensor, token_mask: Tensor, threshold: float | None
) -> Tensor:
    """``[B]`` bool: sequences whose multiplicative probability error exceeds ``threshold``.

    The error is :attr:`MismatchStats.seq_mult_prob_error`, ``exp(|sum_t (trainer - vLLM)|)`` over
    the valid tokens. The loop gives such sequences loss weight 0 *before* the step
    (``GRPOLossConfig.seq_mismatch_threshold``), so they leave the loss's numerator and its
    denominator (:func:`~rl_bridge.grpo.loss.loss_denominator`) alike. ``threshold=None``: none exceeds.
    """
    stats = train_inference_mismatch(trainer_logprobs, behaviour_logprobs, token_mask)
    if threshold is None:
        return torch.zeros_like(stats.seq_mult_prob_error, dtype=torch.bool)
    return (token_mask > 0).any(dim=-1) & (stats.seq_mult_prob_error > threshold)
