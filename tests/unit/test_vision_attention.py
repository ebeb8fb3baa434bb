"""The segment-batched vision attention against one attention call per segment (the HF path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_bridge.megatron.vision_attention import segment_attention

pytestmark = pytest.mark.unit


def _per_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float) -> torch.Tensor:
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
