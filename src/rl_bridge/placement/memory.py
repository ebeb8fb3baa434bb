"""How much memory each role's GPU holds: the formulas of the planner's memory model.

Bytes per GPU (``P`` parameters, ``b`` the compute dtype's bytes, 2 for bf16 and 4 for fp32;
``TP``/``PP``/``DP``/``EP`` the policy's parallel sizes; ``P_local = (P - P_expert) / (TP * PP) +
P_expert / (EP * PP)``, which is ``P / (TP * PP)`` for a dense model):

- policy (trainable) = weights ``P_local * b`` + fp32 gradient buffer ``P_local * 4`` + optimizer
  ``P_local * (4 + 8)`` for bf16, ``P_local * 8`` for fp32 (fp32 master weights, bf16 only, and
  Adam's two fp32 moments), the optimizer part divided by ``DP`` (the expert part by ``policy_gpus /
  (EP * PP)``) with the distributed optimizer; plus activations ``(micro_batch_size *
  tokens_per_sample * hidden * layers / TP + micro_batch_size * video_tokens_per_sample * merge^2 *
  vision_hidden * vision_layers) * 17 * b * 1.9`` (tokens per sample: :func:`_tokens_per_sample`; 17:
  :data:`ACTIVATION_BYTES_PER_ELEMENT`; 1.9: :data:`ACTIVATION_MEASURED_FACTOR`; with 1F1B the first
  pipeline stage holds ``PP`` micro-batches of ``layers / PP`` layers, so ``PP`` cancels; the vision
  tower is replicated, not split by TP; Nemotron's encoders are not counted); with ``train.recompute:
  full`` each part's 17 becomes ``1 + 17 / its layers`` (every layer's input kept, one layer
  recomputed at a time); with ``train.optimizer_offload_fraction`` ``f`` the GPU keeps ``1 - f`` of
  the optimizer and host memory holds ``f`` of it plus the pinned fp32 gradient copies it steps on
  (``f * P_opt * 4``, ``P_opt`` the parameters the rank's optimizer steps): ``host_optimizer``;
- reference (forward-only, when ``kl_coef > 0``) = ``P_local * b``, on the policy's GPUs;
- vLLM replica = ``P * b / vllm_TP`` of weights, and in all ``gpu_memory_utilization * GPU
  memory``: the KV cache takes the rest of that fraction.

A GPU of the split placement holds one role (the policy GPUs also the reference); a colocated GPU
holds the policy's weights, gradients, optimizer and the reference throughout, plus the larger of
the policy's activations (training) and vLLM's reservation (generating; vLLM sleeps while the
policy trains).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl_bridge.placement.hardware import GiB, Hardware, PlacementError
from rl_bridge.placement.model_shape import ModelShape

if TYPE_CHECKING:
    from rl_bridge.recipe import ModelSection, Recipe

__all__ = [
    "ACTIVATION_BYTES_PER_ELEMENT",
    "ACTIVATION_MEASURED_FACTOR",
    "TEXT_TOKENS_PER_SAMPLE",
    "MemoryEstimate",
    "check_gpu_memory",
    "estimate_policy_memory",
    "estimate_vllm_memory",
    "policy_gpu_need",
]

ACTIVATION_BYTES_PER_ELEMENT = 17
"""Activation memory kept for the backward pass, per token, per hidden unit, per transformer layer,
per byte of the compute dtype: Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models") count ``34 s b h`` bytes per layer in 16-bit without recomputation when
the attention scores are not stored (flash/SDPA attention): 17 elements of 2 bytes."""

ACTIVATION_MEASURED_FACTOR = 1.9
"""Measured peak activation memory over :data:`ACTIVATION_BYTES_PER_ELEMENT`'s count (language
model and vision tower), from one policy rank of ``recipes/qwen2_5_vl_3b_gpu.yaml``
(``benchmarks/policy_role.py``; the figures: docs/SCALING.md, "One policy rank on an H200"). What
the count leaves out grows with the same tokens (SwiGLU intermediates wider than ``4 h``, attention
workspace, the chunked logprobs, allocator fragmentation); the factor keeps the estimate at the
measurement."""

TEXT_TOKENS_PER_SAMPLE = 256
"""Tokens a sample spends on the chat template, the question and the options, added to its video
tokens and answers when the activation term sizes a micro-batch."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU of a role holds (the formulas: this module's docstring)."""

    role: str
    weights: int
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    kv_cache: int = 0
    """vLLM: what ``gpu_memory_utilization`` reserves beyond the weights (KV cache and vLLM's own
    activations)."""
    host_optimizer: int = 0
    """Host memory, not the GPU's: the optimizer state offloaded by
    ``train.optimizer_offload_fraction`` and the gradient copies it steps on (not in :attr:`total`)."""

    @property
    def total(self) -> int:
        """Bytes on the GPU."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.kv_cache

    def describe(self) -> str:
        parts = [
            f"{name} {value / GiB:.1f}"
            for name, value in (
                ("weights", self.weights),
                ("gradients", self.gradients),
                ("optimizer", self.optimizer),
                ("activations", self.activations),
                ("KV cache", self.kv_cache),
            )
            if value
        ]
        host = f"; host memory: optimizer {self.host_optimizer / GiB:.1f}" if self.host_optimizer else ""
        return f"{self.total / GiB:.1f} GiB ({' + '.join(parts)}{host})"


def _video_tokens_per_sample(recipe: Recipe) -> int:
    """Video tokens of a sample: every clip of a trajectory at full frame count."""
    side, temporal = recipe.model.video_token_geometry
    task = recipe.task
    per_clip = -(-task.num_frames // temporal) * -(-task.width // side) * -(-task.height // side)
    return (task.videos_per_prompt + task.images_per_prompt) * per_clip  # a still as a clip, at most


def _tokens_per_sample(recipe: Recipe) -> int:
    """A sample's tokens: its video tokens, the answers and :data:`TEXT_TOKENS_PER_SAMPLE`, at most
    ``model.max_model_len`` (the recipe's own bound)."""
    answers = recipe.task.max_model_calls * recipe.rollout.max_output_tokens
    tokens = _video_tokens_per_sample(recipe) + answers + TEXT_TOKENS_PER_SAMPLE
    return min(tokens, recipe.model.max_model_len)


def estimate_policy_memory(
    recipe: Recipe, shape: ModelShape, *, distributed_optimizer: bool
) -> MemoryEstimate:
    """One policy GPU's weights, gradients, optimizer state and activations."""
    model = recipe.model
    b = _DTYPE_BYTES[model.dtype]
    tp, pp = model.policy_tensor_parallel_size, model.policy_pipeline_parallel_size
    dp, ep = model.policy_data_parallel_size, model.policy_expert_parallel_size
    dense_local = (shape.parameters - shape.expert_parameters) / (tp * pp)
    expert_local = shape.expert_parameters / (ep * pp)
    local = dense_local + expert_local
    optimizer_bytes = (4 if b == 2 else 0) + 8  # fp32 master weights (half precision only), 2 moments
    if distributed_optimizer:
        expert_data_parallel = max(model.policy_gpus // (ep * pp), 1)
        stepped = dense_local / dp + expert_local / expert_data_parallel
    else:
        stepped = local
    offloaded = recipe.train.optimizer_offload_fraction * stepped
    optimizer = optimizer_bytes * (stepped - offloaded)
    host_optimizer = optimizer_bytes * offloaded + 4 * offloaded  # + the fp32 gradients it steps on
    micro_batch = recipe.train.micro_batch_size
    language_elements = micro_batch * _tokens_per_sample(recipe) * shape.hidden_size * shape.num_layers / tp
    patches = micro_batch * _video_tokens_per_sample(recipe) * shape.patches_per_token
    vision_elements = patches * shape.vision_hidden_size * shape.vision_layers  # not sharded by TP
    if recipe.train.recompute == "full":  # each layer's input kept, one layer's activations at a time
        per_element = [
            1 + ACTIVATION_BYTES_PER_ELEMENT / max(layers, 1)
            for layers in (shape.num_layers, shape.vision_layers)
        ]
    else:
        per_element = [ACTIVATION_BYTES_PER_ELEMENT] * 2
    elements = language_elements * per_element[0] + vision_elements * per_element[1]
    activations = elements * b * ACTIVATION_MEASURED_FACTOR
    return MemoryEstimate(
        "policy",
        round(local * b),
        round(local * 4),
        round(optimizer),
        round(activations),
        host_optimizer=round(host_optimizer),
    )


def estimate_vllm_memory(model: ModelSection, shape: ModelShape, hardware: Hardware | None) -> MemoryEstimate:
    """One vLLM GPU's weights and, on ``hardware`` (``None``: the CPU), the KV cache its
    ``gpu_memory_utilization`` leaves room for."""
    weights = math.ceil(shape.parameters * _DTYPE_BYTES[model.dtype] / model.vllm_tensor_parallel_size)
    reserved = weights if hardware is None else _vllm_reservation(model, hardware)
    return MemoryEstimate("vllm", weights, kv_cache=max(reserved - weights, 0))


def _vllm_reservation(model: ModelSection, hardware: Hardware) -> int:
    return int(model.vllm_gpu_memory_utilization * hardware.gpu_memory_bytes)


def policy_gpu_need(
    placement: str, policy: MemoryEstimate, reference: MemoryEstimate | None, vllm: MemoryEstimate
) -> tuple[int, str]:
    """Peak bytes on one policy GPU: the policy (and the reference) on its own; colocated, the
    resident policy state and reference plus the larger of training's activations and vLLM's
    reservation while it generates (vLLM sleeps while the policy trains)."""
    static = policy.weights + policy.gradients + policy.optimizer
    ref = reference.total if reference is not None else 0
    parts = f"policy state {static / GiB:.1f}" + (f" + reference {ref / GiB:.1f}" if ref else "")
    if placement != "colocated":
        return static + ref + policy.activations, f"{parts} + activations {policy.activations / GiB:.1f}"
    peak = max(policy.activations, vllm.total)
    return static + ref + peak, (
        f"{parts} + the larger of activations {policy.activations / GiB:.1f} and vLLM's "
        f"{vllm.total / GiB:.1f} while generating"
    )


def check_gpu_memory(
    recipe: Recipe,
    hardware: Hardware,
    policy: MemoryEstimate,
    reference: MemoryEstimate | None,
    vllm: MemoryEstimate,
) -> None:
    """Raise :class:`PlacementError` when a vLLM replica's weights leave no room for a KV cache,
    or a policy GPU needs more than the GPU has."""
    model = recipe.model
    gpu = hardware.gpu_memory_bytes
    reserved = _vllm_reservation(model, hardware)
    if vllm.weights >= reserved:
        raise PlacementError(
            f"a vLLM replica's weights need about {vllm.weights / GiB:.1f} GiB per GPU (TP "
            f"{model.vllm_tensor_parallel_size}), over the {reserved / GiB:.1f} GiB that "
            f"model.vllm_gpu_memory_utilization={model.vllm_gpu_memory_utilization} reserves of a "
            f"{gpu / GiB:.1f} GiB GPU: no room for a KV cache"
        )
    need, breakdown = policy_gpu_need(model.placement, policy, reference, vllm)
    if need > gpu:
        raise PlacementError(
            f"a policy GPU needs about {need / GiB:.1f} GiB ({breakdown}), over the GPU memory of "
            f"{gpu / GiB:.1f} GiB: use more policy GPUs (TP, PP, EP, or DP with the distributed "
            f"optimizer), a smaller train.micro_batch_size (now {recipe.train.micro_batch_size}), "
            f"train.recompute=full (now {recipe.train.recompute}), the optimizer in host memory "
            f"(train.optimizer_offload_fraction, now {recipe.train.optimizer_offload_fraction}), or GPUs "
            "with more memory"
        )
