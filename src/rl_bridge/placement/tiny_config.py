"""The shape of the model a recipe with ``model.path: null`` builds locally.

The model is built by whatever provides the recipe's family (:func:`rl_bridge.registry.local_model`:
the ``video_grpo.models`` entry points; the demo's tiny models), so the planner reads its config
from there and never imports the builder.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["TINY_SOURCE", "tiny_model_config"]

TINY_SOURCE = "the tiny model's spec, model.path: null"
""":attr:`~rl_bridge.placement.ModelShape.source` of a shape read from :func:`tiny_model_config`."""


def tiny_model_config(family: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` fields of the ``family`` model built for ``model.path: null`` (not built)."""
    from rl_bridge.registry import local_model

    return local_model(family).config(**overrides)
