"""Validation: greedy accuracy on the held-out rows (rows that failed count as wrong)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rl_bridge.loop.stages.rollout import RolloutStage, verifier_metrics

__all__ = ["validate"]


def validate(rollout: RolloutStage, rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``val/accuracy`` (the verifier's ``correct``, else the reward as the grade), the verifier's
    other counts under ``val/`` and ``val/failed``, the rows without an answer."""
    results, stats = rollout.generate(rows, temperature=0.0, training=False)
    scores = verifier_metrics(results, "val")
    if "val/accuracy" not in scores:  # the reward is the grade
        scores["val/accuracy"] = sum(res.reward or 0.0 for res in results) / len(rows)
    return scores | {"val/failed": float(len(rows) - stats.outcomes["ok"])}
