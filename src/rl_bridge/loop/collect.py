"""Collection: a step's rollouts and their policy samples, as each loop gathers them.

The sync loop rolls out ``rollout.prompts_per_step`` prompts now (:class:`SyncCollector`, with
DAPO's dynamic sampling when asked); the async loop takes complete groups the collector threads
generated earlier (:func:`preprocess_groups`). Both report the same rollout and preprocessing
metrics (:func:`collected_metrics`).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rl_bridge.loop.replay import Group
from rl_bridge.loop.stages.preprocess import StepBatch
from rl_bridge.loop.stages.rollout import rollout_metrics
from rl_bridge.loop.step import Stages
from rl_bridge.loop.timing import WakeClock, timed
from rl_bridge.rollout import RolloutResult, RolloutStats

__all__ = ["SyncCollector", "collected_metrics", "preprocess_groups", "sync_row_order"]

_PER_SAMPLE = (
    "preprocess/media/videos_per_sample",
    "preprocess/media/images_per_sample",
    "preprocess/tool_calls_per_sample",
    "preprocess/turns_per_sample",
    "preprocess/trained_turns_per_sample",
    "preprocess/sequences_per_sample",
    "preprocess/groups/zero_signal_frac",
)
"""Preprocessing metrics that are means: averaged over dynamic sampling's rounds, not summed."""


def sync_row_order(num_rows: int, seed: int) -> Iterator[int]:
    """The sync loop's data order: training row indices, pass after pass without end, each pass a
    fresh shuffle by one ``random.Random(seed)``, taken from the end of the shuffled list.

    (The async loop's order is :class:`rl_bridge.loop.replay.DataOrder`.)
    """
    rng = random.Random(seed)
    while True:
        order = list(range(num_rows))
        rng.shuffle(order)
        while order:
            yield order.pop()


def collected_metrics(
    results: Sequence[RolloutResult], stats: RolloutStats, preprocess: Mapping[str, float]
) -> dict[str, float]:
    """A step's rollout metrics (:func:`~rl_bridge.loop.stages.rollout.rollout_metrics`), its
    preprocessing metrics and ``rollout/generated_tokens_per_s``: the tokens the policy generated
    in its trained turns (vLLM's own ids) per second of rollout (``rollout/wall_s``)."""
    tokens_per_s = preprocess.get("preprocess/generated_tokens", 0.0) / max(stats.wall_s, 1e-9)
    return {**rollout_metrics(results, stats), **preprocess, "rollout/generated_tokens_per_s": tokens_per_s}


def preprocess_groups(stages: Stages, groups: Sequence[Group]) -> tuple[StepBatch, dict[str, float]]:
    """The async loop's collection: the buffered groups' samples and the step's metrics (the
    groups were generated concurrently: see :meth:`RolloutStats.combined`)."""
    results = [result for group in groups for result in group.results]
    calls = [
        group.stats
        or RolloutStats(rows=len(group.results), outcomes=Counter(r.outcome for r in group.results))
        for group in groups
    ]
    batch, preprocess = stages.preprocess(results)
    return batch, collected_metrics(results, RolloutStats.combined(calls, concurrent=True), preprocess)


class QueuedRollout:
    """A step's first round of rollouts sent ahead (``rollout.queue_next_step``): the rollout
    stage's :meth:`~rl_bridge.loop.stages.rollout.RolloutStage.groups` on a daemon thread (a run
    that ends early does not wait for it), collected by :meth:`wait`. Their ``rollout.timeout_s``
    counts from when :attr:`woken` is set (vLLM's KV cache woke), not through the training."""

    def __init__(self, stage: Any, prompts: list[dict[str, Any]]) -> None:
        self._done: dict[str, Any] = {}
        self.sent = time.monotonic()
        self.woken = WakeClock()
        self._thread = threading.Thread(
            target=self._run, args=(stage, prompts), name="queued-rollout", daemon=True
        )
        self._thread.start()

    def _run(self, stage: Any, prompts: list[dict[str, Any]]) -> None:
        try:
            self._done["out"] = stage.groups(prompts, clock=self.woken)
        except BaseException as error:  # noqa: BLE001 (raised again by wait, in the loop's thread)
            self._done["error"] = error
        self._done["finished"] = time.monotonic()

    def wait(self) -> tuple[list[RolloutResult], RolloutStats, float]:
        """The results and stats, and how long the requests were out before this call (seconds).
        The stats' ``wall_s`` is their generation: from the start of vLLM's wake
        (:attr:`WakeClock.since`) to the last result, however much of it ran before this call
        (the step's end: its metrics, a validation); from this call when vLLM never woke for them.

        Raises:
            Exception: whatever the rollout raised.
        """
        waited_from = time.monotonic()
        self._thread.join()
        if "error" in self._done:
            raise self._done["error"]
        results, stats = self._done["out"]
        started = waited_from if self.woken.since is None else self.woken.since
        generated = self._done["finished"] - started
        return results, dataclasses.replace(stats, wall_s=generated), waited_from - self.sent


class SyncCollector:
    """The sync loop's collection: roll out and preprocess the next prompts (see :meth:`__call__`)."""

    def __init__(self, stages: Stages) -> None:
        self.stages = stages
        self._rows = sync_row_order(len(stages.data.train_rows), stages.recipe.seed)
        self._queued: QueuedRollout | None = None

    def queue_next(self) -> WakeClock:
        """Send the next step's first round of rollouts now (``rollout.queue_next_step``: vLLM
        sleeps and queues them); the next :meth:`__call__` waits for them. Returns the clock to
        start once vLLM's KV cache woke: their ``rollout.timeout_s`` counts from then, their
        generation (``rollout/wall_s``) from when the wake began."""
        if self._queued is not None:
            raise RuntimeError("queue_next: the rollouts sent ahead before were not collected")
        self._queued = QueuedRollout(self.stages.rollout, self.next_prompts())
        return self._queued.woken

    def next_prompts(self) -> list[dict[str, Any]]:
        """The next ``prompts_per_step`` training rows; each pass over the rows is reshuffled."""
        rows = self.stages.data.train_rows
        return [rows[next(self._rows)] for _ in range(self.stages.recipe.rollout.prompts_per_step)]

    def __call__(self, timings: dict[str, float]) -> tuple[StepBatch, dict[str, float]]:
        """Roll out and preprocess one step's prompts, timing both stages in ``timings``.

        With ``train.dynamic_sampling`` (DAPO's dynamic sampling), groups without signal are
        dropped and further rounds of ``prompts_per_step`` prompts are rolled out until the step
        holds ``prompts_per_step`` groups with signal or ``dynamic_sampling_max_rounds`` rounds
        were made; surplus groups of the last round are not used. Rollout metrics are over every
        round's rollouts, preprocessing counts summed over the rounds (means averaged);
        ``dynamic/rounds``, ``dynamic/groups_dropped`` and ``dynamic/groups_kept`` say what
        happened.

        After :meth:`queue_next` the first round is the one sent ahead: the stage waits for it
        (``time/rollout_s``, from the wait's start: what it adds to the step), ``rollout/wall_s``
        is its generation (from vLLM's wake to the last result: :meth:`QueuedRollout.wait`) and
        ``rollout/queued_s`` says how long it was out before the wait.
        """
        train = self.stages.recipe.train
        wanted = self.stages.recipe.rollout.prompts_per_step
        batch = StepBatch()
        results: list[RolloutResult] = []
        calls: list[RolloutStats] = []
        preprocess: dict[str, float] = {}
        dropped = rounds = 0
        queued_s = None
        while True:
            rounds += 1
            with timed("rollout", timings, add=True):
                if self._queued is not None:
                    queued, self._queued = self._queued, None
                    round_results, stats, queued_s = queued.wait()
                else:
                    round_results, stats = self.stages.rollout.groups(self.next_prompts())
            with timed("preprocess", timings, add=True):
                round_batch, round_metrics = self.stages.preprocess(round_results)
            results += round_results
            calls.append(stats)
            for name, value in round_metrics.items():
                preprocess[name] = preprocess.get(name, 0.0) + value
            if not train.dynamic_sampling:
                batch = round_batch
                break
            for group, zero in zip(round_batch.groups, round_batch.zero_signal, strict=True):
                if zero or not group:
                    dropped += 1
                elif len(batch.groups) < wanted:
                    batch.extend(StepBatch(groups=[group], zero_signal=[False]))
            if len(batch.groups) >= wanted or rounds >= train.dynamic_sampling_max_rounds:
                break
        for name in _PER_SAMPLE:
            if name in preprocess:
                preprocess[name] /= rounds
        metrics = collected_metrics(results, RolloutStats.combined(calls), preprocess)
        if queued_s is not None:
            metrics["rollout/queued_s"] = queued_s
        if train.dynamic_sampling:
            metrics |= {
                "dynamic/rounds": float(rounds),
                "dynamic/groups_dropped": float(dropped),
                "dynamic/groups_kept": float(len(batch.groups)),
            }
        return batch, metrics
