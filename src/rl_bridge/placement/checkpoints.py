"""The published ``config.json`` fields of the checkpoints the shipped recipes name, so a recipe
naming a hub id plans without downloading it."""

from __future__ import annotations

from typing import Any

__all__ = ["KNOWN_CHECKPOINTS", "NEMOTRON_OMNI_ENCODER_PARAMETERS"]

NEMOTRON_OMNI_ENCODER_PARAMETERS = 1_300_000_000
"""Nemotron 3 Nano Omni's encoders, about: a RADIO ViT-H/16 vision tower (about 0.65 B with its
projector) and a Parakeet FastConformer audio encoder (about 0.6 B with its projector), rounded from
the model card; not derived from ``config.json``."""

KNOWN_CHECKPOINTS: dict[str, dict[str, Any]] = {
    # Published config.json of each hub id the shipped recipes name (the fields the shape needs).
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 2048,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
        },
    },
    "Qwen/Qwen2.5-VL-7B-Instruct": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 3584,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
        },
    },
    "Qwen/Qwen3-VL-4B-Instruct": {
        "tie_word_embeddings": True,
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "attention_bias": False,
        },
        "vision_config": {
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_heads": 16,
            "out_hidden_size": 2560,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [5, 11, 17],
        },
    },
    "Qwen/Qwen3-VL-8B-Instruct": {
        "tie_word_embeddings": False,
        "text_config": {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "attention_bias": False,
        },
        "vision_config": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "out_hidden_size": 4096,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
    },
    # The language model is Nemotron 3 Nano 30B-A3B (NemotronH); its config as published.
    "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16": {
        "llm_config": {
            "hidden_size": 2688,
            "num_hidden_layers": 52,
            "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "vocab_size": 131072,
            "tie_word_embeddings": False,
            "mamba_num_heads": 64,
            "mamba_head_dim": 64,
            "n_groups": 8,
            "ssm_state_size": 128,
            "conv_kernel": 4,
            "intermediate_size": 1856,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "moe_intermediate_size": 1856,
            "moe_shared_expert_intermediate_size": 3712,
        },
    },
}
"""The known checkpoints' ``config.json`` fields (Qwen2.5-VL-3B/7B-Instruct, Qwen3-VL-4B/8B-Instruct
and Nemotron 3 Nano Omni as published on the Hugging Face hub), used when ``model.path`` is a hub
id without a local directory."""
