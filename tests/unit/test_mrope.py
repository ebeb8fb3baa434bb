"""Qwen2.5-VL's multimodal RoPE positions (rl_bridge.megatron.mrope): the released model's rule,
checked against the example Qwen's implementation documents and against vLLM's own computation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl_bridge.megatron.mrope import rope_index

pytestmark = pytest.mark.unit

MERGE = 2


def _model(tokens_per_second: float) -> SimpleNamespace:
    vision = SimpleNamespace(spatial_merge_size=MERGE, tokens_per_second=tokens_per_second)
    return SimpleNamespace(config=SimpleNamespace(vision_config=vision))


def _row(*runs: tuple[int, int]) -> torch.Tensor:
    """Token types ``[1, L]`` from ``(type, count)`` runs."""
    return torch.tensor([[kind for kind, count in runs for _ in range(count)]])


def test_the_documented_example_text_continues_after_the_last_temporal_position() -> None:
    # Qwen's docstring: 3 temporal patches of 2 x 2 tokens, an interval of 50 (25 tokens a second,
    # 2 seconds a grid); vision temporal positions 0, 50, 100; the text after starts at 101.
    types_ = _row((2, 12), (0, 5))
    positions, delta = rope_index(
        _model(25.0),
        torch.zeros_like(types_),
        types_,
        video_grid_thw=torch.tensor([[3, 4, 4]]),
        second_per_grid_ts=torch.tensor([2.0]),
    )
    assert positions[0, 0, :12].tolist() == [0] * 4 + [50] * 4 + [100] * 4
    assert positions[1, 0, :12].tolist() == [0, 0, 1, 1] * 3
    assert positions[2, 0, :12].tolist() == [0, 1, 0, 1] * 3
    for axis in range(3):
        assert positions[axis, 0, 12:].tolist() == [101, 102, 103, 104, 105]
    assert delta.tolist() == [[106 - 17]]


def test_images_take_one_temporal_position_and_padding_is_left_out() -> None:
    types_ = _row((0, 2), (1, 4), (0, 1), (2, 8), (0, 2), (0, 3))
    mask = torch.ones_like(types_)
    mask[0, -3:] = 0  # right padding
    positions, _ = rope_index(
        _model(2.0),
        torch.zeros_like(types_),
        types_,
        image_grid_thw=torch.tensor([[1, 4, 4]]),
        video_grid_thw=torch.tensor([[2, 4, 4]]),
        second_per_grid_ts=torch.tensor([1.0]),
        attention_mask=mask,
    )
    assert positions[0, 0].tolist() == [0, 1, 2, 2, 2, 2, 4, 5, 5, 5, 5, 7, 7, 7, 7, 8, 9, 0, 0, 0]
    assert positions[1, 0, 2:6].tolist() == [2, 2, 3, 3]


@pytest.mark.parametrize("grid", [(8, 4, 4), (8, 8, 8), (2, 8, 8), (16, 16, 16), (3, 6, 4)])
@pytest.mark.parametrize("seconds", [1.0, 0.5, 1.5])
def test_positions_equal_vllm_s(grid: tuple[int, int, int], seconds: float) -> None:
    """vLLM's Qwen2.5-VL computes the positions the released model was trained with (its
    ``get_mrope_input_positions`` is the loop's rollout side)."""
    import numpy as np

    t, h, w = grid
    video = t * h * w // MERGE**2
    types_ = _row((0, 3), (2, video), (0, 4))
    ours, _ = rope_index(
        _model(2.0),
        torch.zeros_like(types_),
        types_,
        video_grid_thw=torch.tensor([grid]),
        second_per_grid_ts=torch.tensor([seconds]),
    )
    # vLLM's rule (vllm.model_executor.models.qwen2_5_vl.get_mrope_input_positions), inline.
    factor = seconds * 2.0
    indices = np.indices((t, h // MERGE, w // MERGE))
    indices[0] = (indices[0] * factor).astype(np.int64)
    vision = indices.reshape(3, -1) + 3
    text_after = np.broadcast_to(np.arange(4), (3, 4)) + vision.max() + 1
    expected = np.concatenate([np.broadcast_to(np.arange(3), (3, 3)), vision, text_after], axis=1)
    assert ours[:, 0].tolist() == expected.tolist()
