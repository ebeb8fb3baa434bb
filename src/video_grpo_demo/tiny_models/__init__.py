"""Tiny random-weight video-language models, built locally and deterministically.

Nothing is downloaded: each family's builder writes a complete checkpoint directory (config,
float32 safetensors weights, a small locally trained tokenizer with the family's special tokens
and chat template, image and video processors with a small pixel budget). Directories are cached
by a hash of everything that shapes them, so the first call builds (about a second) and later
calls return at once::

    from video_grpo_demo.tiny_models import build_tiny_model

    model_dir = build_tiny_model("qwen2_5_vl")                  # defaults of Qwen25VLSpec
    wide_dir = build_tiny_model("qwen2_5_vl", text_intermediate_size=1024, seed=3)

Families: ``qwen2_5_vl`` and ``qwen3_vl`` (HF transformers, vLLM, Megatron-Bridge),
``qwen3_vl_moe`` (HF, Megatron-Bridge) and ``nemotron_vl`` (vLLM only, config without weights:
serve it with ``--load-format dummy``).

The trainer builds ``qwen2_5_vl`` and ``qwen3_vl`` for a recipe with ``model.path: null`` through
the ``video_grpo.models`` entry points :data:`QWEN2_5_VL` and :data:`QWEN3_VL`
(:class:`TinyFamily`, a :class:`rl_bridge.registry.LocalModel`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from video_grpo_demo.tiny_models.builder import MANIFEST_NAME, TinyModelSpec, build_from_spec, cache_key
from video_grpo_demo.tiny_models.nemotron import NemotronVLSpec
from video_grpo_demo.tiny_models.qwen import (
    QWEN_ADDED_TOKENS,
    QWEN_SPECIAL_TOKENS,
    Qwen3VLMoeSpec,
    Qwen3VLSpec,
    Qwen25VLSpec,
)

__all__ = [
    "FAMILIES",
    "MANIFEST_NAME",
    "QWEN2_5_VL",
    "QWEN3_VL",
    "NemotronVLSpec",
    "Qwen3VLMoeSpec",
    "Qwen3VLSpec",
    "Qwen25VLSpec",
    "TinyFamily",
    "TinyModelSpec",
    "build_from_spec",
    "build_tiny_model",
    "cache_key",
]

#: Spec class of every family, by the name :func:`build_tiny_model` accepts.
FAMILIES: dict[str, type[TinyModelSpec]] = {
    spec.family: spec for spec in (Qwen25VLSpec, Qwen3VLSpec, Qwen3VLMoeSpec, NemotronVLSpec)
}


def build_tiny_model(
    family: str,
    *,
    out_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    **overrides: object,
) -> Path:
    """Build (or find in the cache) a tiny model of ``family`` and return its directory.

    Args:
        family: One of :data:`FAMILIES`.
        out_dir: Parent of the model directory; ``None`` means ``cache_dir("tiny-models")``.
        seed: Seed of the random weight initialisation.
        **overrides: Fields of the family's spec class to change from their defaults
            (e.g. ``text_num_layers=4``); unknown or invalid fields raise ``pydantic.ValidationError``.

    Returns:
        ``<out_dir>/<family>-<12 hex digits>``, a complete checkpoint directory. Calling again with
        the same arguments returns the same directory without rebuilding.

    Raises:
        ValueError: ``family`` is not a known family.
    """
    try:
        spec_cls = FAMILIES[family]
    except KeyError:
        raise ValueError(
            f"unknown tiny model family {family!r}; known: {', '.join(sorted(FAMILIES))}"
        ) from None
    return build_from_spec(spec_cls(**overrides), seed=seed, out_dir=out_dir)


@dataclass(frozen=True)
class TinyFamily:
    """A Qwen tiny family as the trainer builds it for ``model.path: null`` (a
    :class:`rl_bridge.registry.LocalModel`, loaded from the ``video_grpo.models`` entry points)."""

    spec_class: type[Qwen25VLSpec] | type[Qwen3VLSpec]

    def build(self, *, seed: int = 0, out_dir: str | os.PathLike[str] | None = None, **spec: Any) -> Path:
        """Build (or find in the cache) the model of ``spec`` (fields of :attr:`spec_class`)."""
        return build_from_spec(self.spec_class(**spec), seed=seed, out_dir=out_dir)

    def config(self, **spec: Any) -> dict[str, Any]:
        """The ``config.json`` fields the placement planner sizes the model from, without building it."""
        model = self.spec_class(**spec)
        vision = {
            "depth": model.vision_depth,
            "hidden_size": model.vision_hidden_size,
            "intermediate_size": model.vision_intermediate_size,
            "out_hidden_size": model.text_hidden_size,
            "patch_size": model.patch_size,
            "spatial_merge_size": model.spatial_merge_size,
            "temporal_patch_size": model.temporal_patch_size,
        }
        if isinstance(model, Qwen3VLSpec):
            vision["num_position_embeddings"] = model.num_position_embeddings
            vision["deepstack_visual_indexes"] = list(model.deepstack_visual_indexes)
        return {
            "vocab_size": max(
                model.bpe_vocab_size + len(QWEN_SPECIAL_TOKENS) + len(QWEN_ADDED_TOKENS),
                model.vocab_size or 0,
            ),
            "hidden_size": model.text_hidden_size,
            "intermediate_size": model.text_intermediate_size,
            "num_hidden_layers": model.text_num_layers,
            "num_attention_heads": model.text_num_heads,
            "num_key_value_heads": model.text_num_kv_heads,
            "head_dim": model.text_head_dim,
            "tie_word_embeddings": model.tie_word_embeddings,
            "vision_config": vision,
        }


#: The ``video_grpo.models`` entry points ``qwen2_5_vl`` and ``qwen3_vl``.
QWEN2_5_VL = TinyFamily(Qwen25VLSpec)
QWEN3_VL = TinyFamily(Qwen3VLSpec)
