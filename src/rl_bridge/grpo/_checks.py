"""Shape checks shared by the GRPO functions."""

from __future__ import annotations

import torch
from torch import Tensor


def check_shape(name: str, tensor: Tensor, shape: tuple[int, ...] | torch.Size) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``tensor`` has ``shape``."""
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")
