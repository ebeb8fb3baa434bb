"""What the sync and async loops share around their steps: validation, the progress bar, the summary.

:class:`RunReport` validates on the held-out rows before the first step (a fresh run), every
``validation.every`` steps and after the last step (unless that step was just validated); keeps the
validation history (a resumed run's from its ``metrics.jsonl``); shows a tqdm bar with the step's
sampled reward and the latest held-out accuracy; and writes ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rl_bridge.loop.metrics import RunMetrics, resident_mb, step_totals
from rl_bridge.loop.timing import timed
from rl_bridge.recipe import Recipe

__all__ = ["RunReport", "announce_run"]

logger = logging.getLogger(__name__)


def announce_run(recipe: Recipe, run_dir: Path, log: Path | None) -> None:
    """The run's first console lines: what it trains, where, and where this process's log is."""
    model = recipe.model
    where = (
        f"{model.vllm_gpus} vLLM + {model.policy_gpus} policy GPU(s), {model.placement}"
        if model.num_gpus
        else "CPU"
    )
    what = model.path or f"tiny random-weight {model.family} (built locally)"
    logger.info(
        "%s GRPO, %d steps of %d prompts x %d samples: %s on %s",
        recipe.mode,
        recipe.train.steps,
        recipe.rollout.prompts_per_step,
        recipe.rollout.group_size,
        what,
        where,
    )
    logger.info("run directory %s%s", run_dir, f"; trainer log {log}" if log is not None else "")


class RunReport:
    """Validation, progress and summary of one run (see the module docstring)."""

    def __init__(
        self,
        recipe: Recipe,
        validate: Callable[[], dict[str, float]],
        metrics: RunMetrics,
        *,
        desc: str,
        started: float,
        initial_step: int = 0,
    ) -> None:
        """
        Args:
            validate: the held-out metrics (``val/accuracy`` among them) of the weights vLLM serves.
            desc: the progress bar's label.
            started: ``time.monotonic()`` when the run started (for ``wall_s``).
            initial_step: steps already done (a resumed run).
        """
        self.recipe = recipe
        self._validate = validate
        self.metrics = metrics
        self.started = started
        self.history_val: list[tuple[int, float]] = [
            (int(r["step"]), r["val/accuracy"]) for r in metrics.history if "val/accuracy" in r
        ]
        self.accuracy = self.history_val[-1][1] if self.history_val else math.nan
        self._bar = tqdm(total=recipe.train.steps, initial=initial_step, desc=desc, unit="step")

    @property
    def every(self) -> int:
        return self.recipe.validation.every

    def validate(self, step: int) -> float:
        """Greedy held-out accuracy after ``step`` steps, logged at that step."""
        timings: dict[str, float] = {}
        with timed("validation", timings):
            scalars = self._validate()
        self.metrics.log(step, {**scalars, **timings})
        self.history_val.append((step, scalars["val/accuracy"]))
        self.accuracy = scalars["val/accuracy"]
        return self.accuracy

    def start(self) -> None:
        """Validate before the first step of a fresh run (``validation.every > 0``)."""
        if self.every and not self.history_val:
            self.validate(0)

    def step_done(self, step: int, step_metrics: Mapping[str, float]) -> bool:
        """Log the step's metrics, validate when due, advance the bar; whether the run should stop
        here (``validation.stop_at_target`` and the accuracy reached the target). Adds the
        trainer process's resident memory (``memory/trainer_rss_mb``)."""
        step_metrics = {**step_metrics, "memory/trainer_rss_mb": resident_mb()}
        self.metrics.log(step, step_metrics)
        if self.every and step % self.every == 0:
            self.validate(step)
        self._bar.update(1)
        reward = step_metrics.get("rollout/reward_mean", math.nan)
        self._bar.set_postfix(reward=f"{reward:.2f}", val=f"{self.accuracy:.2f}")
        validation = self.recipe.validation
        return validation.stop_at_target and self.accuracy >= validation.target_accuracy

    def finish(self, step: int) -> None:
        """Close the bar and validate after the last step unless it was just validated."""
        self._bar.close()
        if self.every and step > 0 and (not self.history_val or self.history_val[-1][0] != step):
            self.validate(step)

    def summary(self, *, steps: int, served_version: str, setup_s: float, **extra: Any) -> dict[str, Any]:
        """The run's summary (also written to ``<run_dir>/summary.json``)."""
        target = self.recipe.validation.target_accuracy
        run_dir = self.recipe.run_dir.resolve()
        summary = {
            "mode": self.recipe.mode,
            "steps": steps,
            **extra,
            "served_weight_version": served_version,
            "chance_accuracy": 1.0 / self.recipe.task.num_options,
            "validation_accuracy": [{"step": s, "accuracy": a} for s, a in self.history_val],
            "first_step_at_target": next((s for s, acc in self.history_val if acc >= target), None),
            "target_accuracy": target,
            **step_totals(self.metrics.history),
            "setup_s": setup_s,
            "wall_s": time.monotonic() - self.started,
            "curves": str(run_dir / "curves.png"),
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
