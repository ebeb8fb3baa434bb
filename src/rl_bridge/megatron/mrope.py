"""Qwen2-VL / Qwen2.5-VL multimodal RoPE positions as the released models define them.

Each vision item takes 3D positions (temporal, height, width) that start where the text before it
ended; the text after it continues at the largest of those positions plus one. For a video the
temporal positions are ``grid index x second_per_grid_t x tokens_per_second`` (truncated), so
they often run past the spatial ones: a 32-frame clip at 2 fps spans temporal positions 0 to 30
while a 224 x 224 frame spans 0 to 7 in height and width. This is the rule of Qwen's reference
implementation and of vLLM (``get_mrope_input_positions``); transformers 5.x's ``get_rope_index``,
which Megatron-Bridge's Qwen2.5-VL model binds, continues the text at the vision start plus the
larger spatial extent instead, so where the temporal span is the longest the trainer's text
positions after a video fell behind vLLM's (and the pretrained model's). :func:`use_reference_rope_index`
puts this module's rule in its place.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import torch

__all__ = ["rope_index", "use_reference_rope_index"]

_TEXT, _IMAGE, _VIDEO = 0, 1, 2


def _vision_positions(
    start: int, grid_thw: torch.Tensor, spatial_merge_size: int, interval: float
) -> torch.Tensor:
    """``[3, t * h * w / merge^2]`` positions of one image or video whose tokens start at ``start``."""
    t, h, w = (int(x) for x in grid_thw)
    h, w = h // spatial_merge_size, w // spatial_merge_size
    temporal = (torch.arange(t, dtype=torch.float64) * interval).long()
    grid = torch.stack(
        torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij"), dim=0
    ).reshape(3, -1)
    return grid + start


def rope_index(
    self: Any,
    input_ids: torch.LongTensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.LongTensor | None = None,
    video_grid_thw: torch.LongTensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[3, batch, length]`` and per-row deltas ``[batch, 1]``, with transformers 5's
    ``get_rope_index`` signature (``self`` holds the model ``config``; see the module docstring).

    ``mm_token_type_ids``: 0 text, 1 image, 2 video per token; consecutive vision tokens of one
    kind are their items in order, each ``t * h * w / merge^2`` long. Rows are left as zeros where
    ``attention_mask`` is 0. Images take interval 1 (one temporal position); a video without
    ``second_per_grid_ts`` takes 1 second per grid.
    """
    vision = self.config.vision_config
    merge = vision.spatial_merge_size
    tokens_per_second = float(getattr(vision, "tokens_per_second", 1.0))
    grids = {
        _IMAGE: iter(image_grid_thw if image_grid_thw is not None else ()),
        _VIDEO: iter(video_grid_thw if video_grid_thw is not None else ()),
    }
    seconds = iter(second_per_grid_ts.tolist() if second_per_grid_ts is not None else ())
    positions = torch.zeros(3, *input_ids.shape, dtype=input_ids.dtype, device=input_ids.device)
    deltas = []
    for row in range(input_ids.shape[0]):
        keep = attention_mask[row].bool() if attention_mask is not None else slice(None)
        kinds = mm_token_type_ids[row][keep].tolist()
        parts: list[torch.Tensor] = []
        next_position = 0
        for kind, run in itertools.groupby(kinds):
            length = len(list(run))
            if kind == _TEXT:
                parts.append(torch.arange(length).expand(3, length) + next_position)
                next_position += length
                continue
            covered = 0
            while covered < length:  # adjacent items of one kind form one run
                grid = next(grids[kind])
                interval = tokens_per_second * float(next(seconds, 1.0)) if kind == _VIDEO else 1.0
                item = _vision_positions(next_position, grid, merge, interval)
                parts.append(item)
                covered += item.shape[1]
                next_position = int(item.max()) + 1
            if covered != length:
                raise ValueError(
                    f"rope_index: a run of {length} vision tokens does not match its grids ({covered})"
                )
        row_positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
        positions[:, row, keep] = row_positions.to(positions)
        deltas.append(int(row_positions.max()) + 1 - len(kinds) if parts else 0)
    return positions, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)


def use_reference_rope_index(module: torch.nn.Module) -> int:
    """Bind :func:`rope_index` as ``get_rope_index`` on every Megatron-Bridge Qwen2.5-VL model in
    ``module``; returns how many were found."""
    from megatron.bridge.models.qwen_vl.modeling_qwen25_vl import Qwen25VLModel

    found = [m for m in module.modules() if isinstance(m, Qwen25VLModel)]
    for model in found:
        model.get_rope_index = types.MethodType(rope_index, model)
    return len(found)
