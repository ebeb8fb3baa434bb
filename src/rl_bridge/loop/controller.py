"""The stages of a GRPO step, shared by the sync and async loops.

:class:`Controller` holds one run's state (recipe, task data, started roles) and exposes each stage
as a method: **rollout** G samples of each prompt through the agent's ``/run``
(:func:`rl_bridge.rollout.collect_rollouts`); **preprocess** each answer into policy tensors
(:class:`rl_bridge.policy_inputs.PolicyInputBuilder`: tokens, vLLM logprobs, media with the
placeholder check; failures masked and counted) and group advantages; **logprobs** of every
unmasked sample under the current policy (the proximal policy, and the vLLM/trainer mismatch), plus
the reference policy's only when the KL weight is non-zero; **train** one optimizer step on the
samples that carry signal; **refit** vLLM from the exported weights, versioned by step; **validate**
on the held-out rows with greedy decoding.
"""

from __future__ import annotations

import dataclasses
import math
import random
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from rl_bridge.grpo import group_advantages
from rl_bridge.loop.config import Recipe
from rl_bridge.loop.roles import Roles
from rl_bridge.loop.tasks import TaskData
from rl_bridge.rollout import RolloutResult, RolloutSettings, collect_rollouts

__all__ = ["Controller", "timed", "with_sampling"]


@contextmanager
def timed(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Record the wall time of the block in ``timings["time/<name>_s"]`` (seconds)."""
    started = time.monotonic()
    try:
        yield
    finally:
        timings[f"time/{name}_s"] = time.monotonic() - started


def with_sampling(row: Mapping[str, Any], temperature: float, max_output_tokens: int) -> dict[str, Any]:
    """``row`` with its sampling parameters set."""
    params = {
        **row["responses_create_params"],
        "temperature": temperature,
        "max_output_tokens": max_output_tokens,
    }
    return {**row, "responses_create_params": params}


class Controller:
    """One run's state: the recipe, the task data, the started roles, and the stage functions."""

    def __init__(self, recipe: Recipe, data: TaskData, roles: Roles) -> None:
        from gym_video_env import MediaSettings
        from rl_bridge.megatron.policy import GRPOPolicyLoss
        from rl_bridge.policy_inputs import PolicyInputBuilder
        from rl_bridge.processors import load_processor
        from vllm_video_plugin.refit import RefitClient

        self.recipe = recipe
        self.data = data
        self.roles = roles
        self.run_dir = recipe.run_dir.resolve()
        self.weights_dir = self.run_dir / "weights"
        self.refit_client = RefitClient(roles.vllm_base_url)
        self.rollout_settings = RolloutSettings(
            max_in_flight=recipe.rollout.max_in_flight,
            max_attempts=recipe.rollout.max_attempts,
            timeout_s=recipe.rollout.timeout_s,
        )
        self.inputs = PolicyInputBuilder(
            load_processor(data.model_dir), MediaSettings(media_root=data.media_root)
        )
        self.loss = GRPOPolicyLoss(recipe.train.loss)
        self._order: list[int] = []
        self._rng = random.Random(recipe.seed)

    # -- data ----------------------------------------------------------------------------------------

    def next_prompts(self) -> list[dict[str, Any]]:
        """The next ``prompts_per_step`` training rows; each pass over the rows is reshuffled."""
        chosen = []
        for _ in range(self.recipe.rollout.prompts_per_step):
            if not self._order:
                self._order = list(range(len(self.data.train_rows)))
                self._rng.shuffle(self._order)
            chosen.append(self.data.train_rows[self._order.pop()])
        return chosen

    # -- stages ------------------------------------------------------------------------------------

    def rollout(self, prompts: Sequence[Mapping[str, Any]]) -> tuple[list[RolloutResult], dict[str, float]]:
        """G samples of every prompt (groups contiguous), and the rollout counts."""
        r = self.recipe.rollout
        rows = [
            with_sampling(p, r.temperature, r.max_output_tokens) for p in prompts for _ in range(r.group_size)
        ]
        results, stats = collect_rollouts(self.roles.agent_url, rows, self.rollout_settings)
        rewards = [res.reward for res in results if res.reward is not None]
        metrics = stats.as_dict()
        metrics["rollout/reward_mean"] = sum(rewards) / len(rewards) if rewards else float("nan")
        return results, metrics

    def preprocess(self, results: Sequence[RolloutResult]) -> tuple[list[Any], dict[str, float]]:
        """Policy samples with their advantages (masked rollouts left out) and the step's counts."""
        from rl_bridge.media_batch import MediaMetrics

        self.inputs.metrics = MediaMetrics()
        built = [self.inputs.build(res.result) if res.result is not None else None for res in results]
        valid = torch.tensor([b is not None and not b.masked for b in built])
        rewards = torch.tensor([res.reward if res.reward is not None else float("nan") for res in results])
        grouped = group_advantages(
            rewards,
            group_size=self.recipe.rollout.group_size,
            sample_mask=valid,
            normalize_std=self.recipe.train.loss.normalize_std,
            leave_one_out=self.recipe.train.loss.leave_one_out,
            std_eps=self.recipe.train.loss.std_eps,
        )
        samples = [
            sample
            for inputs, advantage in zip(built, grouped.advantages.tolist(), strict=True)
            if inputs is not None and not inputs.masked
            for sample in inputs.to_policy_samples(advantage)
        ]
        metrics = {
            "preprocess/samples": float(len(samples)),
            "preprocess/masked": float(len(results) - int(valid.sum())),
            **{f"preprocess/{k}": float(v) for k, v in grouped.metrics().items()},
            **{f"preprocess/{k}": float(v) for k, v in self.inputs.metrics.as_dict().items()},
        }
        return samples, metrics

    def logprobs(self, samples: list[Any]) -> list[Any]:
        """The samples with ``old_logprobs`` (and ``ref_logprobs`` when the KL weight is non-zero)."""
        old = self.roles.policy.logprobs(samples)
        ref = (
            self.roles.reference.logprobs(samples)
            if self.roles.reference is not None
            else [None] * len(samples)
        )
        return [
            dataclasses.replace(s, old_logprobs=o, ref_logprobs=r)
            for s, o, r in zip(samples, old, ref, strict=True)
        ]

    def train(self, samples: list[Any]) -> dict[str, float]:
        """One optimizer step on the samples with a non-zero advantage (none: no step)."""
        signal = [s for s in samples if s.advantage != 0.0]
        metrics = self._mismatch(samples)
        if not signal:
            return {**metrics, "train/skipped_no_signal": 1.0}
        return {
            **metrics,
            **self.roles.policy.train_step(signal, self.loss).as_dict(),
            "train/skipped_no_signal": 0.0,
        }

    @staticmethod
    def _mismatch(samples: Sequence[Any]) -> dict[str, float]:
        """vLLM vs trainer (before the update) on every unmasked sample: token and worst sequence
        multiplicative probability error, ``exp(|logp_trainer - logp_vllm|)``."""
        if not samples:
            return {}
        token_errors: list[float] = []
        seq_errors: list[float] = []
        for s in samples:
            diff = (s.old_logprobs - s.behaviour_logprobs)[s.target_mask].double()
            token_errors += diff.abs().exp().tolist()
            seq_errors.append(math.exp(abs(float(diff.sum()))))
        return {
            "mismatch/token_mult_prob_error": sum(token_errors) / len(token_errors),
            "mismatch/seq_mult_prob_error_max": max(seq_errors),
        }

    def refit(self, step: int) -> dict[str, float]:
        """Export the weights and load them into vLLM as version ``step-<step>``."""
        target = self.weights_dir / f"step-{step}"
        self.roles.policy.save_hf_checkpoint(target)
        result = self.refit_client.refit(target, version=f"step-{step}")
        for old in self.weights_dir.iterdir():
            if old != target:
                shutil.rmtree(old)
        return {"refit/paused_s": result.paused_s, "refit/weight_version": float(step)}

    def validate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out rows (rows that failed count as wrong)."""
        r = self.recipe.rollout
        rows = [with_sampling(row, 0.0, r.max_output_tokens) for row in self.data.val_rows]
        results, stats = collect_rollouts(self.roles.agent_url, rows, self.rollout_settings)
        correct = sum(res.reward or 0.0 for res in results)
        return {"val/accuracy": correct / len(rows), "val/failed": float(len(rows) - stats.outcomes["ok"])}
