"""Qwen2.5-VL vision attention with one kernel call per segment length instead of one per segment.

Qwen2.5-VL's vision tower (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``, which
Megatron-Bridge's ``Qwen25VLModel`` uses unchanged) attends within segments of its packed patch
sequence, given by ``cu_seqlens``: windows of 8x8 patches (112 pixels at patch size 14) in most
blocks, whole temporal patches (frame pairs) in the ``fullatt_block_indexes`` blocks. Unless the
flash-attn package is installed, transformers computes that with one
``scaled_dot_product_attention`` call per segment. For one 32-frame 392x392 video (16 temporal
patches of 28x28) that is 256 calls in each of the 28 windowed blocks, about 7,200 per video per
forward pass, each a few small kernels, and as many again in the backward pass: the GPU mostly
waits for kernel launches.

:func:`segment_attention` computes the same function with one call per distinct segment length:
the segments of each length are gathered into one ``[segments, heads, length, head_dim]`` batch
(a video's windows come in at most four sizes, its frames in one). It is exact: every query attends
to the keys of its own segment only; just the kernels' internal summation order may differ.
:func:`use_segment_batched_vision_attention` installs it in every vision attention module of a
model (forward and backward; it holds no state).
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["segment_attention", "use_segment_batched_vision_attention"]


def segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """Non-causal attention within each segment of a packed sequence.

    Args:
        query, key, value: ``[tokens, heads, head_dim]``, segments concatenated along ``tokens``.
        cu_seqlens: ``[segments + 1]`` integer segment boundaries: 0, then cumulative lengths up to
            ``tokens`` (empty segments allowed).
        scale: factor applied to the query-key scores before the softmax.

    Returns:
        ``[tokens, heads, head_dim]``, each token's attention over the keys of its own segment.

    Raises:
        ValueError: mismatched shapes, or boundaries that do not run from 0 to ``tokens`` without
            decreasing.
    """
    if query.dim() != 3 or key.shape != query.shape or value.shape != query.shape:
        raise ValueError(
            f"segment_attention: query, key and value must be equal [tokens, heads, head_dim], got "
            f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}"
        )
    tokens, heads, head_dim = query.shape
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if (
        not bounds
        or bounds[0] != 0
        or bounds[-1] != tokens
        or any(b > e for b, e in itertools.pairwise(bounds))
    ):
        raise ValueError(
            f"segment_attention: cu_seqlens must rise from 0 to {tokens} (the token count), "
            f"got {len(bounds)} boundaries from {bounds[:1]} to {bounds[-1:]}"
        )
    starts_by_length: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(bounds):
        if end > start:
            starts_by_length.setdefault(end - start, []).append(start)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: int, length: int) -> torch.Tensor:
        # [segments * length, heads, head_dim] -> [segments, heads, length, head_dim] and back
        q, k, v = (t.reshape(segments, length, heads, head_dim).transpose(1, 2) for t in (q, k, v))
        context = F.scaled_dot_product_attention(q, k, v, scale=scale)
        return context.transpose(1, 2).reshape(segments * length, heads, head_dim)

    if len(starts_by_length) == 1:
        # Equal segments tile the sequence in order (e.g. whole frames): no reordering needed.
        ((length, starts),) = starts_by_length.items()
        return attend(query, key, value, len(starts), length)

    device = query.device
    order = torch.cat(
        [
            (torch.tensor(starts, device=device).unsqueeze(1) + torch.arange(length, device=device)).reshape(
                -1
            )
            for length, starts in starts_by_length.items()
        ]
    )
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(tokens, device=device)
    q, k, v = (_Permute.apply(t, order, inverse) for t in (query, key, value))
    contexts = []
    offset = 0
    for length, starts in starts_by_length.items():
        end = offset + length * len(starts)
        contexts.append(attend(q[offset:end], k[offset:end], v[offset:end], len(starts), length))
        offset = end
    return _Permute.apply(torch.cat(contexts), inverse, order)


class _Permute(torch.autograd.Function):
    """The rows of ``x`` in the order of a permutation. Its gradient gathers with the inverse
    permutation: ``index_select``'s own backward scatters with ``index_add_``, atomics meant for
    repeated indices and slow here (benchmarks/README.md)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _segment_batched_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``Qwen2_5_VLVisionAttention.forward`` with :func:`segment_attention` as the attention core."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    if position_embeddings is None:
        raise ValueError("Qwen2.5-VL vision attention: position_embeddings (cos, sin) are required")
    tokens = hidden_states.shape[0]
    query, key, value = self.qkv(hidden_states).reshape(tokens, 3, self.num_heads, -1).unbind(1)
    cos, sin = position_embeddings
    rotary = getattr(self, "fused_rotary", None) or apply_rotary_pos_emb_vision  # see .fusion
    query, key = rotary(query, key, cos, sin)
    context = segment_attention(query, key, value, cu_seqlens, scale=self.scaling)
    return self.proj(context.reshape(tokens, -1))


def use_segment_batched_vision_attention(model: nn.Module) -> int:
    """Make every Qwen2.5-VL vision attention module in ``model`` use :func:`segment_attention`.

    Replaces the ``forward`` of each transformers ``Qwen2_5_VLVisionAttention`` found among
    ``model.modules()`` (wrappers such as DDP or ``Float16Module`` are looked through); weights and
    state dicts are untouched. Calling it again changes nothing.

    Returns:
        The number of attention modules found.

    Raises:
        ValueError: ``model`` holds no Qwen2.5-VL vision attention module.
    """
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionAttention

    modules = [m for m in model.modules() if isinstance(m, Qwen2_5_VLVisionAttention)]
    if not modules:
        raise ValueError(
            f"use_segment_batched_vision_attention: {type(model).__name__} has no Qwen2.5-VL vision attention"
        )
    for module in modules:
        module.forward = types.MethodType(_segment_batched_forward, module)
    return len(modules)
