"""Rollout: G samples of every prompt through the Gym agent's ``/run``, with the verifier's counts.

Rows that fail are kept as results without a sample (masked) and appended to the run's
``masked_rows.jsonl`` with their reason and media. Metrics: the counts of
:class:`~rl_bridge.rollout.RolloutStats` (``rollout/rows``, the outcomes, retries, restarts,
``rollout/wall_s``), ``rollout/reward_mean`` and what the verifier reported beyond the reward
(:func:`verifier_metrics`).
"""

from __future__ import annotations

import json
import math
import threading
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rl_bridge.recipe import Recipe, RolloutSection
from rl_bridge.rollout import RolloutResult, RolloutSettings, RolloutStats, collect_rollouts

__all__ = [
    "MASKED_ROWS_FILE",
    "MaskedLog",
    "RolloutStage",
    "declared_groups",
    "rollout_metrics",
    "verifier_metrics",
    "with_sampling",
]

MASKED_ROWS_FILE = "masked_rows.jsonl"
"""Run-directory file with one JSON line per masked row: ``task_id``, ``reason`` (the
``masked/<reason>`` metric's), ``detail`` (the error) and ``media`` (the row's media references)."""


def with_sampling(row: Mapping[str, Any], temperature: float, max_output_tokens: int) -> dict[str, Any]:
    """``row`` with its sampling parameters set."""
    params = {
        **row["responses_create_params"],
        "temperature": temperature,
        "max_output_tokens": max_output_tokens,
    }
    return {**row, "responses_create_params": params}


def _media(record: Mapping[str, Any]) -> list[str]:
    """The references of the media parts in a row's prompt and, for a rollout, its output, in order
    (a part without a valid reference as written; each cut to 200 characters)."""
    from gym_video_env.handlers import media_ref
    from gym_video_env.hookspecs import MediaError

    prompt = (record.get("responses_create_params") or {}).get("input")
    output = (record.get("response") or {}).get("output")
    items = [*(prompt if isinstance(prompt, list) else []), *(output if isinstance(output, list) else [])]
    refs = []
    for item in items:
        content = item.get("content") if isinstance(item, Mapping) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") in ("input_video", "input_image"):
                try:
                    refs.append(media_ref(part).value[:200])
                except MediaError:
                    refs.append(json.dumps(part)[:200])
    return refs


class MaskedLog:
    """``<run_dir>/masked_rows.jsonl``: one line per masked row or rollout (see
    :data:`MASKED_ROWS_FILE`), written by the rollout and preprocessing stages."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / MASKED_ROWS_FILE

    def write(self, records: Iterable[tuple[Mapping[str, Any], str, str]]) -> None:
        """Append each masked ``(row or rollout record, reason, detail)``."""
        lines = [
            json.dumps({"task_id": row.get("task_id"), "reason": r, "detail": d, "media": _media(row)}) + "\n"
            for row, r, d in records
        ]
        if lines:
            with self.path.open("a", encoding="utf-8") as log:
                log.writelines(lines)


def verifier_metrics(results: Sequence[RolloutResult], prefix: str) -> dict[str, float]:
    """What the verifier reported beyond the reward, over every row (a failed row counts as wrong,
    with no calls): ``<prefix>/accuracy`` when it reports ``correct`` (the reward may include
    costs), and with tool calls ``<prefix>/tool_calls_per_sample`` and
    ``<prefix>/tool_call_precision`` (the fraction of calls that asked for the segment the question
    names; NaN when no call was made), and with the segments each sample watched
    ``<prefix>/first_call_entropy``: the entropy of the first watched segment over the samples that
    called for one, divided by the log of the number of segments (1 when the first calls spread evenly
    over the segments, as they do for a policy that asks for the named one of a uniformly named
    segment; 0 when every sample asks for the same segment, a collapsed choice)."""
    answers = [res.result or {} for res in results]
    metrics: dict[str, float] = {}
    if not answers:
        return metrics
    if any("correct" in answer for answer in answers):
        metrics[f"{prefix}/accuracy"] = sum(bool(a.get("correct")) for a in answers) / len(answers)
    if any("tool_calls" in answer for answer in answers):
        calls = sum(int(a.get("tool_calls") or 0) for a in answers)
        named = sum(int(a.get("named_segment_calls") or 0) for a in answers)
        metrics[f"{prefix}/tool_calls_per_sample"] = calls / len(answers)
        if any(a.get("named_segment_calls") is not None for a in answers):
            metrics[f"{prefix}/tool_call_precision"] = named / calls if calls else math.nan
    first = Counter(
        a["watched_segments"][0] for a in answers if a.get("watched_segments") and a.get("tool_calls")
    )
    segments = max((len(a.get("segments") or ()) for a in answers), default=0)
    if first and segments > 1:
        counts = torch.tensor(list(first.values()), dtype=torch.float64)
        probs = counts / counts.sum()
        metrics[f"{prefix}/first_call_entropy"] = float(-(probs * probs.log()).sum() / math.log(segments))
    return metrics


def rollout_metrics(results: Sequence[RolloutResult], stats: RolloutStats) -> dict[str, float]:
    """The rollout stage's metrics over ``results`` (the rows of one or more calls whose counts
    ``stats`` holds): the counts, ``rollout/reward_mean`` over the rows that were scored, and
    :func:`verifier_metrics`."""
    rewards = [res.reward for res in results if res.reward is not None]
    reward_mean = sum(rewards) / len(rewards) if rewards else math.nan
    return {**stats.as_dict(), "rollout/reward_mean": reward_mean, **verifier_metrics(results, "rollout")}


class RolloutStage:
    """Rolls rows out through the run's Gym agent, with the recipe's sampling and dispatch settings."""

    def __init__(
        self, recipe: Recipe, agent_url: str | tuple[str, ...], supervisor: Any, masked: MaskedLog
    ) -> None:
        """
        Args:
            agent_url: the Gym agent server's base URL, or its replicas' (see ``collect_rollouts``).
            supervisor: keeps vLLM up (:class:`~rl_bridge.services.supervisor.ServiceSupervisor`),
                or ``None``.
            masked: where failed rows are recorded.
        """
        self.recipe = recipe
        self.agent_url = agent_url
        self.supervisor = supervisor
        self.masked = masked
        self.settings = dispatch_settings(recipe.rollout)

    def generate(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        temperature: float,
        training: bool = True,
        order: Sequence[int] | None = None,
        clock: threading.Event | None = None,
    ) -> tuple[list[RolloutResult], RolloutStats]:
        """Each row once at ``temperature`` (the recipe's output length), posted in ``order`` (row
        order by default); a training row that failed is recorded in the masked log (held-out
        rows, ``training=False``, are not). ``clock``: as for
        :func:`~rl_bridge.rollout.collect_rollouts` (requests vLLM holds while it sleeps)."""
        rows = [with_sampling(row, temperature, self.recipe.rollout.max_output_tokens) for row in rows]
        results, stats = collect_rollouts(
            self.agent_url, rows, self.settings, supervisor=self.supervisor, order=order, clock=clock
        )
        if training:
            self.masked.write(
                (rows[res.index], res.mask_reason, res.error or "") for res in results if res.result is None
            )
        return results, stats

    def groups(
        self, prompts: Sequence[Mapping[str, Any]], *, clock: threading.Event | None = None
    ) -> tuple[list[RolloutResult], RolloutStats]:
        """``rollout.group_size`` samples of every prompt at the recipe's temperature, groups
        contiguous. With ``rollout.declare_groups``, :func:`declared_groups`' rows and order.
        ``clock``: as for :meth:`generate`."""
        r = self.recipe.rollout
        if r.declare_groups:
            rows, order = declared_groups(prompts, r.group_size)
            return self.generate(rows, temperature=r.temperature, order=order, clock=clock)
        rows = [p for p in prompts for _ in range(r.group_size)]
        return self.generate(rows, temperature=r.temperature, clock=clock)


def dispatch_settings(section: RolloutSection) -> RolloutSettings:
    """The rollout client's settings from the recipe's ``rollout`` section."""
    return RolloutSettings(
        max_in_flight=section.max_in_flight,
        max_attempts=section.max_attempts,
        timeout_s=section.timeout_s,
        spread_group_samples=section.spread_group_samples,
    )


def declared_groups(
    prompts: Sequence[Mapping[str, Any]], group_size: int
) -> tuple[list[dict[str, Any]], list[int]]:
    """``group_size`` rows of every prompt, groups contiguous, each row's request declaring its group
    (``gym_video_env.coalesce.group_metadata``: a fresh id per group and ``group_size``), and the
    order to post them in: every group's first sample, then every group's second, and so on, so
    that each group's request reaches vLLM with the group's first sample."""
    from gym_video_env.coalesce import group_metadata

    rows = []
    for prompt in prompts:
        params = prompt["responses_create_params"]
        metadata = {**(params.get("metadata") or {}), **group_metadata(uuid.uuid4().hex, group_size)}
        row = {**prompt, "responses_create_params": {**params, "metadata": metadata}}
        rows += [row] * group_size
    order = [g * group_size + s for s in range(group_size) for g in range(len(prompts))]
    return rows, order
