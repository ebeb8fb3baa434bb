"""A pure-PyTorch core attention for megatron-core's local layer spec.

Without Transformer Engine, megatron-core's local spec uses ``DotProductAttention``, which
materialises the full ``[batch, heads, seq, seq]`` score matrix (O(S^2) memory, unfused softmax).
:class:`SDPADotProductAttention` computes the same function with
:func:`torch.nn.functional.scaled_dot_product_attention`, which dispatches to flash or
memory-efficient kernels on GPUs and to a fused kernel on CPU. It is a drop-in replacement for
the ``core_attention`` submodule of the local spec (:func:`sdpa_local_layer_spec`).

Supported: causal and explicit boolean masks (``True`` = masked, Megatron's convention), grouped
query attention, attention dropout, ``apply_query_key_layer_scaling``, and packed (THD) sequences
in a non-causal layer (a vision tower's frames: each token attends within its own segment, through
:func:`~rl_bridge.megatron.vision_attention.segment_attention`). Not supported, and refused at
construction: sliding-window attention and non-vanilla softmax types; refused at call time:
packed causal sequences and context parallelism.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from rl_bridge.megatron.te_standin import import_megatron_bridge

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["SDPADotProductAttention", "sdpa_local_layer_spec"]

# Megatron's local attention fills masked scores with this value (attention_mask_func); an
# additive mask with the same value keeps fully masked (padding) rows finite, as there.
_MASKED_SCORE = -10000.0


class SDPADotProductAttention(DotProductAttention):
    """``DotProductAttention`` computed by ``torch.nn.functional.scaled_dot_product_attention``.

    Takes the same constructor arguments and tensors as megatron-core's ``DotProductAttention``:
    query ``[sq, b, heads, head_dim]``, key and value ``[sk, b, query_groups, head_dim]``, and
    returns the context ``[sq, b, heads * head_dim]``.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, *args: object, **kwargs: object) -> None:
        super().__init__(config, layer_number, *args, **kwargs)
        if config.softmax_type != "vanilla":
            raise NotImplementedError(
                f"SDPADotProductAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
            )
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError(
                f"SDPADotProductAttention does not support sliding-window attention "
                f"(window_size={config.window_size}, layer {layer_number})"
            )
        # The parent divides softmax_scale by the layer number for query-key layer scaling and the
        # fused softmax multiplies it back; SDPA applies the net scale in one step.
        layer_scaling = self.layer_number if config.apply_query_key_layer_scaling else 1
        self._sdpa_scale = self.softmax_scale * layer_scaling

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention of ``query`` over ``key``/``value``.

        Args:
            attention_mask: boolean, broadcastable to ``[b, heads, sq, sk]``, ``True`` where a score
                is masked out; ``None`` means causal for a causal layer (when ``sq > 1``), else none.
            attn_mask_type: ignored, as in ``DotProductAttention``; the layer's own type decides.
        """
        if attention_bias is not None:
            raise NotImplementedError("SDPADotProductAttention does not support an attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, attention_mask, packed_seq_params)
        sq, sk = query.size(0), key.size(0)
        is_causal = attention_mask is None and self.attn_mask_type == AttnMaskType.causal and sq > 1
        if is_causal and sq != sk:
            raise ValueError(
                f"SDPADotProductAttention: causal attention without a mask needs equal query and key "
                f"lengths, got {sq} and {sk}"
            )
        additive_mask = None
        if attention_mask is not None:
            additive_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
            additive_mask.masked_fill_(attention_mask, _MASKED_SCORE)

        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.attention_dropout.p if self.training else 0.0
        if self.config.sequence_parallel:
            context = self._attend(q, k, v, additive_mask, is_causal, dropout_p)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = self._attend(q, k, v, additive_mask, is_causal, dropout_p)
        # [b, n, sq, d] -> [sq, b, n * d]
        return context.permute(2, 0, 1, 3).reshape(sq, query.size(1), self.hidden_size_per_partition)

    def _packed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        packed_seq_params: PackedSeqParams,
    ) -> torch.Tensor:
        """Non-causal attention within each packed segment: ``[t, heads, d]`` in, ``[t, heads * d]`` out."""
        from rl_bridge.megatron.vision_attention import segment_attention

        cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        unsupported = [
            reason
            for reason, present in (
                (f"qkv_format={packed_seq_params.qkv_format!r}", packed_seq_params.qkv_format != "thd"),
                (f"attn_mask_type={self.attn_mask_type.name}", self.attn_mask_type != AttnMaskType.no_mask),
                ("an attention mask", attention_mask is not None),
                ("attention dropout", self.training and self.attention_dropout.p > 0),
                ("grouped query attention", key.shape != query.shape),
                ("different query and key segments", cu_kv is not None and not torch.equal(cu_q, cu_kv)),
            )
            if present
        ]
        if unsupported:
            raise NotImplementedError(
                "SDPADotProductAttention: packed sequences are supported for non-causal THD attention "
                f"only, got {', '.join(unsupported)}"
            )
        context = segment_attention(query, key, value, cu_q, scale=self._sdpa_scale)
        return context.reshape(query.size(0), self.hidden_size_per_partition)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        additive_mask: torch.Tensor | None,
        is_causal: bool,
        dropout_p: float,
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=additive_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=self._sdpa_scale,
            enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition,
        )


def sdpa_local_layer_spec(config: TransformerConfig) -> ModuleSpec:
    """megatron-core's local GPT layer spec for ``config`` with :class:`SDPADotProductAttention`.

    ``config`` is a Megatron-Bridge ``GPTModelProvider`` (the spec follows its MoE and
    ``qk_layernorm`` settings exactly as ``megatron.bridge.models.gpt_provider.local_layer_spec``).
    """
    import_megatron_bridge()
    from megatron.bridge.models.gpt_provider import local_layer_spec

    spec = copy.deepcopy(local_layer_spec(config))
    spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
    return spec
