"""The synchronous GRPO loop: rollout -> preprocessing -> logprobs -> train -> refit, repeated.

:func:`run_sync` runs a whole :class:`~rl_bridge.loop.config.Recipe` on one host:

1. builds the tiny model and writes the task clips (training and held-out rows;
   :func:`rl_bridge.loop.tasks.prepare_task`);
2. starts vLLM (dev mode, for refits), the Gym servers on loopback and the Megatron policy
   (:func:`rl_bridge.loop.roles.start_roles`);
3. per step, each stage timed, runs the stages of :class:`rl_bridge.loop.controller.Controller`:
   rollout, preprocess, logprobs, train, refit (versioned by step);
4. validates on the held-out rows with greedy decoding before the first step, every
   ``validation.every`` steps and after the last;
5. logs every metric to TensorBoard and ``metrics.jsonl``, draws the PNG curves, saves a checkpoint,
   writes ``summary.json`` and stops everything it started.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import ExitStack
from typing import Any

from tqdm import tqdm

from rl_bridge.loop.config import Recipe
from rl_bridge.loop.controller import Controller, timed
from rl_bridge.loop.metrics import RunMetrics, step_totals, write_curves
from rl_bridge.loop.roles import start_roles
from rl_bridge.loop.tasks import prepare_task

__all__ = ["run_sync"]


def run_sync(recipe: Recipe) -> dict[str, Any]:
    """Run ``recipe`` (see the module docstring); returns the summary also written to ``summary.json``.

    Raises:
        rl_bridge.services.process.ServiceError: a server did not start.
        vllm_video_plugin.refit.RefitError: a refit failed.
    """
    recipe.require_hardware()  # before an old run directory is touched
    run_dir = recipe.run_dir.resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "recipe.json").write_text(recipe.model_dump_json(indent=2, by_alias=True))
    chance = 1.0 / recipe.task.num_options
    started = time.monotonic()
    with ExitStack() as stack:
        setup: dict[str, float] = {}
        with timed("setup", setup):
            data = prepare_task(recipe)
            controller = Controller(recipe, data, start_roles(recipe, data, stack))
        metrics = RunMetrics(run_dir)
        stack.callback(metrics.close)
        val_every = recipe.validation.every
        history_val: list[tuple[int, float]] = []

        def validate(step: int) -> float:
            timings: dict[str, float] = {}
            with timed("validation", timings):
                scalars = controller.validate()
            metrics.log(step, {**scalars, **timings})
            history_val.append((step, scalars["val/accuracy"]))
            return scalars["val/accuracy"]

        accuracy = validate(0) if val_every else float("nan")
        bar = tqdm(range(1, recipe.train.steps + 1), desc="grpo", unit="step")
        step = 0
        for step in bar:
            timings: dict[str, float] = {}
            with timed("rollout", timings):
                results, rollout_metrics = controller.rollout(controller.next_prompts())
            with timed("preprocess", timings):
                samples, preprocess_metrics = controller.preprocess(results)
            with timed("logprobs", timings):
                samples = controller.logprobs(samples) if samples else []
            with timed("train", timings):
                train_metrics = controller.train(samples)
            with timed("refit", timings):
                refit_metrics = controller.refit(step)
            timings["time/step_s"] = sum(timings.values())
            metrics.log(
                step, {**rollout_metrics, **preprocess_metrics, **train_metrics, **refit_metrics, **timings}
            )
            if val_every and (step % val_every == 0 or step == recipe.train.steps):
                accuracy = validate(step)
            bar.set_postfix(reward=f"{rollout_metrics['rollout/reward_mean']:.2f}", val=f"{accuracy:.2f}")
            if recipe.validation.stop_at_target and accuracy >= recipe.validation.target_accuracy:
                break
        bar.close()
        if recipe.train.checkpoint_at_end:
            controller.roles.policy.save_checkpoint(run_dir / "checkpoint")
        served_version = controller.refit_client.weight_version()
        write_curves(metrics.history, run_dir / "curves.png", chance=chance)

    reached = next((s for s, acc in history_val if acc >= recipe.validation.target_accuracy), None)
    summary = {
        "steps": step,
        "served_weight_version": served_version,
        "chance_accuracy": chance,
        "validation_accuracy": [{"step": s, "accuracy": a} for s, a in history_val],
        "first_step_at_target": reached,
        "target_accuracy": recipe.validation.target_accuracy,
        **step_totals(metrics.history),
        "setup_s": setup["time/setup_s"],
        "wall_s": time.monotonic() - started,
        "curves": str(run_dir / "curves.png"),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
