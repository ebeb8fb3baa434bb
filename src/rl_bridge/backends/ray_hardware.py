"""The planner's :class:`~rl_bridge.placement.Hardware` for a Ray cluster, from what the cluster
reports, so a Ray run is checked like a local one (GPU count, tensor-parallel groups within a node,
memory per GPU) before any actor starts.

- Nodes: the alive nodes with at least one GPU (Ray's ``GPU`` resource); on a cluster without GPUs,
  every alive node (a CPU run).
- GPUs per node: the fewest any of those nodes has. The planner describes identical nodes, so a
  mixed cluster is planned as that many copies of its smallest GPU node: a plan that passes fits
  the real cluster.
- Memory of a GPU: Ray's resources do not give it (``accelerator_type:<name>`` names the model,
  not always the size: ``A100`` is 40 or 80 GB), so a task of no resources on each GPU node reads
  ``nvidia-smi``'s ``memory.total``; the smallest GPU of the cluster counts. A node whose GPUs
  cannot be read is left out of that minimum with a warning; when none can be, the memory checks
  are skipped (:data:`UNCHECKED_GPU_MEMORY`).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from rl_bridge.placement import GiB, Hardware, PlacementError

__all__ = ["UNCHECKED_GPU_MEMORY", "hardware_from_ray_nodes", "ray_cluster_hardware"]

logger = logging.getLogger(__name__)

UNCHECKED_GPU_MEMORY = 1024 * GiB
"""GPU memory planned with when no node's could be read: more than any GPU has, so no role is
refused for memory."""


def hardware_from_ray_nodes(
    nodes: Sequence[Mapping[str, Any]], gpu_memory_bytes: Mapping[str, int]
) -> Hardware:
    """The cluster of ``nodes`` (``ray.nodes()``) as the planner describes it (see the module
    docstring).

    Args:
        nodes: Ray's node records (``NodeID``, ``Alive``, ``Resources``).
        gpu_memory_bytes: node id -> memory of that node's smallest GPU, for the GPU nodes read.

    Raises:
        PlacementError: no node is alive.
    """
    alive = [node for node in nodes if node.get("Alive")]
    if not alive:
        raise PlacementError("the Ray cluster has no alive node to place the run on")
    gpu_nodes = [node for node in alive if node.get("Resources", {}).get("GPU", 0) >= 1]
    if not gpu_nodes:
        return Hardware(nodes=len(alive), gpus_per_node=0, gpu_memory_bytes=0)
    gpus = [int(node["Resources"]["GPU"]) for node in gpu_nodes]
    if len(set(gpus)) > 1:
        logger.info("Ray GPU nodes have %s GPUs: planning with %d per node", sorted(set(gpus)), min(gpus))
    memories = [gpu_memory_bytes[node["NodeID"]] for node in gpu_nodes if node["NodeID"] in gpu_memory_bytes]
    if not memories:
        logger.warning("the GPU memory of no Ray node could be read: the plan's memory checks are skipped")
    memory = min(memories) if memories else UNCHECKED_GPU_MEMORY
    return Hardware(nodes=len(gpu_nodes), gpus_per_node=min(gpus), gpu_memory_bytes=memory)


def ray_cluster_hardware(*, timeout_s: float) -> Hardware:
    """The connected Ray cluster as the planner describes it; each GPU node's memory read within
    ``timeout_s`` seconds."""
    import ray

    nodes = ray.nodes()
    gpu_nodes = [n["NodeID"] for n in nodes if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= 1]
    return hardware_from_ray_nodes(nodes, _read_gpu_memory(gpu_nodes, timeout_s=timeout_s))


def _read_gpu_memory(node_ids: Sequence[str], *, timeout_s: float) -> dict[str, int]:
    """Node id -> bytes of its smallest GPU, for the nodes that answered."""
    if not node_ids:
        return {}
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # No CPU or GPU asked: it runs even where the run's own actors or other jobs hold them all.
    read = ray.remote(num_cpus=0, max_retries=0)(_smallest_gpu_memory)
    refs = {
        node: read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        for node in node_ids
    }
    memory: dict[str, int] = {}
    for node, ref in refs.items():
        try:
            memory[node] = ray.get(ref, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - a node left out of the minimum, named in the warning
            logger.warning("could not read the GPU memory of Ray node %s: %s", node, exc)
    return memory


def _smallest_gpu_memory() -> int:
    """Bytes of this node's smallest GPU (``nvidia-smi`` reports MiB; it sees every GPU of the node
    whatever ``CUDA_VISIBLE_DEVICES`` says)."""
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    out = subprocess.run(query, capture_output=True, text=True, check=True, timeout=60).stdout
    return min(int(line) for line in out.split()) * 2**20
