"""The policy ranks' and the Ray backend's pure parts: cluster config validation, the data-parallel
split, the guardian, the cluster's hardware description from Ray's node list, the model loader's
arguments shared by the run and ``serve-vllm``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pydantic
import pytest
import torch

from rl_bridge.backends.policy_ranks import split_for_data_parallel
from rl_bridge.megatron.batch import PolicySample
from rl_bridge.recipe import load_recipe

pytestmark = pytest.mark.unit


def _sample(token: int) -> PolicySample:
    ids = torch.tensor([token, token + 1])
    return PolicySample(input_ids=ids, target_mask=torch.tensor([False, True]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.cpu_policy_ranks=3", "model.policy_tensor_parallel_size=2"], "does not divide"),
        (["cluster.ray_address=auto"], "needs cluster.backend='ray'"),
        (["cluster.backend=ray", "cluster.vllm.gpus=1"], "Extra inputs"),
        (["cluster.backend=ray", "cluster.policy_workers=2"], "Extra inputs"),
        (["model.cpu_vllm_servers=2", "model.vllm_gpus=1", "model.policy_gpus=1"], "size a CPU run"),
    ],
)
def test_cluster_section_rejects_inconsistent_settings(overrides: list[str], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        load_recipe(None, overrides)


def test_cluster_section_accepts_placement() -> None:
    cluster = load_recipe(
        None,
        [
            "cluster.backend=ray",
            "model.cpu_policy_ranks=4",
            "model.policy_tensor_parallel_size=2",
            "cluster.policy.resources={trainer: 1}",
            "cluster.vllm.node_id=abc",
        ],
    ).cluster
    assert cluster.policy.resources == {"trainer": 1.0}
    assert (cluster.vllm.node_id, cluster.gym.num_cpus) == ("abc", 1.0)


def test_split_keeps_order_and_balances() -> None:
    batch = [_sample(i) for i in range(5)]
    shares = split_for_data_parallel(batch, 2)
    assert [[int(s.input_ids[0]) for s in share] for share in shares] == [[0, 1, 2], [3, 4]]


def test_split_fills_empty_shares_with_zero_weight_copies() -> None:
    shares = split_for_data_parallel([_sample(7)], 3)
    assert [len(share) for share in shares] == [1, 1, 1]
    assert [share[0].loss_weight for share in shares] == [1.0, 0.0, 0.0]
    assert all(int(share[0].input_ids[0]) == 7 for share in shares)
    with pytest.raises(ValueError, match="non-empty batch"):
        split_for_data_parallel([], 2)


_OWNER = """
import sys, time
from rl_bridge.backends.ray_cluster import guard_process_groups
from rl_bridge.services.process import ManagedProcess
server = ManagedProcess("sleeper", ["sleep", "300"], log_path=sys.argv[1])
guard_process_groups([server.pid])
print(server.pid, flush=True)
time.sleep(300)
"""


def test_guardian_kills_the_servers_of_a_killed_owner(tmp_path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(tmp_path / "sleeper.log")], stdout=subprocess.PIPE, text=True
    )
    try:
        server = int(owner.stdout.readline())
        os.killpg(server, 0)  # running
        time.sleep(1.0)  # the guardian is polling
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.killpg(server, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the server group {server} outlived its killed owner")
    finally:
        owner.kill()
        owner.wait()


def _node(node_id: str, *, gpus: float = 0, alive: bool = True) -> dict:
    resources = {"CPU": 16.0, f"node:10.0.0.{len(node_id)}": 1.0} | ({"GPU": gpus} if gpus else {})
    return {"NodeID": node_id, "Alive": alive, "Resources": resources}


def test_a_ray_cluster_is_planned_as_its_gpu_nodes_smallest_gpu_count_and_memory() -> None:
    from rl_bridge.backends.ray_hardware import hardware_from_ray_nodes
    from rl_bridge.placement import GiB, Hardware

    # A CPU head node and three GPU workers (one with fewer GPUs, one with smaller GPUs), one dead.
    nodes = [
        _node("head"),
        _node("gpu-a", gpus=8),
        _node("gpu-b", gpus=8),
        _node("gpu-c", gpus=4),
        _node("gone", gpus=8, alive=False),
    ]
    memory = {"gpu-a": 80 * GiB, "gpu-b": 40 * GiB, "gpu-c": 80 * GiB, "gone": 10 * GiB}
    assert hardware_from_ray_nodes(nodes, memory) == Hardware(3, 4, 40 * GiB)
    # A node whose memory could not be read is left out of the minimum.
    assert hardware_from_ray_nodes(nodes, {"gpu-a": 80 * GiB}) == Hardware(3, 4, 80 * GiB)


def test_a_ray_cluster_without_gpus_is_planned_as_its_alive_nodes() -> None:
    from rl_bridge.backends.ray_hardware import hardware_from_ray_nodes
    from rl_bridge.placement import Hardware, PlacementError

    nodes = [_node("head"), _node("worker"), _node("gone", alive=False)]
    assert hardware_from_ray_nodes(nodes, {}) == Hardware(nodes=2, gpus_per_node=0, gpu_memory_bytes=0)
    with pytest.raises(PlacementError, match="no alive node"):
        hardware_from_ray_nodes([_node("gone", alive=False)], {})


def test_unread_gpu_memory_skips_the_memory_checks_but_not_the_gpu_counts() -> None:
    from rl_bridge.backends.ray_hardware import UNCHECKED_GPU_MEMORY, hardware_from_ray_nodes
    from rl_bridge.placement import Hardware, PlacementError, plan_placement

    hardware = hardware_from_ray_nodes([_node("gpu", gpus=2)], {})
    assert hardware == Hardware(1, 2, UNCHECKED_GPU_MEMORY)
    gpus = ["model.vllm_gpus=1", "model.policy_gpus=1", "model.layer_spec=local", "cluster.backend=ray"]
    assert plan_placement(load_recipe(None, gpus), hardware).placement == "split"
    with pytest.raises(PlacementError, match="needs 4 GPUs"):
        plan_placement(load_recipe(None, ["model.vllm_gpus=2", "model.policy_gpus=2", *gpus[2:]]), hardware)


def test_serve_vllm_and_the_run_hand_the_loader_the_same_contract_config() -> None:
    import json

    from rl_bridge.backends.vllm_servers import model_loader_args
    from vllm_video_plugin.contract import VideoSamplingContract
    from vllm_video_plugin.geometry import CONTRACT_CONFIG_KEY

    contract = VideoSamplingContract(style="qwen2_vl")
    flag, value = model_loader_args(contract)
    assert flag == "--model-loader-extra-config"
    assert VideoSamplingContract.model_validate(json.loads(value)[CONTRACT_CONFIG_KEY]) == contract
