"""Tiny random-weight video-language models, built locally and deterministically.

Nothing is downloaded: each family's builder writes a complete checkpoint directory (config,
float32 safetensors weights, a small locally trained tokenizer with the family's special tokens
and chat template, image and video processors with a small pixel budget). Directories are cached
by a hash of everything that shapes them, so the first call builds (about a second) and later
calls return at once::

    from rl_bridge.tiny_models import build_tiny_model

    model_dir = build_tiny_model("qwen2_5_vl")                  # defaults of Qwen25VLSpec
    wide_dir = build_tiny_model("qwen2_5_vl", text_intermediate_size=1024, seed=3)

Families: ``qwen2_5_vl`` and ``qwen3_vl`` (HF transformers, vLLM, Megatron-Bridge),
``qwen3_vl_moe`` (HF, Megatron-Bridge) and ``nemotron_vl`` (vLLM only, config without weights:
serve it with ``--load-format dummy``).
"""

from __future__ import annotations

import os
from pathlib import Path

from rl_bridge.tiny_models.builder import MANIFEST_NAME, TinyModelSpec, build_from_spec, cache_key
from rl_bridge.tiny_models.nemotron import NemotronVLSpec
from rl_bridge.tiny_models.qwen import Qwen3VLMoeSpec, Qwen3VLSpec, Qwen25VLSpec

__all__ = [
    "FAMILIES",
    "MANIFEST_NAME",
    "NemotronVLSpec",
    "Qwen3VLMoeSpec",
    "Qwen3VLSpec",
    "Qwen25VLSpec",
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
