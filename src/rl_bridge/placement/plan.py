"""The plan: which process gets which devices, and what each role's GPU holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rl_bridge.placement.allocation import PolicyRank, VLLMReplica
from rl_bridge.placement.hardware import Device, Hardware
from rl_bridge.placement.memory import MemoryEstimate, policy_gpu_need
from rl_bridge.placement.model_shape import ModelShape

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """Which process gets which devices, and what each role's GPU holds."""

    placement: Literal["split", "colocated", "cpu"]
    hardware: Hardware
    shape: ModelShape
    vllm: tuple[VLLMReplica, ...]
    policy: tuple[PolicyRank, ...]
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    expert_parallel: int
    tensor_groups: tuple[tuple[int, ...], ...]
    """Policy ranks of each tensor-parallel group (one model replica's shards of a stage)."""
    data_groups: tuple[tuple[int, ...], ...]
    """Policy ranks holding the same shard in each model replica (gradients all-reduced)."""
    pipeline_groups: tuple[tuple[int, ...], ...]
    expert_groups: tuple[tuple[int, ...], ...]
    reference: bool
    """Whether the forward-only reference policy runs (``kl_coef > 0``), on the policy ranks."""
    distributed_optimizer: bool
    """Optimizer state sharded over the data-parallel ranks (Megatron's distributed optimizer)."""
    vllm_memory: MemoryEstimate
    policy_memory: MemoryEstimate
    reference_memory: MemoryEstimate | None
    optimizer_offload_fraction: float = 0.0
    """Of each policy rank's optimizer state, the fraction in host memory
    (``train.optimizer_offload_fraction``; ``policy_memory.host_optimizer`` holds its bytes)."""

    @property
    def vllm_devices(self) -> frozenset[Device]:
        return frozenset(device for replica in self.vllm for device in replica.devices)

    @property
    def policy_devices(self) -> frozenset[Device]:
        return frozenset(rank.device for rank in self.policy if rank.device is not None)

    def policy_gpu_bytes(self) -> tuple[int, str]:
        """Peak bytes on one policy GPU and how they add up (colocated: vLLM's share included)."""
        return policy_gpu_need(self.placement, self.policy_memory, self.reference_memory, self.vllm_memory)
