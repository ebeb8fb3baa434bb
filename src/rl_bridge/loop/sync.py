"""The synchronous GRPO loop: rollout -> preprocessing -> logprobs -> train -> refit, repeated.

:func:`run_sync` runs a whole :class:`~rl_bridge.recipe.Recipe` on one host:

1. builds the tiny model and writes the task clips (training and held-out rows;
   :func:`rl_bridge.loop.tasks.prepare_task`);
2. starts vLLM (dev mode, for refits), the Gym servers on loopback and the Megatron policy
   (:func:`rl_bridge.backends.roles.start_roles`);
3. with ``warm_start.steps``, takes that many supervised steps on the task's first-turn
   demonstrations and refits vLLM (:meth:`~rl_bridge.loop.controller.Controller.warm_start`);
4. per step, each stage timed, runs the stages of :class:`rl_bridge.loop.controller.Controller`:
   rollout and preprocess (repeated with ``train.dynamic_sampling``), logprobs (``pi_old`` when
   the step needs it, the reference policy's with a KL term), train (``train.epochs x
   train.minibatches`` optimizer steps), refit (versioned by step);
5. validates on the held-out rows with greedy decoding before the first step, every
   ``validation.every`` steps and after the last (:class:`rl_bridge.loop.report.RunReport`);
   on GPUs each step also records the policy's CUDA memory (``gpu/policy_*``) and the device's
   peak in use by every process (``gpu/device_peak_used_gib``);
6. logs every metric to TensorBoard and ``metrics.jsonl``, draws the PNG curves, saves a checkpoint,
   writes ``summary.json`` and stops everything it started.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

from rl_bridge.console import attach_run_log, stdout_to_run_log
from rl_bridge.recipe import EXPORT_DIR, Recipe
from rl_bridge.loop.controller import Controller, timed
from rl_bridge.loop.metrics import DeviceMemoryMonitor, RunMetrics, curves_title, write_curves
from rl_bridge.loop.report import RunReport, announce_run
from rl_bridge.backends.roles import start_roles
from rl_bridge.loop.rundir import new_run_dir
from rl_bridge.loop.tasks import prepare_task

__all__ = ["run_sync"]


def run_sync(recipe: Recipe, *, overwrite: bool = False) -> dict[str, Any]:
    """Run ``recipe`` (see the module docstring); returns the summary also written to ``summary.json``.

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
    (run_dir / "recipe.json").write_text(recipe.model_dump_json(indent=2, by_alias=True))
    announce_run(recipe, run_dir, attach_run_log(run_dir))
    started = time.monotonic()
    with ExitStack() as stack:
        setup: dict[str, float] = {}
        with timed("setup", setup), stdout_to_run_log():
            data = prepare_task(recipe)
            controller = Controller(recipe, data, start_roles(recipe, data, stack))
        metrics = RunMetrics(run_dir)
        stack.callback(metrics.close)
        report = RunReport(recipe, controller, metrics, desc="grpo", started=started)
        if recipe.warm_start.steps:
            metrics.log(0, controller.warm_start())
        memory = DeviceMemoryMonitor()
        stack.callback(memory.close)
        memory.take_peak()
        controller.roles.policy.memory_stats(reset=True)
        report.start()
        step = 0
        for step in range(1, recipe.train.steps + 1):
            timings: dict[str, float] = {}
            batch, collect_metrics = controller.collect(timings)
            samples = batch.samples
            with controller.weights_lock:  # a restart's reload sees the weights vLLM serves
                with controller.sleeping_generation(timings):  # colocated: vLLM sleeps meanwhile
                    with timed("logprobs", timings):
                        samples = controller.logprobs(samples)
                    with timed("train", timings):
                        train_metrics = controller.train(samples)
                with timed("refit", timings):
                    refit_metrics = controller.refit(step, trained=train_metrics["train/optimizer_steps"] > 0)
            timings["time/step_s"] = sum(value for name, value in timings.items() if name.startswith("time/"))
            gpu = {f"gpu/policy_{k}": v for k, v in controller.roles.policy.memory_stats(reset=True).items()}
            peak = memory.take_peak()
            if peak is not None:
                gpu["gpu/device_peak_used_gib"] = peak
            if report.step_done(
                step, {**collect_metrics, **train_metrics, **refit_metrics, **timings, **gpu}
            ):
                break
        report.finish(step)
        if recipe.train.checkpoint_at_end:
            controller.roles.policy.save_checkpoint(run_dir / "checkpoint")
            controller.roles.policy.save_hf_checkpoint(run_dir / EXPORT_DIR)
        serving = controller.serving_summary()
        write_curves(
            metrics.history,
            run_dir / "curves.png",
            chance=1.0 / recipe.task.num_options,
            title=curves_title(recipe, run_dir),
        )
    return report.summary(steps=step, setup_s=setup["time/setup_s"], **serving)
