"""Group-normalised advantages (GRPO, RLOO) and which groups carry no learning signal."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rl_bridge.grpo._checks import check_shape

__all__ = ["GroupAdvantages", "group_advantages"]


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
        check_shape("sample_mask", sample_mask, rewards.shape)
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
