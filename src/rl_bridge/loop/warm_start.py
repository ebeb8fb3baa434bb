"""A supervised warm start before GRPO: the task's demonstrations of a row's first turn.

A real agentic recipe starts from an instruction-tuned checkpoint, which already writes tool calls
in its chat template's format and copies an argument from the question into one. A random tiny
model does not, and reward alone teaches that copy too slowly to show anything else (the
supervised probe ``scripts/segment_copy_probe`` needs about 45 labelled steps to form it; GRPO sees
the right call in a third of its samples and a reward for it only when the answer after it is
right). ``warm_start.steps`` gives the policy that starting point inside the run:

- :func:`demonstration_samples` renders each row's first prompt with the model's chat template
  and its tools (the prompt vLLM renders for the same request), followed by the demonstrated
  action's tokens and the end token; only those are targets, under the masks of the grammar the
  first turn is decoded with (so only the decisions carry loss, as in the rollouts).
- :class:`SupervisedLoss` is token-mean cross-entropy over the targets, a
  :class:`~rl_bridge.megatron.policy_loss.PolicyLoss` like GRPO's, so the same policy, optimizer,
  micro-batching and data parallelism run it.

Only first turns are demonstrated, and only for text-only prompts: the later turns (the returned
clip, the answer, whether to call again) are left to GRPO.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rl_bridge.megatron.batch import MicroBatch, PolicySample
from rl_bridge.megatron.policy_loss import StepCounts
from rl_bridge.structured_outputs import GrammarMasks

__all__ = [
    "SupervisedLoss",
    "demonstration_samples",
    "first_turn_messages",
    "warm_start",
    "warm_start_batches",
]


class SupervisedLoss:
    """Token-mean negative log-likelihood of the target tokens (samples with a positive loss
    weight): the step's loss is ``-sum(log p(target)) / targets``, whatever the micro-batch and
    data-parallel split. Metric ``target_prob``: the mean probability of a target token (a token
    a grammar forces counts with probability 1)."""

    def denominator(self, batch: MicroBatch) -> float:
        return float((batch.target_mask & (batch.loss_weights > 0).unsqueeze(-1)).sum())

    def __call__(
        self, logprobs: torch.Tensor, mask: torch.Tensor, batch: MicroBatch, counts: StepCounts
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        trained = mask & (batch.loss_weights > 0).unsqueeze(-1)
        weights = trained.to(logprobs.dtype) * batch.loss_weights.to(logprobs.dtype).unsqueeze(-1)
        loss = -(logprobs * weights).sum() / counts.normalizer
        tokens = trained.sum().clamp(min=1)
        return loss, {"target_prob": (logprobs.detach().exp() * trained).sum() / tokens}


def first_turn_messages(row: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The chat messages and chat-completions tools of a row's first request (its
    ``responses_create_params``), as the model server sends them to vLLM.

    Raises:
        ValueError: the prompt holds anything but text (a demonstration prompt is text only).
    """
    params = row["responses_create_params"]
    messages = []
    for item in params["input"]:
        content = item["content"]
        if isinstance(content, str):
            text = content
        else:
            kinds = {part.get("type") for part in content}
            if kinds - {"input_text"}:
                raise ValueError(
                    f"row {row.get('task_id')!r}: a demonstration's prompt must be text only, "
                    f"it holds {sorted(kinds - {'input_text'})}"
                )
            text = "".join(part["text"] for part in content)
        messages.append({"role": item["role"], "content": text})
    tools = [
        {
            "type": "function",
            "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool},
        }
        for tool in params.get("tools", ())
    ]
    return messages, tools


def demonstration_samples(
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    actions: Sequence[str],
    grammar: GrammarMasks | None = None,
) -> list[PolicySample]:
    """One supervised sample per row: its first prompt through ``tokenizer``'s chat template (with
    its tools and the generation prompt), then ``actions[i]``'s tokens and the end token as targets.

    With ``grammar`` (the structured-outputs grammar the first turn is decoded under) each target
    carries the grammar's mask there, as a rollout's tokens do: the policy's softmax runs over the
    same tokens vLLM samples from, so a forced token has probability 1 and no gradient, and the
    loss is the decisions' alone (which segment to call).
    """
    samples = []
    for row, action in zip(rows, actions, strict=True):
        messages, tools = first_turn_messages(row)
        rendered = tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=True
        )
        prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        target = [*tokenizer.encode(action, add_special_tokens=False), tokenizer.eos_token_id]
        ids = torch.tensor([*prompt, *target], dtype=torch.int64)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[len(prompt) :] = True
        allowed = grammar.bitmasks(target) if grammar is not None else None
        samples.append(PolicySample(input_ids=ids, target_mask=mask, advantage=0.0, allowed_tokens=allowed))
    return samples


def warm_start_batches(
    rows: Sequence[Mapping[str, Any]], *, steps: int, per_step: int, seed: int
) -> list[list[Mapping[str, Any]]]:
    """``steps`` batches of ``per_step`` rows: seeded passes over ``rows`` in a fresh order each."""
    rng = random.Random(seed)
    order: list[int] = []
    batches = []
    for _ in range(steps):
        batch = []
        for _ in range(per_step):
            if not order:
                order = list(range(len(rows)))
                rng.shuffle(order)
            batch.append(rows[order.pop()])
        batches.append(batch)
    return batches


def warm_start(stages: Any) -> dict[str, float]:
    """``warm_start.steps`` supervised steps on the task's first-turn demonstrations, then a refit
    so that vLLM serves the result as ``step-0``. Metrics: ``warm_start/steps``, the first and last
    steps' loss and mean target probability (``warm_start/loss_first``, ``.../loss_last``,
    ``.../target_prob_first``, ``.../target_prob_last``), the held-out validation before it
    (``warm_start/before/val/*``; the run's step-0 validation is after it) and
    ``warm_start/time_s``.

    Args:
        stages: the run's :class:`~rl_bridge.loop.step.Stages`.
    """
    from transformers import AutoTokenizer

    from rl_bridge.tasks import demonstration

    recipe = stages.recipe
    tokenizer = AutoTokenizer.from_pretrained(stages.data.model_dir)
    grammars = stages.preprocess.inputs.grammars
    grammar = grammars[0] if grammars else None  # the first turn's
    config = recipe.warm_start
    started = time.monotonic()
    loss = SupervisedLoss()
    batches = warm_start_batches(
        stages.data.train_rows, steps=config.steps, per_step=config.prompts_per_step, seed=recipe.seed + 2
    )
    before = {f"warm_start/before/{name}": value for name, value in stages.validate().items()}
    records = []
    timings: dict[str, float] = {}
    with stages.refit.lock:
        with stages.refit.generation_asleep(timings):
            for rows in batches:
                actions = [demonstration(recipe.task, row) for row in rows]
                samples = demonstration_samples(tokenizer, rows, actions, grammar)
                step = stages.roles.policy.train_step(samples, loss)
                records.append((step.loss, step.loss_metrics.get("target_prob", float("nan"))))
        stages.refit(0)
    (first_loss, first_prob), (last_loss, last_prob) = records[0], records[-1]
    return {
        **before,
        "warm_start/steps": float(len(records)),
        "warm_start/loss_first": first_loss,
        "warm_start/loss_last": last_loss,
        "warm_start/target_prob_first": first_prob,
        "warm_start/target_prob_last": last_prob,
        "warm_start/time_s": time.monotonic() - started,
    }
