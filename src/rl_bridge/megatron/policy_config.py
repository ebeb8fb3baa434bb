"""How a :class:`~rl_bridge.megatron.policy.MegatronPolicy` is built and optimised."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_bridge.megatron.model import LayerSpec, Recompute, VisionAttention

__all__ = ["PolicyConfig"]


@dataclass(frozen=True)
class PolicyConfig:
    """How the policy is built and optimised."""

    dtype: torch.dtype = torch.float32
    """Parameter and compute dtype (``float32``, ``bfloat16`` or ``float16``); the optimizer keeps
    fp32 master weights for the half-precision ones."""
    learning_rate: float = 1e-6
    """Adam learning rate (constant)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Maximum global L2 norm of the gradient (megatron-core's ``clip_grad``, on CPU as on GPUs); 0
    turns clipping off."""
    micro_batch_size: int = 1
    """Samples per forward pass; a batch is split into ``ceil(len(batch) / micro_batch_size)``
    micro-batches whose gradients are accumulated."""
    temperature: float = 1.0
    """Logits are divided by it before the softmax, in
    :meth:`~rl_bridge.megatron.policy.MegatronPolicy.logprobs` and in training. Use the rollouts'
    sampling temperature when the rollout engine reports logprobs after temperature (vLLM's
    ``processed_logprobs``), 1.0 with its default ``raw_logprobs``."""
    token_support: tuple[int, ...] | None = None
    """Token ids the rollout engine's sampling was restricted to (vLLM ``allowed_token_ids``):
    logprobs are those of the softmax over these tokens only, the distribution the tokens were
    sampled from (vLLM's ``processed_logprobs``); ``None``: the whole vocabulary."""
    freeze_vision: bool = False
    """No updates to the vision tower (patch embedding and blocks)."""
    freeze_projector: bool = False
    """No updates to the vision-to-language projector (merger)."""
    layer_spec: LayerSpec = "auto"
    """The language model's layer implementation (see :data:`.model.LayerSpec`)."""
    recompute: Recompute = "none"
    """Activation recomputation in training (see :data:`.model.Recompute`)."""
    vision_attention: VisionAttention = "segment_batched"
    """The vision tower's attention core (see :data:`.model.VisionAttention`); ``segment_batched``
    is the same function with far fewer kernel launches (GPU)."""
    fused_kernels: bool = True
    """On CUDA: the elementwise work (RoPE, SwiGLU, norms, the vision tower's rotary embedding and
    MLP activations) fused by ``torch.compile`` (:func:`.fusion.fuse_elementwise`), the language
    model's weight gradients accumulated in fp32 by their GEMMs
    (:func:`.fusion.fuse_weight_gradient_accumulation`), and torch's fused Adam kernel for the fp32
    master weights. The same functions, rounded differently in the last bits. No effect on CPU."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer: the fp32 master weights and Adam's moments sharded over
    the data-parallel ranks (gradients reduce-scattered, parameters all-gathered after the step),
    the optimizer's memory divided by the data-parallel size. Same update as the replicated one."""
    optimizer_offload_fraction: float = 0.0
    """Fraction of the optimizer's parameters (by elements) whose fp32 master weights and Adam
    moments live in host memory and step there (megatron-core's ``optimizer_cpu_offload``: its
    ``HybridDeviceOptimizer``, with the precision-aware distributed optimizer); 0: none, 1: all.
    Needs CUDA and ``distributed_optimizer``."""
    trainable: bool = True
    """``False``: a forward-only policy, such as the frozen reference of a KL term: no DDP gradient
    buffers, no optimizer, parameters in ``dtype`` without gradients (``dtype``'s bytes per
    parameter instead of about 16); :meth:`~rl_bridge.megatron.policy.MegatronPolicy.train_step`
    and checkpoints refuse."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"PolicyConfig: micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if not self.temperature > 0:
            raise ValueError(f"PolicyConfig: temperature must be > 0, got {self.temperature}")
        if self.token_support is not None and not self.token_support:
            raise ValueError("PolicyConfig: token_support must hold at least one token id (or be None)")
        if not 0 <= self.optimizer_offload_fraction <= 1:
            raise ValueError(
                "PolicyConfig: optimizer_offload_fraction must be in [0, 1], got "
                f"{self.optimizer_offload_fraction}"
            )
        if self.optimizer_offload_fraction and not self.distributed_optimizer:
            raise ValueError(
                "PolicyConfig: optimizer_offload_fraction > 0 needs distributed_optimizer=True "
                "(megatron-core offloads the precision-aware distributed optimizer's state)"
            )
        if self.learning_rate < 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise ValueError(
                f"PolicyConfig: learning_rate={self.learning_rate}, weight_decay={self.weight_decay} and "
                f"clip_grad={self.clip_grad} must be >= 0"
            )
