"""The policy's optimizer: Megatron's Adam with the hooks megatron-core's schedule calls, the
switch to fused kernels on CUDA, and what the optimizer state occupies."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
    from megatron.core.transformer.module import MegatronModule

    from rl_bridge.megatron.policy_config import PolicyConfig

__all__ = ["build_optimizer", "fuse_kernels", "optimizer_config", "state_bytes"]


def build_optimizer(model: list[MegatronModule], config: PolicyConfig) -> MegatronOptimizer:
    """Megatron's Adam over the trainable parameters of ``model``, with the hooks megatron-core's
    schedule calls around the backward passes set on the model's config (as Megatron-LM sets
    them up). With ``config.optimizer_offload_fraction`` above 0, megatron-core's
    ``HybridDeviceOptimizer`` inside the distributed optimizer (:func:`optimizer_config`)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import get_model_config

    from rl_bridge.megatron.multi_tensor import use_foreach_multi_tensor

    use_foreach_multi_tensor()  # norm, clipping and master-weight copy in a few kernels, not per tensor
    optimizer = get_megatron_optimizer(optimizer_config(config), model)
    model_config = get_model_config(model[0])
    model_config.grad_scale_func = optimizer.scale_loss
    model_config.no_sync_func = model[0].no_sync
    model_config.finalize_model_grads_func = finalize_model_grads
    return optimizer


def optimizer_config(config: PolicyConfig) -> OptimizerConfig:
    """megatron-core's optimizer settings for ``config``.

    Offloading (``optimizer_offload_fraction > 0``) takes what megatron-core's ``optimizer_cpu_offload``
    needs: decoupled weight decay (AdamW; its CPU optimizer is torch's ``AdamW``), the distributed
    optimizer, and the precision-aware optimizer, so that the distributed optimizer keeps no fp32
    master copy on the GPU and the ``HybridDeviceOptimizer`` holds the master weights (fp32, on the
    host for the offloaded part) itself; as Megatron-LM's ``--optimizer-cpu-offload`` asks for
    ``--use-precision-aware-optimizer``. Gradient and weight copies overlap the CPU steps on their
    own CUDA streams, through pinned host buffers."""
    from megatron.core.optimizer import OptimizerConfig

    beta1, beta2 = config.adam_betas
    offload = config.optimizer_offload_fraction > 0
    return OptimizerConfig(
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
        decoupled_weight_decay=True,
        use_precision_aware_optimizer=offload,
        optimizer_cpu_offload=offload,
        optimizer_offload_fraction=config.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=offload,
        pin_cpu_grads=True,
        pin_cpu_params=True,
    )


def fuse_kernels(module: torch.nn.Module, optimizer: MegatronOptimizer | None) -> dict[str, int]:
    """:meth:`~rl_bridge.megatron.policy.MegatronPolicy.fuse_kernels` on ``module`` and its
    ``optimizer`` (``None``: a forward-only policy). An offloading optimizer is left as megatron-core
    built it: its sub-optimizers are already fused (the CPU part's torch ``AdamW(fused=True)``) and
    it keeps their steps where each runs."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from rl_bridge.megatron.fusion import fuse_elementwise, fuse_weight_gradient_accumulation

    changed = fuse_elementwise(module)
    if changed and optimizer is not None:
        if fused_wgrad := fuse_weight_gradient_accumulation(module):
            changed["wgrad_accumulation"] = fused_wgrad
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            adam = inner.optimizer
            if isinstance(adam, HybridDeviceOptimizer):
                continue
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
    ``optimizer``: ``optimizer`` counts what sits on the parameters' device, ``optimizer_host``
    what an offloading optimizer keeps in host memory while the parameters are on a GPU."""
    from megatron.core.distributed import DistributedDataParallel

    parameters = sum(p.numel() * p.element_size() for p in module.parameters())
    buffers = (
        [*module.buffers, *module.expert_parallel_buffers]
        if isinstance(module, DistributedDataParallel)
        else []
    )
    gradients = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    # The precision-aware distributed optimizer steps views of the parameter buffer: not its own.
    model_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    on_device = next((p.device for p in module.parameters()), torch.device("cpu"))
    device = host = 0
    if optimizer is not None:
        seen: set[int] = set()
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            for tensor in _optimizer_tensors(inner):
                if id(tensor) in seen or tensor.untyped_storage().data_ptr() in model_storages:
                    continue
                seen.add(id(tensor))
                size = tensor.numel() * tensor.element_size()
                if tensor.device.type == "cpu" and on_device.type != "cpu":
                    host += size
                else:
                    device += size
    return {"parameters": parameters, "gradients": gradients, "optimizer": device, "optimizer_host": host}


def _optimizer_tensors(inner: MegatronOptimizer) -> list[torch.Tensor]:
    """The tensors one megatron optimizer holds of its own: Adam's state, and the master weights
    (fp32 copies of half-precision parameters: the mixed-precision optimizer's, the distributed
    optimizer's shards, or a ``HybridDeviceOptimizer``'s sub-optimizers' parameters with the
    pinned host gradients its offloaded part steps on)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    adam = inner.optimizer
    if isinstance(adam, HybridDeviceOptimizer):
        tensors = [t for sub in adam.sub_optimizers for g in sub.param_groups for t in g["params"]]
        tensors += [t for sub in adam.sub_optimizers for state in sub.state.values() for t in state.values()]
        tensors += list(adam.cpu_copy_map_grad.values())
    else:
        tensors = [t for state in adam.state.values() for t in state.values()]
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            tensors += [t for group in getattr(inner, name, ()) for t in group]
    return [t for t in tensors if isinstance(t, torch.Tensor)]
