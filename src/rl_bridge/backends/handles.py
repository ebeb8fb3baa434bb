"""What the controller gets from a started run: :class:`Roles`, with a :class:`PolicyHandle` for
the trainer, whichever backend started them (:func:`rl_bridge.backends.launch.start_roles`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from rl_bridge.placement import Plan
    from rl_bridge.services.supervisor import ServiceSupervisor

__all__ = ["PolicyHandle", "Roles", "placement_summary"]


class PolicyHandle(Protocol):
    """The trainer's side of a run (:class:`rl_bridge.megatron.policy.MegatronPolicy` or a proxy)."""

    def logprobs(self, batch: Sequence[Any]) -> list[torch.Tensor]: ...

    def train_step(self, batch: Sequence[Any], loss_fn: Any, *, return_logprobs: bool = False) -> Any: ...

    def save_hf_checkpoint(self, directory: str | Path) -> Path: ...

    def save_checkpoint(self, directory: str | Path) -> Path: ...

    def load_checkpoint(self, directory: str | Path) -> int: ...

    def connect_vllm(
        self,
        base_url: str,
        *,
        backend: str,
        bucket_bytes: int,
        vllm_workers: int = 1,
        timeout_s: float = 600.0,
    ) -> None: ...

    def send_weights_to_vllm(self, base_url: str | None = None) -> dict[str, float]: ...

    def memory_stats(self, *, reset: bool = False) -> dict[str, float]: ...

    def release_memory(self) -> float: ...


@dataclass(frozen=True)
class Roles:
    """The started roles of one run."""

    vllm_base_urls: tuple[str, ...]
    """Each vLLM server's root (``http://host:port``), for refits and weight-version checks."""
    agent_url: str | tuple[str, ...]
    """The Gym agent server whose ``/run`` produces one rollout, or its replicas
    (``rollout.gym_workers``; a batch's prompts are dealt out over them, each group to one)."""
    policy: PolicyHandle
    reference: PolicyHandle | None
    """The frozen reference policy; ``None`` unless the loss has a KL term."""
    vllm_supervisor: ServiceSupervisor[Any] | None = None
    """Restarts a dead vLLM server of the group (rollouts re-dispatch the rows it had in flight);
    ``None`` where the placement supervises its own processes."""
    placement: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What was started (:func:`placement_summary`), for the run's summary."""


def placement_summary(plan: Plan, backend: str) -> dict[str, Any]:
    """The started layout in a few numbers: backend, vLLM servers and their TP size, policy ranks
    and their TP, PP and DP sizes, whether the optimizer is distributed."""
    return {
        "backend": backend,
        "vllm_servers": len(plan.vllm),
        "vllm_tensor_parallel": plan.vllm[0].tensor_parallel,
        "policy_ranks": len(plan.policy),
        "policy_tensor_parallel": plan.tensor_parallel,
        "policy_pipeline_parallel": plan.pipeline_parallel,
        "policy_data_parallel": plan.data_parallel,
        "distributed_optimizer": plan.distributed_optimizer,
    }
