"""The shape of the tiny model a recipe with ``model.path: null`` builds.

This is the planner's only use of :mod:`rl_bridge.tiny_models`: the tiny models are demo code, so
pointing the planner elsewhere means changing this one function.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["TINY_SOURCE", "tiny_model_config"]

TINY_SOURCE = "the tiny model's spec, model.path: null"
""":attr:`~rl_bridge.placement.ModelShape.source` of a shape read from :func:`tiny_model_config`."""


def tiny_model_config(family: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` fields of the tiny ``family`` model with spec ``overrides`` (not built)."""
    from rl_bridge.tiny_models import FAMILIES
    from rl_bridge.tiny_models.qwen import QWEN_ADDED_TOKENS, QWEN_SPECIAL_TOKENS

    spec = FAMILIES[family](**overrides)
    vision = {
        "depth": spec.vision_depth,
        "hidden_size": spec.vision_hidden_size,
        "intermediate_size": spec.vision_intermediate_size,
        "out_hidden_size": spec.text_hidden_size,
        "patch_size": spec.patch_size,
        "spatial_merge_size": spec.spatial_merge_size,
        "temporal_patch_size": spec.temporal_patch_size,
    }
    if family == "qwen3_vl":
        vision["num_position_embeddings"] = spec.num_position_embeddings
        vision["deepstack_visual_indexes"] = list(spec.deepstack_visual_indexes)
    return {
        "vocab_size": max(
            spec.bpe_vocab_size + len(QWEN_SPECIAL_TOKENS) + len(QWEN_ADDED_TOKENS), spec.vocab_size or 0
        ),
        "hidden_size": spec.text_hidden_size,
        "intermediate_size": spec.text_intermediate_size,
        "num_hidden_layers": spec.text_num_layers,
        "num_attention_heads": spec.text_num_heads,
        "num_key_value_heads": spec.text_num_kv_heads,
        "head_dim": spec.text_head_dim,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "vision_config": vision,
    }
