"""One run's stages (:class:`Stages`) and what a step does once its rollouts are collected
(:func:`learn`): logprobs, train, refit. The loops differ only in how they collect
(:mod:`rl_bridge.loop.collect`) and in when weights move (the async loop's refit lets running
requests continue, ``async.refit_pause_mode``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rl_bridge.loop.stages.logprobs import add_logprobs
from rl_bridge.loop.stages.preprocess import Preprocessor
from rl_bridge.loop.stages.refit import Refitter
from rl_bridge.loop.stages.rollout import MaskedLog, RolloutStage
from rl_bridge.loop.stages.train import TrainStage
from rl_bridge.loop.stages.validate import validate
from rl_bridge.loop.timing import WakeClock, timed
from rl_bridge.recipe import Recipe
from rl_bridge.refit.client import PauseMode

__all__ = ["Stages", "learn"]


@dataclass
class Stages:
    """A run's recipe, task data and started roles, and its stages built over them."""

    recipe: Recipe
    data: Any
    """The task's :class:`~rl_bridge.tasks.TaskData`."""
    roles: Any
    """The started :class:`~rl_bridge.backends.handles.Roles`."""
    rollout: RolloutStage
    preprocess: Preprocessor
    train: TrainStage
    refit: Refitter

    @classmethod
    def build(cls, recipe: Recipe, data: Any, roles: Any) -> Stages:
        from gym_video_env import MediaSettings
        from rl_bridge.backends.vllm_servers import run_processor
        from rl_bridge.megatron.policy_loss import GRPOPolicyLoss
        from rl_bridge.policy_inputs import PolicyInputBuilder
        from rl_bridge.structured_outputs import GrammarMasks
        from rl_bridge.tasks import turn_choices

        masked = MaskedLog(recipe.run_dir.resolve())
        inputs = PolicyInputBuilder(
            run_processor(recipe, data),
            MediaSettings(media_root=data.media_root),
            trained_turns=recipe.train.trained_turns,
            grammars=[GrammarMasks(data.model_dir, choices) for choices in turn_choices(recipe)],
            max_store_bytes=recipe.train.media_store_mb * 1024**2,
        )
        return cls(
            recipe=recipe,
            data=data,
            roles=roles,
            rollout=RolloutStage(recipe, roles.agent_url, roles.vllm_supervisor, masked),
            preprocess=Preprocessor(recipe, inputs, masked),
            train=TrainStage(recipe, roles.policy, GRPOPolicyLoss(recipe.train.loss)),
            refit=Refitter(recipe, roles),
        )

    def logprobs(self, samples: list[Any]) -> list[Any]:
        """:func:`~rl_bridge.loop.stages.logprobs.add_logprobs` with the run's policy and reference."""
        return add_logprobs(self.recipe, self.roles.policy, self.roles.reference, samples)

    def validate(self) -> dict[str, float]:
        """:func:`~rl_bridge.loop.stages.validate.validate` on the held-out rows."""
        return validate(self.rollout, self.data.val_rows)


def learn(
    stages: Stages,
    step: int,
    samples: list[Any],
    timings: dict[str, float],
    *,
    pause_mode: PauseMode = "wait",
    queue_next: Callable[[], WakeClock] | None = None,
) -> dict[str, float]:
    """Logprobs, train and refit (as version ``step-<step>``) on a step's samples, each timed in
    ``timings``; returns the train and refit metrics. The weights lock is held throughout, so a
    restart's reload sees the weights vLLM serves; colocated vLLM sleeps while the policy computes.

    ``queue_next`` (``rollout.queue_next_step``, colocated): called once vLLM sleeps, to send the
    next step's rollouts, which vLLM queues; its weights alone wake for the refit, and its KV cache
    wakes after it, which starts the queued requests on the new weights. The clock it returns is
    started then, with when that wake began: the queued requests' timeout counts from it, their
    generation from the wake."""
    queued = queue_next is not None
    if queued and stages.recipe.model.placement != "colocated":
        raise ValueError("learn: queue_next needs model.placement='colocated' (vLLM asleep queues requests)")
    woken: WakeClock | None = None
    with stages.refit.lock:
        with stages.refit.generation_asleep(timings, queued=queued):
            if queue_next is not None:
                woken = queue_next()
            with timed("logprobs", timings):
                samples = stages.logprobs(samples)
            with timed("train", timings):
                train_metrics = stages.train(samples)
        with timed("refit", timings):
            trained = train_metrics["train/optimizer_steps"] > 0
            refit_metrics = stages.refit(step, pause_mode=pause_mode, trained=trained, resume=not queued)
        if woken is not None:
            waking = time.monotonic()
            stages.refit.wake_queued(timings)
            woken.start(waking)
    return {**train_metrics, **refit_metrics}
