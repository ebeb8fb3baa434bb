"""Preprocessing: each rollout's trajectory into policy samples, with group advantages.

:class:`~rl_bridge.policy_inputs.PolicyInputBuilder` turns a rollout into tokens, vLLM's logprobs
and media with the placeholder check; a rollout that fails it is masked, counted
(``masked/<reason>``) and logged with its media. Scored rollouts (``ok`` and ``policy_fault``)
enter their group's baseline; a ``policy_fault`` one is trained with its failure reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_bridge.grpo import group_advantages
from rl_bridge.loop.stages.rollout import MaskedLog
from rl_bridge.recipe import Recipe
from rl_bridge.rollout import RolloutResult

__all__ = ["Preprocessor", "StepBatch"]


@dataclass
class StepBatch:
    """The policy samples of one step, by group (one group: the G rollouts of one prompt)."""

    groups: list[list[Any]] = field(default_factory=list)
    """Each group's :class:`~rl_bridge.megatron.batch.PolicySample` objects (masked rollouts have
    none; a multi-turn rollout may have several)."""
    zero_signal: list[bool] = field(default_factory=list)
    """Per group: all its valid rewards are equal (or it has fewer than two), so its advantages
    are 0."""

    @property
    def samples(self) -> list[Any]:
        """Every sample, groups in order."""
        return [sample for group in self.groups for sample in group]

    def extend(self, other: StepBatch) -> None:
        self.groups += other.groups
        self.zero_signal += other.zero_signal


class Preprocessor:
    """Builds a step's policy samples from its rollouts (see the module docstring)."""

    def __init__(self, recipe: Recipe, inputs: Any, masked: MaskedLog) -> None:
        """
        Args:
            inputs: the run's :class:`~rl_bridge.policy_inputs.PolicyInputBuilder`.
            masked: where masked rollouts are recorded.
        """
        self.recipe = recipe
        self.inputs = inputs
        self.masked = masked

    def __call__(self, results: Sequence[RolloutResult]) -> tuple[StepBatch, dict[str, float]]:
        """Policy samples with their advantages, by group (masked rollouts left out), and the
        stage's metrics."""
        from rl_bridge.media_batch import MediaMetrics

        loss = self.recipe.train.loss
        group_size = self.recipe.rollout.group_size
        self.inputs.metrics = MediaMetrics()
        built = [self.inputs.build(res.result) if res.result is not None else None for res in results]
        valid = torch.tensor([b is not None and not b.masked for b in built])
        rewards = torch.tensor([res.reward if res.reward is not None else float("nan") for res in results])
        grouped = group_advantages(
            rewards,
            group_size=group_size,
            sample_mask=valid,
            normalize_std=loss.normalize_std,
            leave_one_out=loss.leave_one_out,
            std_eps=loss.std_eps,
        )
        per_rollout = [
            inputs.to_policy_samples(advantage) if inputs is not None and not inputs.masked else []
            for inputs, advantage in zip(built, grouped.advantages.tolist(), strict=True)
        ]
        batch = StepBatch(
            groups=[
                [s for rollout in per_rollout[start : start + group_size] for s in rollout]
                for start in range(0, len(per_rollout), group_size)
            ],
            zero_signal=grouped.zero_signal.tolist(),
        )
        reasons = [
            res.mask_reason if inputs is None else inputs.mask_reason
            for res, inputs in zip(results, built, strict=True)
            if inputs is None or inputs.masked
        ]
        self.masked.write(
            (res.result, inputs.mask_reason, inputs.mask_detail or "")
            for res, inputs in zip(results, built, strict=True)
            if res.result is not None and inputs is not None and inputs.masked
        )
        trained = [
            (res, inputs)
            for res, inputs in zip(results, built, strict=True)
            if inputs is not None and not inputs.masked and inputs.trajectory is not None
        ]
        metrics = {
            "preprocess/masked": float(len(results) - int(valid.sum())),
            # Rows: trained + sum(masked/<reason>) == rollout/rows.
            "preprocess/trained": float(int(valid.sum())),
            **{f"masked/{reason}": float(reasons.count(reason)) for reason in sorted(set(reasons))},
            **self._sample_metrics(batch.samples, trained),
            **{f"preprocess/{k}": float(v) for k, v in grouped.metrics().items()},
        }
        return batch, metrics

    def _sample_metrics(
        self, samples: Sequence[Any], trained: Sequence[tuple[RolloutResult, Any]]
    ) -> dict[str, float]:
        """What the trained rollouts hold: tokens, samples, media, tool calls, turns, sequences, and
        the media store's size."""
        kept = [inputs for _, inputs in trained]

        def per_sample(values: Sequence[float]) -> float:
            return sum(values) / len(values) if values else 0.0

        videos = [sum(part.kind == "video" for part in inputs.trajectory.media) for inputs in kept]
        images = [sum(part.kind == "image" for part in inputs.trajectory.media) for inputs in kept]
        tool_calls = [
            sum(item.get("type") == "function_call" for item in res.result["response"]["output"])
            for res, _ in trained
        ]
        trained_turns = [
            sum(
                bool(sequence.target_mask[turn.generation_start : turn.end].any())
                for sequence, turns in zip(inputs.sequences, inputs.trajectory.sequences, strict=True)
                for turn in turns
            )
            for inputs in kept
        ]
        store = self.inputs.store.stats()
        generated = sum(int(sequence.target_mask.sum()) for inputs in kept for sequence in inputs.sequences)
        return {
            "preprocess/generated_tokens": float(generated),
            "preprocess/samples": float(len(samples)),
            "preprocess/zero_advantage_samples": float(sum(s.advantage == 0.0 for s in samples)),
            "preprocess/media/videos_per_sample": per_sample(videos),
            "preprocess/media/images_per_sample": per_sample(images),
            "preprocess/tool_calls_per_sample": per_sample(tool_calls),
            "preprocess/turns_per_sample": per_sample([len(inputs.trajectory.turns) for inputs in kept]),
            "preprocess/trained_turns_per_sample": per_sample(trained_turns),
            # Above 1 when a chat template re-rendered an earlier turn's tokens differently.
            "preprocess/sequences_per_sample": per_sample([len(inputs.sequences) for inputs in kept]),
            **{f"preprocess/{k}": float(v) for k, v in self.inputs.metrics.as_dict().items()},
            "preprocess/media/store_mb": store.unique_bytes / 2**20,
            "preprocess/media/store_evicted": float(store.evicted),
        }
