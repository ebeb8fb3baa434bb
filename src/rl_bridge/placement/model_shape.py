"""The model's shape as the planner needs it: parameter counts per part and the sizes the
activation estimate and the tensor-parallel checks use.

Read from the checkpoint's ``config.json`` when ``model.path`` is a local directory, else from
:data:`~rl_bridge.placement.checkpoints.KNOWN_CHECKPOINTS`, else (``path: null``) from the tiny
model's spec (:func:`~rl_bridge.placement.tiny_config.tiny_model_config`). Each family's parameter
count is a formula over its config (one function per family).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_bridge.placement.checkpoints import KNOWN_CHECKPOINTS, NEMOTRON_OMNI_ENCODER_PARAMETERS
from rl_bridge.placement.hardware import PlacementError
from rl_bridge.placement.tiny_config import TINY_SOURCE, tiny_model_config

if TYPE_CHECKING:
    from rl_bridge.recipe import Recipe

__all__ = ["ModelShape", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about the model; parameters are element counts."""

    source: str
    """Where the numbers come from (a ``config.json``, the known-checkpoint table, the tiny spec)."""
    language_parameters: int
    """Parameters of the language model, embeddings and output layer included."""
    expert_parameters: int
    """Of ``language_parameters``, those in MoE experts (split by expert, not tensor, parallelism)."""
    vision_parameters: int
    """Parameters of the vision tower and its projector (Nemotron Omni: also its audio encoder)."""
    num_layers: int
    """Language model layers."""
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    vision_hidden_size: int = 0
    """Width of the vision tower's blocks (0: its activations are not counted)."""
    vision_layers: int = 0
    patches_per_token: int = 1
    """Vision patches merged into one video token (``spatial_merge_size ** 2``)."""

    @property
    def parameters(self) -> int:
        return self.language_parameters + self.vision_parameters


def _qwen_vl_parameters(config: Mapping[str, Any], family: str) -> tuple[int, int, dict[str, int]]:
    """``(language, vision parameters, text shape)`` of a Qwen2.5-VL or Qwen3-VL ``config.json``
    (top-level text fields as published, or transformers 5's ``text_config``). Exact: the tests
    check it against the published totals of Qwen2.5-VL-3B/7B-Instruct (docs/SCALING.md) and, for
    Qwen3-VL, against transformers' count of a built model.

    Qwen3-VL differs in: no query/key/value biases but query and key RMSNorms in the language
    model; LayerNorms (weight and bias) and a plain GELU MLP in the vision blocks; a patch
    embedding with bias; learned position embeddings; and one more merger per DeepStack index.
    """
    qwen3 = family == "qwen3_vl"
    text = {**config, **config.get("text_config", {})}
    h, heads, kv = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]
    head_dim = text.get("head_dim") or h // heads
    kv_dim = kv * head_dim
    qkv_bias = text.get("attention_bias", False) if qwen3 else True
    layer = (
        h * heads * head_dim
        + h * 2 * kv_dim  # q, k, v
        + (heads * head_dim + 2 * kv_dim) * qkv_bias
        + heads * head_dim * h  # o
        + 3 * h * text["intermediate_size"]  # gate, up, down
        + 2 * h  # two RMSNorms
        + 2 * head_dim * qwen3  # query and key RMSNorms
    )
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    language = text["vocab_size"] * h * (1 if tied else 2) + text["num_hidden_layers"] * layer + h
    vision = config["vision_config"]
    vh, vi = vision["hidden_size"], vision["intermediate_size"]
    merged = vh * vision.get("spatial_merge_size", 2) ** 2
    channels = vision.get("in_channels", vision.get("in_chans", 3))
    attention = (vh * 3 * vh + 3 * vh) + (vh * vh + vh)
    if qwen3:
        mlp, norms = (vh * vi + vi) + (vi * vh + vh), 4 * vh
    else:
        mlp, norms = 2 * (vh * vi + vi) + (vi * vh + vh), 2 * vh
    merger = merged * merged + merged + merged * vision["out_hidden_size"] + vision["out_hidden_size"]
    patch = channels * vision.get("temporal_patch_size", 2) * vision.get("patch_size", 14) ** 2 * vh
    vision_parameters = patch + vision["depth"] * (attention + mlp + norms) + merger
    if qwen3:
        deepstack = len(vision.get("deepstack_visual_indexes", ()))
        vision_parameters += (
            vh  # patch embedding bias
            + vision["num_position_embeddings"] * vh
            + 2 * vh  # merger LayerNorm
            + deepstack * (merger + 2 * merged)  # DeepStack mergers, LayerNorm over the merged size
        )
    else:
        vision_parameters += vh  # merger RMSNorm
    shape = {
        "num_layers": text["num_hidden_layers"],
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": text["vocab_size"],
        "vision_hidden_size": vh,
        "vision_layers": vision["depth"],
        "patches_per_token": vision.get("spatial_merge_size", 2) ** 2,
    }
    return language, vision_parameters, shape


def _nemotron_h_parameters(config: Mapping[str, Any]) -> tuple[int, int, dict[str, int]]:
    """``(language, expert parameters, shape)`` of a NemotronH language model config (Nemotron
    Omni's ``llm_config``): Mamba-2 (``M``), attention (``*``), MoE (``E``) and MLP (``-``) layers
    as ``hybrid_override_pattern`` lists them (the count for Nemotron 3 Nano 30B-A3B against its
    published total: docs/SCALING.md)."""
    h, pattern = config["hidden_size"], config["hybrid_override_pattern"]
    heads, kv, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inner = config["mamba_num_heads"] * config["mamba_head_dim"]
    groups_state = 2 * config["n_groups"] * config["ssm_state_size"]
    mamba = (
        h * (2 * inner + groups_state + config["mamba_num_heads"])  # in_proj
        + (inner + groups_state) * (config["conv_kernel"] + 1)  # conv1d weight and bias
        + 3 * config["mamba_num_heads"]  # A_log, D, dt_bias
        + inner  # gated norm
        + inner * h  # out_proj
    )
    attention = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    experts = config.get("n_routed_experts", 0) * 2 * h * config.get("moe_intermediate_size", 0)
    moe = (
        experts
        + config.get("n_shared_experts", 0) * 2 * h * config.get("moe_shared_expert_intermediate_size", 0)
        + config.get("n_routed_experts", 0) * (h + 1)  # router and its score-correction bias
    )
    mlp = 2 * h * config.get("intermediate_size", 0)
    per_kind = {"M": mamba, "*": attention, "E": moe, "-": mlp}
    unknown = sorted(set(pattern) - set(per_kind))
    if unknown:
        raise PlacementError(f"hybrid_override_pattern {pattern!r} has unknown layer kinds {unknown}")
    tied = config.get("tie_word_embeddings", False)
    vocab = config["vocab_size"]
    language = vocab * h * (1 if tied else 2) + h + sum(per_kind[kind] + h for kind in pattern)
    shape = {
        "num_layers": len(pattern),
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
    }
    return language, pattern.count("E") * experts, shape


def _shape_from_config(family: str, config: Mapping[str, Any], source: str) -> ModelShape:
    if family in ("qwen2_5_vl", "qwen3_vl"):
        language, vision, shape = _qwen_vl_parameters(config, family)
        return ModelShape(source, language, 0, vision, **shape)
    llm = config.get("llm_config") or config.get("text_config") or config
    language, experts, shape = _nemotron_h_parameters(llm)
    return ModelShape(source, language, experts, NEMOTRON_OMNI_ENCODER_PARAMETERS, **shape)


def model_shape(recipe: Recipe) -> ModelShape:
    """The shape of ``recipe.model``: its local ``config.json``, else :data:`KNOWN_CHECKPOINTS`,
    else (``path: null``) the tiny model's spec.

    Raises:
        PlacementError: ``model.path`` is neither a local checkpoint directory nor a known hub id.
    """
    model = recipe.model
    if model.path is None:
        return _shape_from_config(model.family, tiny_model_config(model.family, model.spec), TINY_SOURCE)
    config_path = Path(model.path).expanduser() / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        return _shape_from_config(model.family, config, str(config_path))
    if model.path in KNOWN_CHECKPOINTS:
        return _shape_from_config(model.family, KNOWN_CHECKPOINTS[model.path], "published config.json")
    raise PlacementError(
        f"model.path={model.path!r} is not a local checkpoint directory (no {config_path}) and not a "
        f"checkpoint the planner knows ({', '.join(KNOWN_CHECKPOINTS)}): download it and set "
        "model.path to its directory, so its config.json gives the model's shape"
    )
