"""A training step's loss, as :meth:`~rl_bridge.megatron.policy.MegatronPolicy.train_step` calls it,
and what the step reports.

The loss is evaluated one micro-batch at a time (:class:`PolicyLoss`); its parts are divided by a
normaliser summed over the whole step (:class:`StepCounts`), so they sum to the step's loss
whatever the split into micro-batches and data-parallel ranks. :class:`GRPOPolicyLoss` is
:func:`rl_bridge.grpo.grpo_loss` in that form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rl_bridge.grpo import GRPOLossConfig, grpo_loss, loss_denominator
from rl_bridge.megatron.batch import MicroBatch

__all__ = ["GRPOPolicyLoss", "PolicyLoss", "StepCounts", "TrainStepMetrics", "reduce_metrics"]


@dataclass(frozen=True)
class StepCounts:
    """Sizes of a whole training step's batch (all micro-batches, all data-parallel ranks).

    Only samples with a positive ``loss_weight`` count: they are the ones the loss averages over.
    """

    num_target_tokens: int
    """Target tokens."""
    num_target_sequences: int
    """Samples with at least one target token."""
    normalizer: float
    """The sum of the loss's :meth:`PolicyLoss.denominator` over every micro-batch of the step on
    every data-parallel rank: what each micro-batch's part is divided by."""


class PolicyLoss(Protocol):
    """The training objective, evaluated one micro-batch at a time (e.g. the GRPO loss).

    A loss with a true ``wants_entropy`` attribute is also given ``entropy=``: ``[B, S]`` fp32
    entropies of the current policy at each target position (with gradient; zero elsewhere).
    """

    def denominator(self, batch: MicroBatch) -> float:
        """This micro-batch's share of the step's normaliser (e.g. its weighted target tokens).

        The policy sums it over the step's micro-batches and data-parallel ranks before the first
        forward and passes the sum as :attr:`StepCounts.normalizer`, so numerator and
        denominator run over the same tokens whatever the split.
        """
        ...

    def __call__(
        self, logprobs: torch.Tensor, mask: torch.Tensor, batch: MicroBatch, counts: StepCounts
    ) -> tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]:
        """This micro-batch's part of the step's loss, given the current policy's log-probabilities.

        Args:
            logprobs: ``[B, S]`` fp32 log-probabilities of ``batch.input_ids`` under the current
                policy (with gradient), aligned like every per-token field: ``logprobs[b, t]`` is
                ``log p(input_ids[b, t] | input_ids[b, :t])``; zero where ``mask`` is false.
            mask: ``[B, S]`` bool, ``batch.target_mask``: the positions to train on. At least one
                is true (micro-batches without targets are not passed to the loss).
            batch: the micro-batch (advantages, loss weights, old/behaviour/reference logprobs).
            counts: the step's batch sizes and normaliser.

        Returns:
            The loss part, a scalar with gradient, such that the parts of all micro-batches (and
            data-parallel ranks) **sum** to the step's loss: the part's numerator divided by
            ``counts.normalizer``. Then scalar metrics (detached tensors or floats), each a mean
            over this micro-batch's trained tokens (targets of samples with a positive weight),
            which the step averages with those token counts as weights; a name ending in ``_max``
            is a maximum instead, and the step reports the largest.
        """
        ...


class GRPOPolicyLoss:
    """:func:`rl_bridge.grpo.grpo_loss` as a :class:`PolicyLoss`.

    Takes each micro-batch's ``old_logprobs``, ``behaviour_logprobs``, ``ref_logprobs``,
    advantages and loss weights; the denominator is :func:`rl_bridge.grpo.loss_denominator` of the
    config's aggregation, so the micro-batch parts sum to the batch loss. Metrics: those of
    ``grpo_loss`` except the additive ``loss/total``, ``loss/pg`` and ``tokens/valid`` (the step
    reports its loss and token counts itself) and the per-sequence mean
    ``mismatch/seq_mult_prob_error`` (not a token mean).
    """

    _LEFT_OUT = ("loss/total", "loss/pg", "tokens/valid", "mismatch/seq_mult_prob_error")

    #: The entropy is always taken: for ``loss/entropy``, and for the bonus when ``entropy_coef > 0``.
    wants_entropy = True

    def __init__(self, config: GRPOLossConfig) -> None:
        self.config = config

    def denominator(self, batch: MicroBatch) -> float:
        return float(loss_denominator(batch.target_mask, batch.loss_weights, self.config))

    def __call__(
        self,
        logprobs: torch.Tensor,
        mask: torch.Tensor,
        batch: MicroBatch,
        counts: StepCounts,
        *,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if entropy is not None and not self.config.entropy_coef > 0:
            entropy = entropy.detach()  # the metric only
        loss, metrics = grpo_loss(
            logprobs,
            batch.advantages,
            mask,
            self.config,
            old_logprobs=batch.old_logprobs,
            behaviour_logprobs=batch.behaviour_logprobs,
            ref_logprobs=batch.ref_logprobs,
            sample_weights=batch.loss_weights,
            normalizer=counts.normalizer,
            entropy=entropy,
        )
        return loss, {name: value for name, value in metrics.items() if name not in self._LEFT_OUT}


@dataclass(frozen=True)
class TrainStepMetrics:
    """What one :meth:`~rl_bridge.megatron.policy.MegatronPolicy.train_step` did, summed or
    averaged over data-parallel ranks."""

    step: int
    """Training steps taken so far, this one included (a step skipped by the optimizer counts)."""
    loss: float
    """The step's loss: the sum of the loss parts of all micro-batches (before the update)."""
    grad_norm: float | None
    """Global L2 norm of the gradient before clipping; ``None`` when the optimizer did not compute it."""
    learning_rate: float
    num_samples: int
    num_target_tokens: int
    """Target positions (those of samples with zero loss weight included)."""
    num_tokens: int
    """Unpadded tokens forwarded."""
    update_skipped: bool
    """The optimizer skipped the update (fp16 loss-scale overflow)."""
    loss_metrics: dict[str, float] = field(default_factory=dict)
    """Token-weighted means (maxima for ``*_max``) of the metrics returned by the loss."""
    logprobs: list[torch.Tensor] | None = None
    """With ``train_step(..., return_logprobs=True)``: this rank's samples' logprobs from the
    step's forward pass, before the update (layout of
    :meth:`~rl_bridge.megatron.policy.MegatronPolicy.logprobs`); with one optimizer step per
    rollout batch they are ``pi_old``, with no separate pass."""

    def as_dict(self) -> dict[str, float]:
        """Flat ``train/...`` scalars for a logger (``grad_norm`` left out when unknown)."""
        out = {
            "train/step": float(self.step),
            "train/loss": self.loss,
            "train/learning_rate": self.learning_rate,
            "train/num_samples": float(self.num_samples),
            "train/num_target_tokens": float(self.num_target_tokens),
            "train/num_tokens": float(self.num_tokens),
            "train/update_skipped": float(self.update_skipped),
        }
        if self.grad_norm is not None:
            out["train/grad_norm"] = self.grad_norm
        out.update({f"train/{name}": value for name, value in self.loss_metrics.items()})
        return out


def reduce_metrics(
    reported: list[dict[str, Any]], group: torch.distributed.ProcessGroup, device: torch.device
) -> dict[str, float]:
    """The loss's per-micro-batch metrics (each ``reported`` record's ``metrics``, weighted by its
    ``trained`` tokens) over the step: means weighted by each micro-batch's trained tokens, maxima
    for names ending in ``_max``; over all ranks of ``group`` (the data-parallel ranks)."""
    names = sorted({name for record in reported for name in record["metrics"]})
    means = [name for name in names if not name.endswith("_max")]
    maxima = [name for name in names if name.endswith("_max")]
    sums = torch.zeros(len(means) + 1, dtype=torch.float64, device=device)
    largest = torch.full((len(maxima),), -math.inf, dtype=torch.float64, device=device)
    for record in reported:
        weight = record["trained"]
        sums[-1] += weight
        for index, name in enumerate(means):
            sums[index] += weight * record["metrics"].get(name, 0.0)
        for index, name in enumerate(maxima):
            if name in record["metrics"]:
                largest[index] = max(float(largest[index]), record["metrics"][name])
    torch.distributed.all_reduce(sums, group=group)
    if maxima:
        torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, group=group)
    total = float(sums[-1]) or 1.0
    out = {name: float(sums[index]) / total for index, name in enumerate(means)}
    out.update({name: float(value) for name, value in zip(maxima, largest.tolist(), strict=True)})
    return out
