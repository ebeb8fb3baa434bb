"""Training checkpoints of a :class:`~rl_bridge.megatron.policy.MegatronPolicy`: model, optimizer,
step counter and RNG state, per rank, so that training resumes exactly.

Each rank writes ``rank_<global rank>.pt`` (``torch.save`` of its state dicts: under tensor
parallelism its shards of the weights and optimizer state, and its own RNG states); rank 0 then
writes ``meta.json`` with the step, world size and tensor-parallel size, last, so a checkpoint
whose save was interrupted has no ``meta.json`` and is refused on load. Resuming needs the same
parallel layout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rl_bridge.megatron.cpu_support import cpu_support_needed

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

__all__ = ["load_checkpoint", "save_checkpoint"]

_CHECKPOINT_FORMAT = 1
_CHECKPOINT_META = "meta.json"


def save_checkpoint(
    directory: str | Path, *, module: torch.nn.Module, optimizer: MegatronOptimizer, step: int
) -> Path:
    """Save ``module``'s and ``optimizer``'s state, ``step`` and the RNG state to ``directory``
    (created if needed). Collective."""
    from megatron.core import parallel_state

    target = Path(directory)
    rank = torch.distributed.get_rank()
    if rank == 0:
        target.mkdir(parents=True, exist_ok=True)
        (target / _CHECKPOINT_META).unlink(missing_ok=True)
    torch.distributed.barrier()
    target.mkdir(parents=True, exist_ok=True)
    state = {
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "optimizer_parameters": _parameter_states(optimizer),
        "step": step,
        "rng": _rng_state(),
    }
    torch.save(state, target / f"rank_{rank:05d}.pt")
    torch.distributed.barrier()
    if rank == 0:
        meta = {
            "format": _CHECKPOINT_FORMAT,
            "step": step,
            "world_size": torch.distributed.get_world_size(),
            "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
        }
        (target / _CHECKPOINT_META).write_text(json.dumps(meta))
    torch.distributed.barrier()
    return target


def load_checkpoint(directory: str | Path, *, module: torch.nn.Module, optimizer: MegatronOptimizer) -> int:
    """Restore what :func:`save_checkpoint` wrote into ``module``, ``optimizer`` and the RNG;
    returns the saved step.

    Raises:
        FileNotFoundError: ``directory`` has no complete checkpoint (no ``meta.json`` or no
            file for this rank).
        ValueError: the checkpoint was written with another format, world size or
            tensor-parallel size.
    """
    from megatron.core import parallel_state

    source = Path(directory)
    meta_path = source / _CHECKPOINT_META
    rank_path = source / f"rank_{torch.distributed.get_rank():05d}.pt"
    if not meta_path.is_file() or not rank_path.is_file():
        raise FileNotFoundError(
            f"load_checkpoint: {source} has no complete checkpoint ({meta_path.name}, {rank_path.name})"
        )
    meta = json.loads(meta_path.read_text())
    expected = {
        "format": _CHECKPOINT_FORMAT,
        "world_size": torch.distributed.get_world_size(),
        "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
    }
    found = {name: meta.get(name) for name in expected}
    if found != expected:
        raise ValueError(f"load_checkpoint: {source} has {found}; this run expects {expected}")
    state = torch.load(rank_path, map_location="cpu", weights_only=True)
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if "optimizer_parameters" in state:  # not in checkpoints written before it was saved
        _load_parameter_states(optimizer, state["optimizer_parameters"])
    _own_adam_steps(optimizer)
    _set_rng_state(state["rng"])
    return int(state["step"])


def _parameter_states(optimizer: MegatronOptimizer) -> list[dict[Any, Any] | None]:
    """Per inner optimizer, the distributed optimizer's master weights and moments (its own
    ``state_dict`` leaves them out; a ``HybridDeviceOptimizer``'s included), as megatron-core's
    ``get_parameter_state_dp_reshardable`` gives them; ``None`` for the other optimizers, whose
    ``state_dict`` holds them."""
    from megatron.core.optimizer import DistributedOptimizer

    states: list[dict[Any, Any] | None] = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(inner, DistributedOptimizer):
            states.append(None)
            continue
        state = inner.get_parameter_state_dp_reshardable()
        for key, by_dtype in state.items():
            if isinstance(key, int):  # a gradient buffer: {dtype: [bucket: [parameter's tensors]]}
                for buckets in by_dtype.values():
                    for bucket in buckets:
                        for tensors in bucket:
                            tensors["padding"] = False  # what the loader filters on, no padding here
        states.append(state)
    return states


def _load_parameter_states(optimizer: MegatronOptimizer, states: list[dict[Any, Any] | None]) -> None:
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    for inner, state in zip(inners, states, strict=True):
        if state is None:
            continue
        with torch.no_grad():  # it copies into views of the parameters (fp32: the master weights)
            inner.load_parameter_state_from_dp_reshardable(state)
        if isinstance(inner.optimizer, HybridDeviceOptimizer):  # as megatron-core's own loaders do
            inner.optimizer._sync_hdo_state_to_sub_optimizers()


def _own_adam_steps(optimizer: MegatronOptimizer) -> None:
    """Give every parameter's Adam state its own ``step`` tensor. megatron-core's distributed
    optimizer, without Apex or Transformer Engine, loads one tensor into every parameter's ``step``
    (``DistributedOptimizer.load_state_dict``); torch's Adam advances each parameter's step in
    place, so the shared one counted every parameter's update: a step after a resume ran with the
    bias correction of step ~(steps x parameters), its update off by up to ~40% on the first steps."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param_state in getattr(inner.optimizer, "state", {}).values():
            step = param_state.get("step")
            if isinstance(step, torch.Tensor):
                param_state["step"] = step.clone()


def _rng_state() -> dict[str, Any]:
    """The random states a training step draws from.

    Torch's CPU generator, and with CUDA also torch's CUDA generator and Megatron's
    model-parallel CUDA RNG tracker (dropout inside tensor-parallel regions).
    """
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if not cpu_support_needed():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and not cpu_support_needed():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
