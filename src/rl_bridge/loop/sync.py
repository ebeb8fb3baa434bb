"""The synchronous GRPO loop: rollout -> preprocess -> logprobs -> train -> refit, repeated.

Each step rolls out ``rollout.prompts_per_step`` prompts x ``rollout.group_size`` samples with the
weights vLLM serves (:class:`~rl_bridge.loop.collect.SyncCollector`; with
``train.dynamic_sampling`` more rounds replace groups without signal), then learns from them
(:func:`~rl_bridge.loop.step.learn`); the run around the steps (setup, warm start, validation
every ``validation.every`` steps, metrics, curves, summary) is :class:`~rl_bridge.loop.run.Run`.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from rl_bridge.loop.collect import SyncCollector
from rl_bridge.loop.run import Run
from rl_bridge.loop.rundir import new_run_dir
from rl_bridge.loop.step import learn
from rl_bridge.recipe import EXPORT_DIR, Recipe

__all__ = ["run_sync"]


def run_sync(recipe: Recipe, *, overwrite: bool = False) -> dict[str, Any]:
    """Run ``recipe``; returns the summary also written to ``summary.json``.

    Args:
        recipe: the run.
        overwrite: replace an earlier run in ``recipe.run_dir`` (else it is refused).

    Raises:
        rl_bridge.loop.rundir.RunDirError: ``recipe.run_dir`` holds an earlier run (without
            ``overwrite``) or files of no run.
        rl_bridge.services.process.ServiceError: a server did not start.
        rl_bridge.refit.client.RefitError: a refit failed.
    """
    recipe.require_hardware()  # before an old run directory is touched
    run_dir = new_run_dir(recipe.run_dir, overwrite=overwrite)
    with ExitStack() as stack:
        run = Run(recipe, run_dir, stack)
        stages = run.stages
        collect = SyncCollector(stages)
        run.begin(desc="grpo")
        step = 0
        for step in range(1, recipe.train.steps + 1):
            timings: dict[str, float] = {}
            batch, metrics = collect(timings)
            ahead = recipe.rollout.queue_next_step and step < recipe.train.steps
            metrics |= learn(
                stages, step, batch.samples, timings, queue_next=collect.queue_next if ahead else None
            )
            if run.step_done(step, metrics, timings):
                break
        serving = run.end(step)
        if recipe.train.checkpoint_at_end:
            stages.roles.policy.save_checkpoint(run_dir / "checkpoint")
            stages.roles.policy.save_hf_checkpoint(run_dir / EXPORT_DIR)
    return run.summary(step, **serving)
