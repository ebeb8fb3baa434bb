"""megatron-core's multi-tensor optimizer ops through torch's ``foreach`` kernels, without Apex or TE.

Megatron's mixed-precision optimizer applies three operations to every parameter each step: the
gradient's global L2 norm (for clipping), the clipping scale, and the copy of the fp32 master
weights into the bf16 model weights. With Transformer Engine or Apex each is a multi-tensor
kernel, a few launches for the whole model. Without either (every host this project's GPU figures
come from, and every CPU host) megatron-core 0.19 falls back to ``megatron.core.utils``' local
implementations, which are Python loops:

* ``local_multi_tensor_l2_norm`` launches one ``torch.norm`` per tensor and then builds a host
  tensor from the list of device scalars, which waits for the device once per parameter (about
  800 synchronisations a step for Qwen2.5-VL-3B, with the device idle in between);
* ``local_multi_tensor_scale`` computes ``dst.copy_(src * scale)`` per tensor: two launches and a
  temporary of the tensor's full size each, also for the in-place clipping and for the master
  weight copy (scale 1.0).

:func:`use_foreach_multi_tensor` replaces the three module-level implementations megatron-core's
optimizer reads (``clip_grads.l2_norm_impl``, ``clip_grads.multi_tensor_scale_impl`` and
``optimizer.multi_tensor_scale_impl``) with drop-in functions over ``torch._foreach_norm``,
``torch._foreach_mul_`` and ``torch._foreach_copy_``, and leaves them alone where TE or Apex
provided them. The arithmetic is the same: per-tensor L2 norms in the gradients' dtype (fp32), the
global norm over them, an exact multiplication by the same scale, an exact copy (a cast to the
model dtype with the same rounding). The policy installs them when it builds its optimizer
(:class:`~rl_bridge.megatron.policy.MegatronPolicy`); ``benchmarks/train_step.py`` measures the
step with and without them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "foreach_l2_norm",
    "foreach_scale",
    "megatron_local_multi_tensor",
    "use_foreach_multi_tensor",
    "using_foreach_multi_tensor",
]


def foreach_l2_norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    per_tensor: bool,
    *args: object,
) -> tuple[torch.Tensor, None]:
    """Drop-in for ``amp_C.multi_tensor_l2norm`` through ``multi_tensor_applier``: the global L2 norm
    of ``tensor_lists[0]`` as a one-element fp32 tensor on their device, with no host
    synchronisation (``chunk_size``, ``noop_flag`` and ``per_tensor`` are accepted and unused, as by
    megatron-core's local version, which never returns per-tensor norms either)."""
    tensors = list(tensor_lists[0])
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return total.reshape(1), None


def foreach_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], scale: float
) -> None:
    """Drop-in for ``amp_C.multi_tensor_scale``: ``dst = src * scale`` for each pair of
    ``tensor_lists = [srcs, dsts]``, in place when they are the same tensors (gradient clipping), a
    plain copy with the destination's dtype when ``scale`` is 1 (fp32 master weights into the model's
    bf16 weights)."""
    sources, destinations = list(tensor_lists[0]), list(tensor_lists[1])
    if len(sources) != len(destinations):
        raise ValueError(f"foreach_scale: {len(sources)} sources for {len(destinations)} destinations")
    if not sources:
        return
    if all(s is d for s, d in zip(sources, destinations, strict=True)):
        torch._foreach_mul_(destinations, scale)
    elif scale == 1.0:
        torch._foreach_copy_(destinations, sources)
    else:
        torch._foreach_copy_(destinations, torch._foreach_mul(sources, scale))


def megatron_local_multi_tensor() -> bool:
    """Whether megatron-core's optimizer runs on its local multi-tensor applier, i.e. neither
    Transformer Engine nor Apex provided the kernels (whether :func:`use_foreach_multi_tensor` is in
    effect or not)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    local = utils.local_multi_tensor_applier
    return clip_grads.multi_tensor_applier is local and optimizer.multi_tensor_applier is local


def using_foreach_multi_tensor() -> bool:
    """Whether :func:`use_foreach_multi_tensor` is in effect."""
    from megatron.core.optimizer import clip_grads

    return clip_grads.l2_norm_impl is foreach_l2_norm


def use_foreach_multi_tensor(enabled: bool = True) -> bool:
    """Put the ``foreach`` implementations in place of megatron-core's local fallbacks (``enabled``),
    or put the fallbacks back. Idempotent; a no-op where TE or Apex provide the kernels.

    Returns:
        Whether the ``foreach`` implementations are in effect afterwards.
    """
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if not megatron_local_multi_tensor():
        return False
    if enabled:
        clip_grads.l2_norm_impl = foreach_l2_norm
        clip_grads.multi_tensor_scale_impl = foreach_scale
        optimizer.multi_tensor_scale_impl = foreach_scale
    else:
        clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
        clip_grads.multi_tensor_scale_impl = utils.local_multi_tensor_scale
        optimizer.multi_tensor_scale_impl = utils.local_multi_tensor_scale
    return enabled
