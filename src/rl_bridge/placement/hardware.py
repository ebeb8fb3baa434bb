"""The machines a plan places on, their GPUs, and the error a recipe that does not fit them raises."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Device", "GiB", "Hardware", "PlacementError"]

GiB = 2**30
"""Bytes in a GiB (all memory figures are binary, as ``nvidia-smi`` and torch report them)."""


class PlacementError(ValueError):
    """The recipe cannot be placed on the hardware: the message names both values."""


@dataclass(frozen=True)
class Hardware:
    """Where a plan places: ``nodes`` hosts, each with ``gpus_per_node`` GPUs of ``gpu_memory_bytes``."""

    nodes: int = 1
    gpus_per_node: int = 0
    """GPUs per host; 0: CPU only."""
    gpu_memory_bytes: int = 0
    """Memory of one GPU, bytes (what torch reports as ``total_memory``)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 0 or self.gpu_memory_bytes < 0:
            raise ValueError(
                f"Hardware: nodes={self.nodes} must be >= 1, gpus_per_node={self.gpus_per_node} and "
                f"gpu_memory_bytes={self.gpu_memory_bytes} >= 0"
            )
        if self.gpus_per_node and not self.gpu_memory_bytes:
            raise ValueError(f"Hardware: {self.gpus_per_node} GPUs per node need gpu_memory_bytes > 0")

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def detect(cls) -> Hardware:
        """This host as torch sees it: one node, its CUDA devices and the first one's memory."""
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return cls(nodes=1, gpus_per_node=0, gpu_memory_bytes=0)
        memory = torch.cuda.get_device_properties(0).total_memory
        return cls(nodes=1, gpus_per_node=torch.cuda.device_count(), gpu_memory_bytes=int(memory))

    def describe(self) -> str:
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        if not self.gpus_per_node:
            return f"{nodes}, no GPUs"
        return f"{nodes} x {self.gpus_per_node} GPUs x {self.gpu_memory_bytes / GiB:.1f} GiB"


@dataclass(frozen=True, order=True)
class Device:
    """One GPU: ``gpu`` is its local index on host ``node`` (``CUDA_VISIBLE_DEVICES`` there)."""

    node: int
    gpu: int

    def __str__(self) -> str:
        return f"n{self.node}:g{self.gpu}"
