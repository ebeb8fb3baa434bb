"""The policy's optimizer: Megatron's Adam with the hooks megatron-core's schedule calls, the
switch to fused kernels on CUDA, and what the optimizer state occupies."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.transformer.module import MegatronModule

    from rl_bridge.megatron.policy_config import PolicyConfig

__all__ = ["build_optimizer", "fuse_kernels", "state_bytes"]


def build_optimizer(model: list[MegatronModule], config: PolicyConfig) -> MegatronOptimizer:
    """Megatron's Adam over the trainable parameters of ``model``, with the hooks megatron-core's
    schedule calls around the backward passes set on the model's config (as Megatron-LM sets
    them up)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import get_model_config

    from rl_bridge.megatron.multi_tensor import use_foreach_multi_tensor

    use_foreach_multi_tensor()  # norm, clipping and master-weight copy in a few kernels, not per tensor
    beta1, beta2 = config.adam_betas
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=config.learning_rate,
        weight_decay=config.weight_decay,
        adam_beta1=beta1,
        adam_beta2=beta2,
        adam_eps=config.adam_eps,
        clip_grad=config.clip_grad,
        bf16=config.dtype == torch.bfloat16,
        fp16=config.dtype == torch.float16,
        params_dtype=config.dtype,
        use_distributed_optimizer=config.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(optimizer_config, model)
    model_config = get_model_config(model[0])
    model_config.grad_scale_func = optimizer.scale_loss
    model_config.no_sync_func = model[0].no_sync
    model_config.finalize_model_grads_func = finalize_model_grads
    return optimizer


def fuse_kernels(module: torch.nn.Module, optimizer: MegatronOptimizer | None) -> dict[str, int]:
    """:meth:`~rl_bridge.megatron.policy.MegatronPolicy.fuse_kernels` on ``module`` and its
    ``optimizer`` (``None``: a forward-only policy)."""
    from rl_bridge.megatron.fusion import fuse_elementwise, fuse_weight_gradient_accumulation

    changed = fuse_elementwise(module)
    if changed and optimizer is not None:
        if fused_wgrad := fuse_weight_gradient_accumulation(module):
            changed["wgrad_accumulation"] = fused_wgrad
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            adam = inner.optimizer
            if isinstance(adam, torch.optim.Adam | torch.optim.AdamW):
                for group in adam.param_groups:
                    group.update(fused=True, foreach=False)
                    for parameter in group["params"]:  # the fused kernel keeps steps on the device
                        state = adam.state.get(parameter, {})
                        if "step" in state:
                            state["step"] = state["step"].to(parameter.device, torch.float32)
                changed["fused_adam"] = changed.get("fused_adam", 0) + 1
    return changed


def state_bytes(module: torch.nn.Module, optimizer: MegatronOptimizer | None) -> dict[str, int]:
    """:meth:`~rl_bridge.megatron.policy.MegatronPolicy.state_bytes` of ``module`` and its
    ``optimizer``."""
    from megatron.core.distributed import DistributedDataParallel

    parameters = sum(p.numel() * p.element_size() for p in module.parameters())
    buffers = (
        [*module.buffers, *module.expert_parallel_buffers]
        if isinstance(module, DistributedDataParallel)
        else []
    )
    gradients = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    total = 0
    if optimizer is not None:
        seen: set[int] = set()
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            tensors = [t for state in inner.optimizer.state.values() for t in state.values()]
            for group in getattr(inner, "fp32_from_float16_groups", ()):
                tensors.extend(group)
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                    seen.add(id(tensor))
                    total += tensor.numel() * tensor.element_size()
    return {"parameters": parameters, "gradients": gradients, "optimizer": total}
