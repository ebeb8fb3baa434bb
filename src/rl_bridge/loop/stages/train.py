"""Train: ``train.epochs x train.minibatches`` optimizer steps on every unmasked sample.

Zero-advantage samples are trained too: they count in the loss's normaliser and carry the KL
term. With ``loss.seq_mismatch_threshold`` the sequences over it get loss weight 0 first
(``mismatch/masked_seqs``). Metrics: the vLLM/trainer mismatch of ``pi_old`` (the recomputed
``old_logprobs``, or the first training forward's), ``train/*`` of the last optimizer step (loss
terms and clip fractions averaged over the steps, which is where the clip shows: the first step
of a batch is on-policy) and ``train/optimizer_steps``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import torch

from rl_bridge.grpo import mismatch_exceeds, train_inference_mismatch
from rl_bridge.recipe import Recipe

__all__ = ["TrainStage", "mismatch_metrics"]


def _split(order: list[int], parts: int) -> list[list[int]]:
    """``order`` in ``parts`` contiguous chunks whose sizes differ by at most one (empty ones dropped)."""
    base, extra = divmod(len(order), parts)
    chunks, start = [], 0
    for part in range(parts):
        end = start + base + (part < extra)
        if end > start:
            chunks.append(order[start:end])
        start = end
    return chunks


def _token_rows(sample: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sample's trainer (``old``) and vLLM logprobs and target mask, each as a ``[1, T]`` row."""
    return (
        sample.old_logprobs.unsqueeze(0),
        sample.behaviour_logprobs.unsqueeze(0),
        sample.target_mask.unsqueeze(0),
    )


def mismatch_metrics(samples: Sequence[Any]) -> dict[str, float]:
    """vLLM vs trainer (``pi_old``) over the samples that have both
    (:func:`rl_bridge.grpo.train_inference_mismatch` of each): the token multiplicative probability
    error ``exp(|logp_trainer - logp_vllm|)`` averaged over every generated token, and the worst
    sequence's."""
    error_sum = tokens = 0.0
    seq_errors: list[float] = []
    for sample in samples:
        if sample.old_logprobs is None or sample.behaviour_logprobs is None:
            continue
        stats = train_inference_mismatch(*_token_rows(sample))
        count = float(sample.target_mask.sum())
        error_sum += float(stats.token_mult_prob_error) * count
        tokens += count
        seq_errors.append(float(stats.seq_mult_prob_error[0]))
    if not tokens:
        return {}
    return {
        "mismatch/token_mult_prob_error": error_sum / tokens,
        "mismatch/seq_mult_prob_error_max": max(seq_errors),
    }


class TrainStage:
    """The optimizer steps of a step (see the module docstring)."""

    def __init__(self, recipe: Recipe, policy: Any, loss: Any) -> None:
        """
        Args:
            policy: the run's policy handle (``train_step``).
            loss: the policy loss (:class:`~rl_bridge.megatron.policy.GRPOPolicyLoss`).
        """
        self.recipe = recipe
        self.policy = policy
        self.loss = loss
        self._minibatch_rng = random.Random(recipe.seed + 1)

    def __call__(self, samples: list[Any]) -> dict[str, float]:
        train = self.recipe.train
        metrics: dict[str, float] = {}
        if (threshold := train.loss.seq_mismatch_threshold) is not None:
            over = [
                s.behaviour_logprobs is not None and bool(mismatch_exceeds(*_token_rows(s), threshold)[0])
                for s in samples
            ]
            samples = [
                dataclasses.replace(s, loss_weight=0.0) if masked else s
                for s, masked in zip(samples, over, strict=True)
            ]
            metrics["mismatch/masked_seqs"] = float(sum(over))
        trainable = [s for s in samples if s.loss_weight > 0 and s.num_target_tokens > 0]
        if not trainable:
            return {**metrics, **mismatch_metrics(samples), "train/optimizer_steps": 0.0}
        first: dict[int, Any] = {}  # the first training forward's logprobs: pi_old where none was computed
        steps = []
        for _ in range(train.epochs):
            order = list(range(len(trainable)))
            if train.minibatches > 1:
                self._minibatch_rng.shuffle(order)
            for chunk in _split(order, train.minibatches):
                want = any(trainable[i].old_logprobs is None and i not in first for i in chunk)
                step = self.policy.train_step([trainable[i] for i in chunk], self.loss, return_logprobs=want)
                if want:
                    for i, logprobs in zip(chunk, step.logprobs, strict=True):
                        first.setdefault(i, logprobs)
                steps.append(step)
        trained_ids = {id(s) for s in trainable}
        with_old = [
            s if s.old_logprobs is not None else dataclasses.replace(s, old_logprobs=first[i])
            for i, s in enumerate(trainable)
        ] + [s for s in samples if id(s) not in trained_ids]
        return {
            **metrics,
            **mismatch_metrics(with_old),
            **_last_step(steps),
            "train/optimizer_steps": float(len(steps)),
        }


def _last_step(steps: Sequence[Any]) -> dict[str, float]:
    """The last optimizer step's ``train/*``, with the loss terms, loss and gradient norm averaged
    over ``steps`` (``*_max`` terms: their maximum)."""
    per_step = [step.as_dict() for step in steps]
    last = per_step[-1]
    averaged = {f"train/{n}" for step in steps for n in step.loss_metrics} | {"train/loss", "train/grad_norm"}
    for name in averaged:
        values = [record[name] for record in per_step if name in record]
        if values:
            last[name] = max(values) if name.endswith("_max") else sum(values) / len(values)
    return last
