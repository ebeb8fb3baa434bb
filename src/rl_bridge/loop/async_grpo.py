"""The asynchronous GRPO loop: collector threads fill a replay buffer while the trainer trains.

The collector (:class:`~rl_bridge.loop.collector.Collector`) generates complete groups with
whatever weights vLLM serves, each tagged with the weight version at dispatch. Per step the
trainer takes ``rollout.prompts_per_step`` complete groups, oldest first (groups older than
``async.max_age`` versions are evicted and generated again), preprocesses them and learns from
them as the sync loop does (:func:`~rl_bridge.loop.step.learn`: the GRPO loss weights each token
by the truncated ``pi_old / mu``, ``mu`` vLLM's logprobs of the sampled tokens), refitting vLLM as
version ``step-<N>``. With ``async.refit_pause_mode: keep`` vLLM freezes the requests running at
the refit and they continue on the new weights; the collector keeps dispatching meanwhile. With
``async.epochs`` the data is finite: once it is used up the trainer trains on what is left and
stops. Checkpoints, resume and ``groups.jsonl``: :mod:`rl_bridge.loop.checkpoints`. Besides every
metric of the sync loop, each step logs ``async/*``: the groups' staleness and the buffer's state.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from rl_bridge.loop.checkpoints import GroupLog, open_run_dir, restore, save_checkpoint
from rl_bridge.loop.collect import preprocess_groups
from rl_bridge.loop.collector import Collector
from rl_bridge.loop.replay import DataOrder, ReplayBuffer
from rl_bridge.loop.run import Run
from rl_bridge.loop.step import learn
from rl_bridge.loop.timing import timed
from rl_bridge.recipe import EXPORT_DIR, Recipe

__all__ = ["run_async"]


def run_async(recipe: Recipe, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run ``recipe`` asynchronously; returns the summary also written to ``summary.json``.

    Args:
        recipe: the run; ``recipe.async_`` holds the async settings.
        resume: continue the run in ``recipe.run_dir`` from its latest checkpoint.
        overwrite: start afresh over an earlier run in ``recipe.run_dir`` (else it is refused).

    Raises:
        rl_bridge.loop.rundir.RunDirError, ValueError: see :func:`~rl_bridge.loop.checkpoints.open_run_dir`.
        RuntimeError: the collector failed, or vLLM does not serve the restored version.
        rl_bridge.services.process.ServiceError: a server did not start.
        rl_bridge.refit.client.RefitError: a refit failed.
    """
    recipe.require_hardware()  # before an old run directory is touched
    run_dir, checkpoint = open_run_dir(recipe, resume=resume, overwrite=overwrite)
    settings, per_step = recipe.async_, recipe.rollout.prompts_per_step
    with ExitStack() as stack:
        run = Run(recipe, run_dir, stack)
        stages = run.stages
        with run.setting_up():
            order = DataOrder(num_rows=len(stages.data.train_rows), seed=recipe.seed, epochs=settings.epochs)
            buffer = ReplayBuffer(order, capacity=settings.buffer_groups, max_age=settings.max_age)
            version = restore(checkpoint, stages, buffer) if checkpoint is not None else 0
        run.begin(desc="async grpo", resumed_at=version if checkpoint is not None else None)
        groups_log = GroupLog(run_dir / "groups.jsonl", append=resume, drop_after=version)
        stack.callback(groups_log.close)
        workers = max(1, recipe.rollout.max_in_flight // recipe.rollout.group_size)
        collector = Collector(
            buffer,
            lambda row: stages.rollout.groups([row]),
            stages.data.train_rows,
            workers=workers,
            weight_version=lambda: version,
        )
        stack.callback(collector.stop)
        collector.start()
        step = version
        while step < recipe.train.steps:
            timings: dict[str, float] = {}
            with timed("rollout", timings):  # the trainer's wait for complete groups
                groups, evicted = buffer.sample(per_step, version)
            collector.raise_if_failed()
            if not groups:
                break
            step += 1
            with timed("preprocess", timings):
                batch, metrics = preprocess_groups(stages, groups)
            metrics |= learn(stages, step, batch.samples, timings, pause_mode=settings.refit_pause_mode)
            trained_at, version = version, step
            groups_log.write(step, groups, trained_at)
            metrics |= buffer.staleness(groups, trained_at, evicted)
            stop = run.step_done(step, metrics, timings)
            if settings.checkpoint_every and step % settings.checkpoint_every == 0:
                save_checkpoint(run_dir, step, stages, buffer)
            if stop:
                break
        collector.stop()
        collector.raise_if_failed()
        serving = run.end(step)
        final = save_checkpoint(run_dir, step, stages, buffer)
        stages.roles.policy.save_hf_checkpoint(run_dir / EXPORT_DIR)
    return run.summary(
        step,
        **serving,
        data_exhausted=buffer.exhausted(),
        resumed_from=str(checkpoint) if checkpoint is not None else None,
        checkpoint=str(final),
        evicted_groups=buffer.evicted,
    )
