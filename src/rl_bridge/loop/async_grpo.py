"""The asynchronous GRPO loop: a collector fills a replay buffer while the trainer trains.

:func:`run_async` runs a ``mode: async`` :class:`~rl_bridge.recipe.Recipe` on one host:

- **Collector**: ``rollout.max_in_flight // rollout.group_size`` threads each claim a data
  position from the :class:`~rl_bridge.loop.replay.ReplayBuffer` (waiting while it is full),
  generate the whole group (G samples of the row) through the Gym agent with whatever weights vLLM
  serves, and buffer it tagged with the weight version at dispatch.
- **Trainer** (this thread), per step: take ``rollout.prompts_per_step`` complete groups, oldest
  first (groups older than ``async.max_age`` versions are evicted and generated again), then
  preprocess, logprobs (the proximal policy: the trainer's current weights), train (the GRPO loss
  weights each token by the truncated ``pi_old / mu`` with ``mu`` vLLM's logprobs of the sampled
  tokens), and refit vLLM as version ``step-<N>``. With ``async.refit_pause_mode: keep`` vLLM
  freezes the requests running at the refit (vLLM's ``pause?mode=keep``) and they continue on
  the new weights; the collector keeps dispatching (new requests queue during the pause).
- **End**: with ``async.epochs`` set the data is finite; once every position was generated and
  the buffer holds less than a step, the trainer trains on what is left (a smaller last step),
  writes the final checkpoint and summary, and stops every server. ``train.steps`` also ends the
  run.
- **Checkpoints** (every ``async.checkpoint_every`` steps and at the end) in
  ``<run_dir>/checkpoints/step-<N>``, written to a temporary directory and renamed (only the
  latest is kept): the policy (model, optimizer, step, torch RNG;
  :meth:`~rl_bridge.megatron.policy.MegatronPolicy.save_checkpoint`), the buffered groups
  (``buffer.jsonl``: the rollout results, re-preprocessed after a resume) and ``state.json``
  (weight version, data position and the positions claimed but not buffered, which are generated
  again; the data order is a function of the recipe seed and the position).
- **Resume** (``resume=True``): restores all of it, refits vLLM to the restored weights as the
  same version ``step-<N>`` (checked, and written to ``resume.json``), drops the metrics and
  group records of steps after ``N`` (they are trained again) and appends to them.

Besides ``metrics.jsonl`` (with ``async/*`` staleness metrics per step), ``groups.jsonl`` records
every consumed group: step, data position, row id, weight version and age.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rl_bridge.console import attach_run_log, stdout_to_run_log
from rl_bridge.recipe import EXPORT_DIR, Recipe
from rl_bridge.loop.controller import Controller, timed
from rl_bridge.loop.metrics import RunMetrics, curves_title, write_curves
from rl_bridge.loop.report import RunReport, announce_run
from rl_bridge.loop.replay import DataOrder, Group, ReplayBuffer, read_groups, write_groups
from rl_bridge.backends.roles import start_roles
from rl_bridge.loop.rundir import RunDirError, new_run_dir, resumable_run_dir
from rl_bridge.loop.tasks import prepare_task
from rl_bridge.rollout import ROLLOUT_OUTCOMES, RolloutResult

__all__ = ["Collector", "latest_checkpoint", "run_async"]

_STATE_FORMAT = 1
#: Recipe fields a resumed run must share with the checkpointed one (they fix the data order
#: and the meaning of a group).
_RESUME_KEYS = ("seed", "task", "model")


class Collector:
    """Threads that generate complete groups into a :class:`ReplayBuffer` (see the module docstring)."""

    def __init__(
        self,
        buffer: ReplayBuffer,
        generate: Callable[[Mapping[str, Any]], list[RolloutResult]],
        rows: Sequence[Mapping[str, Any]],
        *,
        workers: int,
        weight_version: Callable[[], int],
    ) -> None:
        """
        Args:
            buffer: where the groups go (and the data positions come from).
            generate: the G rollouts of one row (called from the collector's threads).
            rows: the training rows, indexed by the buffer's row ids.
            workers: groups generated at once.
            weight_version: the trainer's current weight version (read at each dispatch).
        """
        self.buffer = buffer
        self._generate = generate
        self._rows = rows
        self._weight_version = weight_version
        self._threads = [
            threading.Thread(target=self._work, name=f"collector-{i}", daemon=True) for i in range(workers)
        ]
        self._error: BaseException | None = None

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop claiming positions and wait for the groups being generated (they are buffered)."""
        self.buffer.close()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()

    def raise_if_failed(self) -> None:
        """Raise the collector's failure, if it had one.

        Raises:
            RuntimeError: a collector thread failed (chained to its exception).
        """
        if self._error is not None:
            raise RuntimeError(f"the rollout collector failed: {self._error!r}") from self._error

    def _work(self) -> None:
        while (claim := self.buffer.claim(self._weight_version())) is not None:
            try:
                results = self._generate(self._rows[claim.row_id])
            except BaseException as error:
                self.buffer.release(claim)
                self._error = error
                self.buffer.close()
                return
            self.buffer.put(claim, results)


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest complete checkpoint of ``run_dir`` (``checkpoints/step-<N>`` with ``state.json``).

    Raises:
        rl_bridge.loop.rundir.RunDirError: there is none (a user error: one line from the CLI).
    """
    candidates = [
        path
        for path in (run_dir / "checkpoints").glob("step-*")
        if (path / "state.json").is_file() and path.name.removeprefix("step-").isdigit()
    ]
    if not candidates:
        raise RunDirError(
            f"{run_dir}: no checkpoint to resume from in checkpoints/ (the run stopped before its first; "
            "async.checkpoint_every sets how often): start it again with --overwrite"
        )
    return max(candidates, key=lambda p: int(p.name.removeprefix("step-")))


def run_async(recipe: Recipe, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run ``recipe`` asynchronously (see the module docstring); returns the summary also written
    to ``summary.json``.

    Args:
        recipe: the run; ``recipe.async_`` holds the async settings.
        resume: continue the run in ``recipe.run_dir`` from its latest checkpoint instead of
            starting afresh.
        overwrite: start afresh over an earlier run in ``recipe.run_dir`` (else it is refused).

    Raises:
        rl_bridge.loop.rundir.RunDirError: ``recipe.run_dir`` holds an earlier run (without
            ``resume`` or ``overwrite``) or files of no run; ``resume`` and no run there.
        FileNotFoundError: ``resume`` and the run directory has no checkpoint.
        ValueError: ``resume`` with a recipe whose seed, task or model differ from the
            checkpointed run's.
        RuntimeError: the collector failed, or vLLM does not serve the restored version.
        rl_bridge.services.process.ServiceError: a server did not start.
        rl_bridge.refit.client.RefitError: a refit failed.
    """
    recipe.require_hardware()  # before an old run directory is touched
    checkpoint: Path | None = None
    if resume:
        run_dir = resumable_run_dir(recipe.run_dir)
        checkpoint = latest_checkpoint(run_dir)
        _check_resumable(json.loads((run_dir / "recipe.json").read_text()), recipe)
    else:
        run_dir = new_run_dir(recipe.run_dir, overwrite=overwrite, resumable=True)
    (run_dir / "recipe.json").write_text(recipe.model_dump_json(indent=2, by_alias=True))
    announce_run(recipe, run_dir, attach_run_log(run_dir))
    settings = recipe.async_
    started = time.monotonic()
    with ExitStack() as stack:
        setup: dict[str, float] = {}
        with timed("setup", setup), stdout_to_run_log():
            data = prepare_task(recipe)
            controller = Controller(recipe, data, start_roles(recipe, data, stack))
            order = DataOrder(num_rows=len(data.train_rows), seed=recipe.seed, epochs=settings.epochs)
            buffer = ReplayBuffer(order, capacity=settings.buffer_groups, max_age=settings.max_age)
            version = 0
            if checkpoint is not None:
                version = _restore(checkpoint, controller, buffer)
        metrics = RunMetrics(run_dir, append=resume, drop_after=version if resume else None)
        stack.callback(metrics.close)
        groups_log = _GroupLog(run_dir / "groups.jsonl", append=resume, drop_after=version)
        stack.callback(groups_log.close)

        def generate(row: Mapping[str, Any]) -> list[RolloutResult]:
            return controller.rollout([row])[0]

        collector = Collector(
            buffer,
            generate,
            data.train_rows,
            workers=max(1, recipe.rollout.max_in_flight // recipe.rollout.group_size),
            weight_version=lambda: version,
        )
        stack.callback(collector.stop)
        report = RunReport(
            recipe, controller, metrics, desc="async grpo", started=started, initial_step=version
        )
        if checkpoint is None:
            if recipe.warm_start.steps:  # a resumed run's checkpoint holds the warm-started weights
                metrics.log(0, controller.warm_start())
            report.start()
        collector.start()
        step = version
        while step < recipe.train.steps:
            timings: dict[str, float] = {}
            with timed("rollout", timings):  # the trainer's wait for complete groups
                groups, evicted = buffer.sample(recipe.rollout.prompts_per_step, version)
            collector.raise_if_failed()
            if not groups:
                break
            step += 1
            results = [result for group in groups for result in group.results]
            with timed("preprocess", timings):
                batch, preprocess_metrics = controller.preprocess(results)
            with timed("logprobs", timings):
                samples = controller.logprobs(batch.samples)
            with controller.weights_lock:  # a restart's reload sees the weights vLLM serves
                with timed("train", timings):
                    train_metrics = controller.train(samples)
                with timed("refit", timings):
                    refit_metrics = controller.refit(
                        step,
                        pause_mode=settings.refit_pause_mode,
                        trained=train_metrics["train/optimizer_steps"] > 0,
                    )
            trained_at, version = version, step
            timings["time/step_s"] = sum(timings.values())
            ages = [group.age(trained_at) for group in groups]
            staleness = {
                "async/groups": float(len(groups)),
                "async/age_mean": sum(ages) / len(ages),
                "async/age_max": float(max(ages)),
                "async/evicted": float(evicted),
                "async/evicted_total": float(buffer.evicted),
                "async/buffered": float(len(buffer)),
            }
            groups_log.write(step, groups, trained_at)
            stop = report.step_done(
                step,
                {
                    **_rollout_metrics(results),
                    **preprocess_metrics,
                    **train_metrics,
                    **refit_metrics,
                    **staleness,
                    **timings,
                },
            )
            if settings.checkpoint_every and step % settings.checkpoint_every == 0:
                _save_checkpoint(run_dir, step, controller, buffer)
            if stop:
                break
        collector.stop()
        collector.raise_if_failed()
        report.finish(step)
        final_checkpoint = _save_checkpoint(run_dir, step, controller, buffer)
        controller.roles.policy.save_hf_checkpoint(run_dir / EXPORT_DIR)
        serving = controller.serving_summary()
        write_curves(
            metrics.history,
            run_dir / "curves.png",
            chance=1.0 / recipe.task.num_options,
            title=curves_title(recipe, run_dir),
        )

    return report.summary(
        steps=step,
        setup_s=setup["time/setup_s"],
        **serving,
        data_exhausted=buffer.exhausted(),
        resumed_from=str(checkpoint) if checkpoint is not None else None,
        checkpoint=str(final_checkpoint),
        evicted_groups=buffer.evicted,
    )


def _rollout_metrics(results: Sequence[RolloutResult]) -> dict[str, float]:
    """The ``rollout/*`` counts of a step's groups (as :class:`~rl_bridge.rollout.RolloutStats`
    reports them for one call) and the mean reward of the rows that succeeded."""
    outcomes = Counter(r.outcome for r in results)
    rewards = [r.reward for r in results if r.reward is not None]
    return {
        "rollout/rows": float(len(results)),
        **{f"rollout/{name}": float(outcomes[name]) for name in ROLLOUT_OUTCOMES},
        "rollout/retries": float(sum(r.attempts - 1 for r in results)),
        "rollout/redispatches": float(sum(r.redispatches for r in results)),
        "rollout/crashed_server": float(sum(r.crashed_server for r in results)),
        "rollout/reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
    }


class _GroupLog:
    """``groups.jsonl``: one record per consumed group (step, position, row id, version, age)."""

    def __init__(self, path: Path, *, append: bool, drop_after: int) -> None:
        if append and path.exists():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= drop_after]
            path.write_text("".join(line + "\n" for line in kept))
        self._file = path.open("a" if append else "w", encoding="utf-8")

    def write(self, step: int, groups: Sequence[Group], trained_at: int) -> None:
        for group in groups:
            record = {
                "step": step,
                "position": group.position,
                "row_id": group.row_id,
                "weight_version": group.weight_version,
                "age": group.age(trained_at),
            }
            self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _save_checkpoint(run_dir: Path, step: int, controller: Controller, buffer: ReplayBuffer) -> Path:
    """Write the resumable state after ``step`` to ``checkpoints/step-<step>`` atomically (a
    temporary directory renamed into place); older checkpoints are removed afterwards."""
    root = run_dir / "checkpoints"
    target = root / f"step-{step}"
    staging = root / f".staging-step-{step}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    ledger, groups = buffer.snapshot()
    controller.roles.policy.save_checkpoint(staging / "policy")
    write_groups(staging / "buffer.jsonl", groups)
    state = {"format": _STATE_FORMAT, "step": step, "weight_version": step, "buffer": ledger}
    (staging / "state.json").write_text(json.dumps(state, indent=2))
    if target.exists():  # the final checkpoint after a periodic one of the same step
        shutil.rmtree(target)
    staging.rename(target)
    for old in root.glob("step-*"):
        if old != target:
            shutil.rmtree(old)
    return target


def _restore(checkpoint: Path, controller: Controller, buffer: ReplayBuffer) -> int:
    """Load ``checkpoint`` into the policy and the buffer and make vLLM serve its weights under
    the same version; returns the weight version (the step the checkpoint was written after).

    Raises:
        ValueError: an unknown ``state.json`` format, or a policy step that disagrees with it.
        RuntimeError: vLLM reports another version after the refit.
    """
    state = json.loads((checkpoint / "state.json").read_text())
    if state.get("format") != _STATE_FORMAT:
        raise ValueError(
            f"{checkpoint / 'state.json'}: format {state.get('format')}, expected {_STATE_FORMAT}"
        )
    version = int(state["weight_version"])
    policy_step = controller.roles.policy.load_checkpoint(checkpoint / "policy")
    if policy_step != version:
        raise ValueError(
            f"{checkpoint}: the policy was saved at step {policy_step}, state.json says {version}"
        )
    buffer.restore(state["buffer"], read_groups(checkpoint / "buffer.jsonl"))
    expected = f"step-{version}" if version > 0 else "default"
    if version > 0:
        controller.refit(version)
    served = controller.served_weight_version()
    if served != expected:
        raise RuntimeError(
            f"after restoring {checkpoint} vLLM serves weight version {served!r}, not {expected!r}"
        )
    resumed = {"checkpoint": str(checkpoint), "weight_version": version, "served_weight_version": served}
    (checkpoint.parent.parent / "resume.json").write_text(json.dumps(resumed, indent=2))
    return version


def _check_resumable(saved: Mapping[str, Any], recipe: Recipe) -> None:
    """Raise ``ValueError`` naming the first of :data:`_RESUME_KEYS` whose value in the saved
    ``recipe.json`` differs from ``recipe``'s. The saved recipe is read through today's
    :class:`Recipe` first, so a field added since (at its default) is not a change."""
    current = recipe.model_dump(mode="json", by_alias=True)
    try:
        saved = Recipe.model_validate(saved).model_dump(mode="json", by_alias=True)
    except ValueError:  # no longer a valid recipe: compare what was written
        pass
    for key in _RESUME_KEYS:
        if saved.get(key) != current[key]:
            raise ValueError(
                f"cannot resume {recipe.run_dir}: recipe field {key!r} changed since the checkpoint "
                f"({saved.get(key)!r} -> {current[key]!r})"
            )
