"""Faults under a real rollout: vLLM killed mid-rollout and restarted by its supervisor, a Gym
resources server that fails or hangs for some rows, a row the model server refuses. Every row ends
exactly once, ok or counted as failed.

Servers: the session's ``vllm_corpus_server`` (``tests/fixtures/vllm.py``: this package's loader
selected server-wide, as the bad-input tests run it; not the ``vllm_server`` other tests use, since
it is killed here; the supervisor restarts it with the same command), and one Gym config with
the ``video_vllm_model`` model server, two ``simple_agent`` agents and two resources servers:
``video_mcqa``, and ``flaky_mcqa``, a small Gym resources server written below
that fails by the row's ``fault`` field (HTTP 500 always, HTTP 500 once, or a hang once).
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from rl_bridge.paths import project_root
from rl_bridge.recipe import TaskSection
from rl_bridge.rollout import RolloutResult, RolloutSettings, collect_rollouts
from rl_bridge.services.gym_server import (
    GymServers,
    GymServerSpec,
    start_gym_servers,
    video_model_server_spec,
)
from rl_bridge.services.supervisor import RestartPolicy, ServiceSupervisor
from rl_bridge.services.vllm_server import VLLMServer
from tests.fixtures.bad_inputs import FaultRecorder
from video_grpo_demo.task import task_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MCQA_AGENT = "mcqa_agent"
FLAKY_AGENT = "flaky_agent"

FLAKY_SERVER = '''\
"""A resources server that fails on purpose, by the row's ``fault``: ``error`` (HTTP 500 on every
call), ``flaky`` (HTTP 500 on the first call), ``hang`` (no answer on the first call); reward 1.0."""

import asyncio
from collections import Counter

from fastapi import HTTPException
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from pydantic import ConfigDict

CALLS: Counter[str] = Counter()


class FlakyConfig(BaseResourcesServerConfig):
    pass


class FlakyVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")
    row_id: str
    fault: str = "none"


class FlakyVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")


class FlakyServer(SimpleResourcesServer):
    ray_enabled = False
    config: FlakyConfig

    async def verify(self, body: FlakyVerifyRequest) -> FlakyVerifyResponse:
        CALLS[body.row_id] += 1
        first = CALLS[body.row_id] == 1
        if body.fault == "error" or (body.fault == "flaky" and first):
            raise HTTPException(status_code=500, detail=f"injected failure for {body.row_id}")
        if body.fault == "hang" and first:
            await asyncio.sleep(3600)
        return FlakyVerifyResponse(**body.model_dump(), reward=1.0)


if __name__ == "__main__":
    FlakyServer.run_webserver()
'''


@dataclass
class Stack:
    vllm: VLLMServer
    supervisor: ServiceSupervisor[VLLMServer]
    gym: GymServers
    rows: list[dict[str, Any]]
    media_root: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, vllm_corpus_server: VLLMServer) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("rollout_faults")
    media_root = run_dir / "media"
    task = TaskSection(num_frames=5, width=32, height=32)
    rows = task_rows(task, media_root, 16, seed=0, subdir="clips")
    for index, row in enumerate(rows):
        row["row_id"] = f"row-{index:02d}"
        row["responses_create_params"] = {**row["responses_create_params"], "max_output_tokens": 2}
    extra_root = run_dir / "servers"
    (extra_root / "resources_servers" / "flaky_mcqa").mkdir(parents=True)
    (extra_root / "resources_servers" / "flaky_mcqa" / "app.py").write_text(FLAKY_SERVER)

    vllm = vllm_corpus_server
    assert vllm.config.allowed_local_media_path is not None
    assert media_root.resolve().is_relative_to(vllm.config.allowed_local_media_path.resolve())
    assert vllm.process.poll() is None
    model = video_model_server_spec(
        "policy_model", openai_url=vllm.openai_url, model=vllm.model_name, media_root=media_root
    )
    mcqa = GymServerSpec("video_mcqa", "resources_servers", "video_mcqa", {"domain": "knowledge"})
    flaky = GymServerSpec("flaky_mcqa", "resources_servers", "flaky_mcqa", {"domain": "other"})
    specs = [
        model,
        mcqa,
        flaky,
        *(
            GymServerSpec(
                name,
                "responses_api_agents",
                "simple_agent",
                {"resources_server": server.ref(), "model_server": model.ref(), "max_steps": 1},
            )
            for name, server in ((MCQA_AGENT, mcqa), (FLAKY_AGENT, flaky))
        ),
    ]
    gym = start_gym_servers(
        specs, run_dir=run_dir / "gym", extra_roots=[project_root() / "src", extra_root], timeout_s=600
    )
    supervisor = ServiceSupervisor(vllm, RestartPolicy(max_restarts=2, probe_interval_s=0.5))
    try:
        yield Stack(vllm, supervisor, gym, rows, media_root)
    finally:
        gym.stop()  # vLLM is the session's: the pool stops it after its last test


def _assert_each_row_once(rows: list[dict[str, Any]], results: list[RolloutResult]) -> None:
    assert [r.index for r in results] == list(range(len(rows)))
    answered = [r.result["row_id"] for r in results if r.result is not None]
    assert len(answered) == len(set(answered))
    assert all(rows[r.index]["row_id"] == r.result["row_id"] for r in results if r.result is not None)


def _outcomes(results: list[RolloutResult]) -> str:
    """``"2/2 ok, attempts [2, 2]"``: outcomes out of the rows, and each row's attempts."""
    counts = Counter(r.outcome for r in results)
    shares = ", ".join(f"{count}/{len(results)} {outcome}" for outcome, count in sorted(counts.items()))
    return f"{shares}, attempts {[r.attempts for r in results]}"


def _reason(error: str | None, marker: str = "invalid_media", chars: int = 200) -> str:
    """At most ``chars`` characters of ``error`` that end with its last ``marker`` and start at a
    word (the inner server's message and error code, at the end of the agent's nested error text),
    without the nesting's backslashes; its first ``chars`` when ``marker`` is not in it."""
    text = (error or "").replace("\\", "")
    end = text.rfind(marker) + len(marker)
    if end < len(marker):
        return text[:chars]
    start = max(end - chars, 0)
    return text[start:end] if start == 0 else text[start:end].partition(" ")[2]


def test_vllm_killed_mid_rollout_is_restarted_and_every_row_completes(
    stack: Stack, record_fault: FaultRecorder
) -> None:
    rows = stack.rows
    done: list[RolloutResult] = []
    killed: list[int] = []

    def kill_after_three(result: RolloutResult) -> None:
        """SIGKILL vLLM's process group once three rows are done (the next ones are in flight)."""
        done.append(result)
        if len(done) == 3:
            killed.append(stack.vllm.process.pid)
            os.killpg(stack.vllm.process.pid, signal.SIGKILL)

    settings = RolloutSettings(max_in_flight=4, max_attempts=2, timeout_s=120, backoff_s=1.0)
    with stack.supervisor.watch(interval_s=2.0):
        results, stats = collect_rollouts(
            stack.gym.url(MCQA_AGENT),
            rows,
            settings,
            supervisor=stack.supervisor,
            on_done=kill_after_three,
        )

    answered = [r.result["row_id"] for r in results if r.result is not None]
    record_fault(
        "vllm_killed_mid_rollout",
        f"{'killed after 3 rows' if killed else 'never killed'}; "
        f"{stats.outcomes['ok']}/{len(rows)} rows ok, {stats.server_restarts} restart(s), "
        f"{stats.redispatches} re-dispatched after the restart, {stats.retries} retried, "
        f"{len(answered) - len(set(answered))} duplicate row ids, "
        f"{len(rows) - len(set(answered))} missing",
    )
    assert killed, "vLLM was never killed: the rollout finished before three rows did"
    _assert_each_row_once(rows, results)
    assert [r.outcome for r in results] == ["ok"] * len(rows), [r.error for r in results if r.outcome != "ok"]
    assert stats.outcomes["ok"] == stats.rows == len(rows)
    assert stats.server_restarts == 1 and stack.supervisor.generation == 1
    (restart,) = stack.supervisor.restarts
    assert "exited" in restart.reason and stack.vllm.process.pid != killed[0]
    # The restarted server answers.
    assert requests.get(stack.vllm.health_url, timeout=10).status_code == 200


def test_failing_and_hanging_resources_server_rows_are_retried_then_counted(
    stack: Stack, record_fault: FaultRecorder
) -> None:
    faults = ["none"] * 4 + ["flaky"] * 2 + ["hang"] * 2 + ["error"] * 2
    rows = [{**row, "fault": fault} for row, fault in zip(stack.rows, faults, strict=False)]
    # A video outside the media root: the model server refuses it (a content error, never retried).
    refused = {**stack.rows[-1], "row_id": "row-refused", "fault": "none"}
    refused["responses_create_params"] = {
        **refused["responses_create_params"],
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_video", "video_url": "../../outside.mp4"},
                    {"type": "input_text", "text": "Which colour?"},
                ],
            }
        ],
    }
    rows.append(refused)
    settings = RolloutSettings(max_in_flight=4, max_attempts=2, timeout_s=30, backoff_s=0.5)
    results, stats = collect_rollouts(stack.gym.url(FLAKY_AGENT), rows, settings, supervisor=stack.supervisor)

    by_fault: dict[str, list[RolloutResult]] = {}
    for row, result in zip(rows, results, strict=True):
        by_fault.setdefault("refused" if row is refused else row["fault"], []).append(result)
    others = f"the {len(by_fault.get('none', []))} fault-free rows: {_outcomes(by_fault.get('none', []))}"
    for fault_id, fault in [
        ("resources_server_error", "error"),
        ("resources_server_flaky", "flaky"),
        ("resources_server_hang", "hang"),
    ]:
        record_fault(fault_id, f"{_outcomes(by_fault.get(fault, []))}; {others}")
    record_fault(
        "model_server_refuses_row",
        "; ".join(f"{_outcomes([r])}: {_reason(r.error)}" for r in by_fault.get("refused", [])),
    )
    _assert_each_row_once(rows, results)
    assert all(r.outcome == "ok" and r.attempts == 1 for r in by_fault["none"])
    assert all(r.outcome == "ok" and r.attempts == 2 for r in by_fault["flaky"] + by_fault["hang"])
    assert all(r.outcome == "infra_failed" and r.attempts == 2 for r in by_fault["error"])
    (refusal,) = by_fault["refused"]
    assert (
        refusal.outcome == "content_failed"
        and refusal.attempts == 1
        and "invalid_media" in (refusal.error or "")
    )
    assert stats.outcomes == {"ok": 8, "infra_failed": 2, "content_failed": 1}
    assert stats.retries == 2 + 2 + 2 and stats.redispatches == 0 and stats.server_restarts == 0
    # The servers still answer a good row.
    (again,), _ = collect_rollouts(stack.gym.url(MCQA_AGENT), stack.rows[:1], settings)
    assert again.outcome == "ok"
