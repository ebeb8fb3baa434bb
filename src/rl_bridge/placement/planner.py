"""The planner: :func:`plan_placement` checks a recipe against the hardware and assembles its
:class:`~rl_bridge.placement.plan.Plan` from the named steps of the other modules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl_bridge.placement.allocation import assign_devices, policy_layout
from rl_bridge.placement.hardware import Hardware, PlacementError
from rl_bridge.placement.memory import (
    MemoryEstimate,
    check_gpu_memory,
    estimate_policy_memory,
    estimate_vllm_memory,
)
from rl_bridge.placement.model_shape import ModelShape, model_shape
from rl_bridge.placement.plan import Plan

if TYPE_CHECKING:
    from rl_bridge.recipe import ModelSection, Recipe

__all__ = ["plan_placement"]


def plan_placement(recipe: Recipe, hardware: Hardware, *, distributed_optimizer: bool | None = None) -> Plan:
    """Place ``recipe``'s vLLM replicas, policy ranks and reference policy on ``hardware``.

    The devices: :mod:`rl_bridge.placement.allocation`; the memory per GPU and its formulas:
    :mod:`rl_bridge.placement.memory`.

    Args:
        recipe: the run.
        hardware: the machines.
        distributed_optimizer: shard the optimizer state over data-parallel ranks; ``None``: the
            recipe's choice (``train.distributed_optimizer``, by default when the policy's
            data-parallel size is above 1).

    Raises:
        PlacementError: more GPUs than ``hardware`` has; a tensor-parallel size that does not fit
            the attention or KV heads, or a node; a role that does not fit a GPU's memory;
            ``colocated`` with different vLLM and policy GPU counts; an unknown checkpoint.
    """
    from rl_bridge.grpo import needs_reference

    model = recipe.model
    shape = model_shape(recipe)
    on_gpus = model.num_gpus > 0
    if distributed_optimizer is None:
        distributed_optimizer = recipe.distributed_optimizer
    _check_parallel_sizes(model, shape, hardware, on_gpus=on_gpus)

    tp, pp = model.policy_tensor_parallel_size, model.policy_pipeline_parallel_size
    dp, ep = model.policy_data_parallel_size, model.policy_expert_parallel_size
    coordinates, groups = policy_layout(tp, pp, dp, ep)
    replicas, ranks = assign_devices(model, hardware, coordinates, groups, on_gpus=on_gpus)

    reference = needs_reference(recipe.train.loss)
    policy_memory = estimate_policy_memory(recipe, shape, distributed_optimizer=distributed_optimizer)
    reference_memory = MemoryEstimate("reference", policy_memory.weights) if reference else None
    vllm_memory = estimate_vllm_memory(model, shape, hardware if on_gpus else None)
    if on_gpus:
        check_gpu_memory(recipe, hardware, policy_memory, reference_memory, vllm_memory)

    return Plan(
        placement=model.placement if on_gpus else "cpu",
        hardware=hardware,
        shape=shape,
        vllm=replicas,
        policy=ranks,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=dp,
        expert_parallel=ep,
        tensor_groups=groups["tensor"],
        data_groups=groups["data"],
        pipeline_groups=groups["pipeline"],
        expert_groups=groups["expert"],
        reference=reference,
        distributed_optimizer=distributed_optimizer,
        vllm_memory=vllm_memory,
        policy_memory=policy_memory,
        reference_memory=reference_memory,
        optimizer_offload_fraction=recipe.train.optimizer_offload_fraction,
    )


def _check_parallel_sizes(
    model: ModelSection, shape: ModelShape, hardware: Hardware, *, on_gpus: bool
) -> None:
    """Raise :class:`PlacementError` when the GPUs asked for are not there or the tensor-parallel
    sizes fit neither the model's heads nor a node (on the CPU: the policy's heads only; validation
    keeps every parallel size but the policy's TP and PP at 1 there)."""
    if not on_gpus:
        _check_heads("policy", "model.policy_tensor_parallel_size", model.policy_tensor_parallel_size, shape)
        return
    colocated = model.placement == "colocated"
    if colocated and model.vllm_gpus != model.policy_gpus:
        raise PlacementError(
            f"model.placement='colocated' runs vLLM and the policy on the same GPUs: "
            f"model.vllm_gpus={model.vllm_gpus} and model.policy_gpus={model.policy_gpus} must be equal"
        )
    needed = model.policy_gpus if colocated else model.num_gpus
    asked = (
        f"model.policy_gpus={model.policy_gpus}, colocated"
        if colocated
        else f"model.vllm_gpus={model.vllm_gpus} + model.policy_gpus={model.policy_gpus}"
    )
    if needed > hardware.total_gpus:
        raise PlacementError(
            f"the recipe needs {needed} GPUs ({asked}); the hardware has {hardware.total_gpus} "
            f"({hardware.describe()})"
        )
    sizes = (
        ("vLLM", "model.vllm_tensor_parallel_size", model.vllm_tensor_parallel_size),
        ("policy", "model.policy_tensor_parallel_size", model.policy_tensor_parallel_size),
    )
    for what, field, size in sizes:
        _check_heads(what, field, size, shape)
    for _, field, size in sizes:
        if size > hardware.gpus_per_node:
            raise PlacementError(
                f"a tensor-parallel group stays on one node: {field}={size} is over the "
                f"{hardware.gpus_per_node} GPUs per node"
            )


def _check_heads(what: str, field: str, size: int, shape: ModelShape) -> None:
    """A tensor-parallel size must divide the attention heads, and be a multiple or a divisor of the
    KV heads (more ranks than KV heads replicate them: megatron-core and vLLM both allow it)."""
    if shape.num_attention_heads % size:
        raise PlacementError(
            f"{what} tensor parallel size {field}={size} does not divide the model's "
            f"{shape.num_attention_heads} attention heads"
        )
    kv = shape.num_key_value_heads
    if kv % size and size % kv:
        raise PlacementError(
            f"{what} tensor parallel size {field}={size} does not divide the model's {kv} KV heads "
            f"(nor is it a multiple of them, which would replicate them)"
        )
