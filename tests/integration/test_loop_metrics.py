"""The sync and async loops log the same metrics: one recipe (the shipped async one), run for two
steps in each mode through the CLI, must write the same metric names to ``metrics.jsonl`` apart
from the async loop's own, listed here. Both loops run the same stage code
(:mod:`rl_bridge.loop.stages`); this catches a metric that one loop adds or drops on its way."""

from __future__ import annotations

import pytest

from tests.fixtures.training import TrainedRun, train_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ASYNC_ONLY = {
    "async/groups",
    "async/age_mean",
    "async/age_max",
    "async/evicted",
    "async/evicted_total",
    "async/buffered",
}
"""What only the async loop logs: the staleness of the groups a step trained on, and the buffer's."""

_SHORT = (
    "train.steps=2",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "task.train_rows=32",
    "task.val_rows=8",
    "validation.every=1",
    "async.buffer_groups=8",
)


def _recipe() -> str:
    from rl_bridge.paths import project_root

    return str(project_root() / "recipes" / "tiny_cpu_async.yaml")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainedRun]:
    return {
        "sync": train_cli(tmp_path_factory.mktemp("sync"), "-r", _recipe(), *_SHORT, "mode=sync"),
        "async": train_cli(tmp_path_factory.mktemp("async"), "-r", _recipe(), *_SHORT),
    }


def _step_names(run: TrainedRun) -> set[str]:
    return {name for record in run.steps for name in record} - {"step"}


def test_sync_and_async_log_the_same_step_metrics_apart_from_the_async_ones(
    runs: dict[str, TrainedRun],
) -> None:
    sync, asynchronous = (_step_names(runs[mode]) for mode in ("sync", "async"))
    assert ASYNC_ONLY <= asynchronous
    assert sync == asynchronous - ASYNC_ONLY, (
        f"only sync: {sorted(sync - asynchronous)}; only async: {sorted(asynchronous - ASYNC_ONLY - sync)}"
    )
    # The rollout counts the async loop used to drop are there, and counted right.
    for name in ("rollout/server_restarts", "rollout/wall_s", "rollout/generated_tokens_per_s"):
        assert name in asynchronous
    for record in runs["async"].steps:
        assert record["rollout/rows"] == 16.0 and record["rollout/ok"] == 16.0
        assert record["rollout/wall_s"] > 0


def test_both_validate_the_same_way(runs: dict[str, TrainedRun]) -> None:
    for run in runs.values():
        validated = [int(r["step"]) for r in run.history if "val/accuracy" in r]
        assert validated == [0, 1, 2]
        assert run.summary["steps"] == 2 and run.summary["served_weight_version"] == "step-2"


def test_the_recipe_files_are_the_same(runs: dict[str, TrainedRun]) -> None:
    """The two runs differ in their mode only (the comparison above is of one recipe)."""
    import json

    recipes = {mode: json.loads((run.run_dir / "recipe.json").read_text()) for mode, run in runs.items()}
    for recipe in recipes.values():
        recipe.pop("mode")
        recipe.pop("run_dir")
    assert recipes["sync"] == recipes["async"]
