"""The async loop's resumable state: checkpoints, the resume, and the record of consumed groups.

- **Checkpoints** (every ``async.checkpoint_every`` steps and at the end) in
  ``<run_dir>/checkpoints/step-<N>``, written to a temporary directory and renamed (only the
  latest is kept): the policy (model, optimizer, step, torch RNG;
  :meth:`~rl_bridge.megatron.policy.MegatronPolicy.save_checkpoint`), the buffered groups
  (``buffer.jsonl``: the rollout results, re-preprocessed after a resume) and ``state.json``
  (weight version, data position and the positions claimed but not buffered, which are generated
  again; the data order is a function of the recipe seed and the position).
- **Resume**: :func:`open_run_dir` checks that the recipe's seed, task and model are the
  checkpointed run's; :func:`restore` loads all of it and refits vLLM to the restored weights as
  the same version ``step-<N>`` (checked, and written to ``resume.json``).
- ``groups.jsonl`` (:class:`GroupLog`) records every consumed group: step, data position, row id,
  weight version and age.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rl_bridge.loop.replay import Group, ReplayBuffer, read_groups, write_groups
from rl_bridge.loop.rundir import RunDirError, new_run_dir, resumable_run_dir
from rl_bridge.loop.step import Stages
from rl_bridge.recipe import Recipe

__all__ = ["GroupLog", "latest_checkpoint", "open_run_dir", "restore", "save_checkpoint"]

_STATE_FORMAT = 1
#: Recipe fields a resumed run must share with the checkpointed one (they fix the data order
#: and the meaning of a group).
_RESUME_KEYS = ("seed", "task", "model")


def open_run_dir(recipe: Recipe, *, resume: bool, overwrite: bool) -> tuple[Path, Path | None]:
    """The run directory and, with ``resume``, the checkpoint to resume from.

    Raises:
        rl_bridge.loop.rundir.RunDirError: ``recipe.run_dir`` holds an earlier run (without
            ``resume`` or ``overwrite``) or files of no run; ``resume`` and no run or no
            checkpoint there.
        ValueError: ``resume`` with a recipe whose seed, task or model differ from the
            checkpointed run's.
    """
    if not resume:
        return new_run_dir(recipe.run_dir, overwrite=overwrite, resumable=True), None
    run_dir = resumable_run_dir(recipe.run_dir)
    checkpoint = latest_checkpoint(run_dir)
    _check_resumable(json.loads((run_dir / "recipe.json").read_text()), recipe)
    return run_dir, checkpoint


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


class GroupLog:
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


def save_checkpoint(run_dir: Path, step: int, stages: Stages, buffer: ReplayBuffer) -> Path:
    """Write the resumable state after ``step`` to ``checkpoints/step-<step>`` atomically (a
    temporary directory renamed into place); older checkpoints are removed afterwards."""
    root = run_dir / "checkpoints"
    target = root / f"step-{step}"
    staging = root / f".staging-step-{step}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    ledger, groups = buffer.snapshot()
    stages.roles.policy.save_checkpoint(staging / "policy")
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


def restore(checkpoint: Path, stages: Stages, buffer: ReplayBuffer) -> int:
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
    policy_step = stages.roles.policy.load_checkpoint(checkpoint / "policy")
    if policy_step != version:
        raise ValueError(
            f"{checkpoint}: the policy was saved at step {policy_step}, state.json says {version}"
        )
    buffer.restore(state["buffer"], read_groups(checkpoint / "buffer.jsonl"))
    expected = f"step-{version}" if version > 0 else "default"
    if version > 0:
        stages.refit(version)
    served = stages.refit.served_weight_version()
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
