"""Two steps of the sync GRPO loop with every role in a Ray actor, on a local Ray cluster, the
policy as two workers at tensor parallel size 2.

The test starts a real one-node cluster (``ray start --head --block``, stopped afterwards) and runs
:func:`rl_bridge.loop.sync.run_sync` with ``cluster.backend=ray`` against its address, the
placement of ``model.cpu_policy_ranks=2`` and ``model.policy_tensor_parallel_size=2`` (the tiny
model's two attention heads split over two gloo ranks, its one KV head replicated). Checks the
accounting of the local sync-loop test (every row accounted for, vLLM serves ``step-2``, vLLM and
trainer logprobs agree after the refit, which gathered the TP shards), that each role ran in its
own actor process with the vLLM server a child of its actor, and that no server or actor process
outlives the run.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rl_bridge.backends.ray_cluster import PLACEMENT_FILE
from rl_bridge.loop.sync import run_sync
from rl_bridge.recipe import load_recipe
from rl_bridge.services.process import ManagedProcess, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS, GROUP = 4, 4
#: Logical CPUs of the test cluster: one each for the vLLM, Gym and two policy-worker actors.
CLUSTER_CPUS = 4
#: Longest wait for ``ray start`` to report the cluster up, in seconds.
CLUSTER_START_TIMEOUT_S = 240.0
#: ``ray start`` tries: its node fails to start when the raylet's agents miss their start deadline.
CLUSTER_START_ATTEMPTS = 2
#: Seconds ``ray start --block`` gets after SIGTERM before its process group is killed. It did not
#: exit within 20 s in any run (the teardown took 20.1 s each time); the run under test has stopped
#: its own actors and servers by then, which ``test_no_server_or_actor_outlives_the_run`` checks.
CLUSTER_STOP_GRACE_S = 3.0


def _live_group_members(group: int) -> list[int]:
    """Processes of process group ``group`` that are not zombies (Linux ``/proc``)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, _ppid, pgid = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgid) == group and state != "Z":
            members.append(int(entry.name))
    return members


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A one-node Ray cluster on loopback (no dashboard, no usage stats); its GCS address.

    Authentication is off, explicitly (``RAY_AUTH_MODE=disabled``, for the cluster and this process
    for the duration of the module), so neither the user's ``~/.ray/auth_token`` nor the order of
    the tests matters: Ray fixes a process's authentication mode when it is first imported (vLLM's
    ``ModelConfig`` imports it, e.g. in the Nemotron audio tests), so a token mode set afterwards
    for this process would not reach the run's driver. The cluster listens on loopback only.

    The raylet gives its agent processes about 15 s to start; on a host whose cores are busy with
    other work they can miss that, so where the user may raise priorities (root) the cluster starts
    at nice -10 and is put back to normal priority once it is up (workers it starts later inherit
    the raylet's priority).
    """
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-"))  # short: Ray's socket paths must fit 107 bytes
    auth = {"RAY_AUTH_MODE": "disabled"}
    saved = {name: os.environ.get(name) for name in auth}
    process: ManagedProcess | None = None
    try:
        os.environ.update(auth)
        for attempt in range(1, CLUSTER_START_ATTEMPTS + 1):
            port = free_port()
            process = _start_head(port, temp_dir, auth, attempt)
            if process is not None:
                break
        else:
            raise RuntimeError(f"ray start --head failed {CLUSTER_START_ATTEMPTS} times; logs in {temp_dir}")
        yield f"127.0.0.1:{port}"
    finally:
        if process is not None:
            process.stop(timeout_s=CLUSTER_STOP_GRACE_S)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    shutil.rmtree(temp_dir, ignore_errors=True)


def _start_head(port: int, temp_dir: Path, env: dict[str, str], attempt: int) -> ManagedProcess | None:
    """``ray start --head --block`` on ``port``, once it reports the cluster up; ``None`` when it
    exited or timed out (it is stopped then)."""
    ray = Path(sys.executable).with_name("ray")
    argv = [
        str(ray), "start", "--head", "--block", f"--port={port}", f"--temp-dir={temp_dir}",
        f"--num-cpus={CLUSTER_CPUS}", "--num-gpus=0", "--node-ip-address=127.0.0.1",
        "--include-dashboard=false", "--disable-usage-stats",
    ]  # fmt: skip
    boosted = os.geteuid() == 0
    if boosted:
        argv = ["nice", "-n", "-10", *argv]
    process = ManagedProcess("ray-head", argv, log_path=temp_dir / f"ray_start_{attempt}.log", env=env)
    deadline = time.monotonic() + CLUSTER_START_TIMEOUT_S
    while "Ray runtime started" not in process.log_tail(200):
        if process.poll() is not None or time.monotonic() > deadline:
            process.stop()
            return None
        time.sleep(0.5)
    if boosted:
        for pid in _live_group_members(process.pid):
            os.setpriority(os.PRIO_PROCESS, pid, 0)
    return process


@pytest.fixture(scope="module")
def run(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict], dict]:
    run_dir = tmp_path_factory.mktemp("ray") / "run"
    recipe = load_recipe(
        None,
        [
            f"run_dir={run_dir}",
            "train.steps=2",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.group_size={GROUP}",
            "task.train_rows=8",
            "task.val_rows=4",
            "validation.every=2",
            "cluster.backend=ray",
            f"cluster.ray_address={ray_address}",
            "model.cpu_policy_ranks=2",
            "model.policy_tensor_parallel_size=2",
        ],
    )
    summary = run_sync(recipe)
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    placement = json.loads((run_dir / "logs" / PLACEMENT_FILE).read_text())
    return summary, history, placement


def test_every_row_is_accounted_for(run: tuple[dict, list[dict], dict]) -> None:
    summary, history, _ = run
    steps = [r for r in history if "rollout/rows" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["rollout/rows"] == PROMPTS * GROUP
        outcomes = record["rollout/ok"] + record["rollout/content_failed"] + record["rollout/infra_failed"]
        assert outcomes == PROMPTS * GROUP
        assert record["preprocess/samples"] + record["preprocess/masked"] == PROMPTS * GROUP
        assert record["preprocess/media/placeholder_pass_rate"] == 1.0
    assert summary["rows"] == 2 * PROMPTS * GROUP == summary["rows_ok"]
    assert summary["masked"] == 0


def test_vllm_serves_the_refitted_weights_and_matches_the_trainer(
    run: tuple[dict, list[dict], dict],
) -> None:
    summary, history, _ = run
    assert summary["served_weight_version"] == "step-2"
    assert summary["placement"] == {
        "backend": "ray", "vllm_servers": 1, "vllm_tensor_parallel": 1, "policy_ranks": 2,
        "policy_tensor_parallel": 2, "policy_pipeline_parallel": 1, "policy_data_parallel": 1,
        "distributed_optimizer": False,
    }  # fmt: skip
    step2 = next(r for r in history if r["step"] == 2 and "rollout/rows" in r)
    assert step2["refit/weight_version"] == 2.0
    assert 1.0 <= step2["mismatch/token_mult_prob_error"] < 1.01
    assert step2["mismatch/seq_mult_prob_error_max"] < 1.05
    assert [v["step"] for v in summary["validation_accuracy"]] == [0, 2]


def test_each_role_ran_in_its_own_ray_actor(run: tuple[dict, list[dict], dict]) -> None:
    _, _, placement = run
    roles = placement["roles"]
    assert set(roles) == {"vllm", "gym", "policy[rank 0]", "policy[rank 1]"}
    assert placement["hardware"] == "1 node, no GPUs"  # planned against the cluster Ray reports
    actor_pids = {info["pid"] for info in roles.values()}
    assert len(actor_pids) == 4
    assert os.getpid() not in actor_pids and placement["driver"]["pid"] == os.getpid()
    # The vLLM server was started by its actor; the Gym servers are other processes again.
    assert placement["vllm"]["server_ppid"] == roles["vllm"]["pid"]
    assert not actor_pids & set(placement["gym"]["server_pids"].values())
    assert placement["policy_layouts"] == [
        {
            "rank": rank, "world_size": 2, "tensor_parallel": 2, "data_parallel": 1,
            "tensor_parallel_rank": rank, "data_parallel_rank": 0, "device": "cpu", "backend": "gloo",
            "pipeline_parallel": 1, "pipeline_parallel_rank": 0,
        }
        for rank in (0, 1)
    ]  # fmt: skip


def test_no_server_or_actor_outlives_the_run(run: tuple[dict, list[dict], dict]) -> None:
    _, _, placement = run
    groups = [placement["vllm"]["server_pid"], *placement["gym"]["server_pids"].values()]
    actors = [info["pid"] for info in placement["roles"].values()]
    deadline = time.monotonic() + 30  # the raylet reaps killed actors asynchronously
    while time.monotonic() < deadline and any(_alive(pid) for pid in actors):
        time.sleep(0.5)
    assert [pid for pid in actors if _alive(pid)] == []
    assert {group: _live_group_members(group) for group in groups} == {group: [] for group in groups}


def test_a_run_that_does_not_fit_the_cluster_is_refused_before_its_actors_start(
    ray_address: str, tmp_path: Path
) -> None:
    from contextlib import ExitStack

    from rl_bridge.backends.ray_cluster import start_ray_roles
    from rl_bridge.placement import PlacementError

    overrides = ["model.vllm_gpus=1", "model.policy_gpus=1", "model.layer_spec=local"]
    recipe = load_recipe(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "cluster.backend=ray",
            f"cluster.ray_address={ray_address}",
            *overrides,
        ],
    )
    with pytest.raises(PlacementError, match=r"needs 2 GPUs .*the hardware has 0 \(1 node, no GPUs\)"):
        with ExitStack() as stack:
            start_ray_roles(recipe, None, stack)  # type: ignore[arg-type] - refused before the task data is read
