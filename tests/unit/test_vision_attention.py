"""The segment-batched vision attention against one attention call per segment (the HF path), and
megatron-core's packed (THD) vision attention through it (Qwen3-VL's tower without Transformer Engine)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_bridge.megatron.vision_attention import segment_attention

pytestmark = pytest.mark.unit


def _per_segment(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float
) -> torch.Tensor:
    outs = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        if end > start:
            s = slice(start, end)
            outs.append(
                F.scaled_dot_product_attention(
                    q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1), scale=scale
                ).transpose(0, 1)
            )
    return torch.cat(outs)


@pytest.mark.parametrize(
    "bounds",
    [
        [0, 16, 32, 48],  # equal windows: no reordering
        [0, 16, 20, 36, 36, 44, 60],  # mixed lengths and an empty segment: the permutation path
    ],
)
def test_segment_attention_equals_one_call_per_segment_with_gradients(bounds: list[int]) -> None:
    torch.manual_seed(0)
    tokens, heads, dim = bounds[-1], 2, 8
    inputs = [torch.randn(tokens, heads, dim, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    weights = torch.randn(tokens, heads, dim, dtype=torch.float64)
    ours = segment_attention(*inputs, torch.tensor(bounds), scale=0.3)
    expected = _per_segment(*inputs, bounds, 0.3)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)
    grads = torch.autograd.grad((ours * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_segment_attention_refuses_bad_boundaries() -> None:
    q = torch.zeros(8, 1, 4)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to 8"):
        segment_attention(q, q, q, torch.tensor([0, 5, 4, 8]), scale=1.0)


def test_packed_sdpa_core_attention_attends_within_each_frame() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rl_bridge.megatron.attention import SDPADotProductAttention
    from rl_bridge.megatron.cpu_support import cpu_execution, single_process_group

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.0)
    bounds = [0, 12, 24, 30]
    cu = torch.tensor(bounds, dtype=torch.int32)
    packed = PackedSeqParams(
        cu_seqlens_q=cu, cu_seqlens_kv=cu, qkv_format="thd", max_seqlen_q=12, max_seqlen_kv=12
    )
    q, k, v = (torch.randn(30, 2, 8) for _ in range(3))
    with cpu_execution(), single_process_group():
        vision = SDPADotProductAttention(config, 1, AttnMaskType.no_mask, "self")
        out = vision(q, k, v, None, packed_seq_params=packed)
        expected = _per_segment(q, k, v, bounds, 8**-0.5).reshape(30, 16)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        causal = SDPADotProductAttention(config, 1, AttnMaskType.causal, "self")
        with pytest.raises(NotImplementedError, match="attn_mask_type=causal"):
            causal(q, k, v, None, packed_seq_params=packed)
