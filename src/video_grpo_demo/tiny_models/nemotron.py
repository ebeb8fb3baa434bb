"""Tiny NemotronH Nano VL V2: a hybrid Mamba/attention language model with a RADIO vision encoder.

Only vLLM runs this family here: HF transformers has no modeling code for the architecture, and
its Mamba kernels need a GPU. The directory holds what vLLM needs and no weights: ``config.json``
(with ``auto_map`` naming the remote-code config class copied next to it), the tokenizer with the
Nemotron VL media tags, and ``generation_config.json``. Serve it with ``--load-format dummy``
(random weights), ``--trust-remote-code`` and, on CPU, ``--no-enable-prefix-caching``.

The vision encoder's size is not a knob: vLLM derives it from the timm model name in
``vision_config.args["model"]``, and ``vit_small_patch16_224`` (384 wide, 12 blocks) is the
smallest it knows.

``sound=True`` makes it an Omni-style model: a ``sound_config`` (a tiny Parakeet encoder, 16 kHz
log-mel features) and the audio tags vLLM's processor looks up (:data:`NEMOTRON_AUDIO_TOKENS`), so
vLLM builds its sound encoder and serves audio, including a video's own track with
``use_audio_in_video``.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator
from transformers import GenerationConfig

from video_grpo_demo.tiny_models.builder import TinyModelSpec
from video_grpo_demo.tiny_models.tokenizer import build_tokenizer, load_chat_template

__all__ = ["NEMOTRON_AUDIO_TOKENS", "NEMOTRON_VL_SPECIAL_TOKENS", "NemotronVLSpec"]

#: Special tokens of the tiny Nemotron VL tokenizer: ChatML turns, reasoning and the media tags
#: vLLM's Nemotron VL processor looks up (``<img>``, ``</img>``, ``<image>``, ``<video>``).
NEMOTRON_VL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<unk>",
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<img>",
    "</img>",
    "<image>",
    "<video>",
    "<box>",
    "</box>",
)

#: Audio tags of the Omni checkpoints (vLLM's ``AUDIO_START``, ``AUDIO_END``, ``AUDIO_CONTEXT``),
#: added to the tokenizer only when the model has a sound encoder.
NEMOTRON_AUDIO_TOKENS: tuple[str, ...] = ("<so_start>", "<so_end>", "<so_embedding>")

_REMOTE_CONFIG_MODULE = "configuration_nemotron_vl"
_REMOTE_CONFIG_CLASS = "NemotronH_Nano_VL_V2_Config"
_ARCHITECTURE = "NemotronH_Nano_VL_V2"


class NemotronVLSpec(TinyModelSpec):
    """Knobs of the tiny Nemotron VL. Sizes are element counts unless a name says otherwise."""

    family: ClassVar[str] = "nemotron_vl"
    builder_version: ClassVar[int] = 4

    bpe_vocab_size: PositiveInt = Field(
        384, description="Regular vocabulary (bytes + merges); the 13 special tokens come on top."
    )
    max_position_embeddings: PositiveInt = Field(4096, description="Longest sequence, in tokens.")
    hybrid_override_pattern: str = Field(
        "M*-", description="One character per layer: M = Mamba2, * = attention, - = MLP."
    )
    hidden_size: PositiveInt = 256
    num_attention_heads: PositiveInt = 2
    num_key_value_heads: PositiveInt = 1
    head_dim: PositiveInt = Field(
        128, description="Attention head size; vLLM's CPU attention needs at least 32."
    )
    intermediate_size: PositiveInt = 512
    mamba_num_heads: PositiveInt = 8
    mamba_head_dim: PositiveInt = 32
    ssm_state_size: PositiveInt = 16
    mamba_n_groups: PositiveInt = 1
    mamba_conv_kernel: PositiveInt = 4
    mamba_chunk_size: PositiveInt = 128
    vit_model: Literal["vit_small_patch16_224", "vit_base_patch16_224"] = "vit_small_patch16_224"
    force_image_size: PositiveInt = Field(128, description="Side of each image tile and video frame, pixels.")
    patch_size: PositiveInt = 16
    downsample_ratio: float = Field(0.5, gt=0, le=1, description="Pixel-shuffle factor per side.")
    projector_hidden_size: PositiveInt = 256
    video_temporal_patch_size: PositiveInt = Field(2, description="Frames per video tubelet.")
    sound: bool = Field(
        False, description="Add a Parakeet sound encoder (an Omni-style model that hears audio)."
    )
    sound_hidden_size: PositiveInt = 64
    sound_num_layers: PositiveInt = 1
    sound_num_heads: PositiveInt = 2
    sound_intermediate_size: PositiveInt = 128
    sound_conv_channels: PositiveInt = Field(16, description="Channels of the subsampling convolutions.")
    sound_num_mel_bins: PositiveInt = 80
    sound_sampling_rate: PositiveInt = Field(16000, description="Rate vLLM resamples audio to, Hz.")

    @field_validator("hybrid_override_pattern")
    @classmethod
    def _check_pattern(cls, pattern: str) -> str:
        unknown = sorted(set(pattern) - set("M*-"))
        if unknown:
            raise ValueError(f"layer pattern {pattern!r} has characters other than M, * and -: {unknown}")
        if "M" not in pattern:
            raise ValueError(f"layer pattern {pattern!r} has no Mamba layer (M); vLLM rejects such models")
        return pattern

    @model_validator(mode="after")
    def _check_shapes(self) -> NemotronVLSpec:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.force_image_size % self.patch_size:
            raise ValueError(f"force_image_size={self.force_image_size} is not a multiple of patch_size")
        return self

    def write(self, out_dir: Path, *, seed: int) -> None:
        """Write config, remote-code config class, tokenizer and generation config (``seed`` is
        recorded only: there are no weights, vLLM's dummy loader makes them)."""
        tokenizer = build_tokenizer(
            bpe_vocab_size=self.bpe_vocab_size,
            special_tokens=NEMOTRON_VL_SPECIAL_TOKENS + (NEMOTRON_AUDIO_TOKENS if self.sound else ()),
            chat_template=load_chat_template(self.family),
            roles={"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "</s>", "unk_token": "<unk>"},
            extra_special_tokens={"image_token": "<image>", "video_token": "<video>"},
            model_max_length=self.max_position_embeddings,
        )
        tokenizer.save_pretrained(out_dir)
        ids = tokenizer.convert_tokens_to_ids
        GenerationConfig(
            bos_token_id=ids("<s>"), eos_token_id=[ids("<|im_end|>"), ids("</s>")], pad_token_id=ids("</s>")
        ).save_pretrained(out_dir)

        source = resources.files(__package__).joinpath("remote_code", f"{_REMOTE_CONFIG_MODULE}.py")
        with resources.as_file(source) as path:
            shutil.copyfile(path, out_dir / f"{_REMOTE_CONFIG_MODULE}.py")
        # bfloat16 like the released checkpoints; vLLM's Nemotron VL needs the dtype in llm_config
        # too (it casts the vision tower to it). --dtype overrides it for the whole model.
        config = {
            "architectures": [_ARCHITECTURE],
            "model_type": _ARCHITECTURE,
            "auto_map": {"AutoConfig": f"{_REMOTE_CONFIG_MODULE}.{_REMOTE_CONFIG_CLASS}"},
            "dtype": "bfloat16",
            "force_image_size": self.force_image_size,
            "patch_size": self.patch_size,
            "downsample_ratio": self.downsample_ratio,
            "template": None,
            "ps_version": "v2",
            "image_tag_type": "internvl",
            "projector_hidden_size": self.projector_hidden_size,
            "vit_hidden_size": _VIT_WIDTH[self.vit_model],
            "use_thumbnail": True,
            "img_context_token_id": ids("<image>"),
            "vision_config": {
                "model_type": "radio",
                "args": {"model": self.vit_model},
                "patch_size": self.patch_size,
                "preferred_resolution": [self.force_image_size, self.force_image_size],
                "video_temporal_patch_size": self.video_temporal_patch_size,
            },
            "llm_config": {
                "model_type": "nemotron_h",
                "architectures": ["NemotronHForCausalLM"],
                "vocab_size": len(tokenizer),
                "hidden_size": self.hidden_size,
                "hybrid_override_pattern": self.hybrid_override_pattern,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size,
                "mlp_hidden_act": "relu2",
                "mamba_num_heads": self.mamba_num_heads,
                "mamba_head_dim": self.mamba_head_dim,
                "ssm_state_size": self.ssm_state_size,
                "n_groups": self.mamba_n_groups,
                "conv_kernel": self.mamba_conv_kernel,
                "chunk_size": self.mamba_chunk_size,
                "max_position_embeddings": self.max_position_embeddings,
                "tie_word_embeddings": False,
                "dtype": "bfloat16",
                "bos_token_id": ids("<s>"),
                "eos_token_id": ids("<|im_end|>"),
                "pad_token_id": ids("</s>"),
            },
        }
        if self.sound:
            # Parakeet encoder fields (transformers' ParakeetEncoderConfig) plus what vLLM's
            # ParakeetConfig adds: the projection into the language model and the sampling rate.
            config["sound_config"] = {
                "model_type": "parakeet_encoder",
                "hidden_size": self.sound_hidden_size,
                "num_hidden_layers": self.sound_num_layers,
                "num_attention_heads": self.sound_num_heads,
                "intermediate_size": self.sound_intermediate_size,
                "subsampling_conv_channels": self.sound_conv_channels,
                "subsampling_factor": 8,
                "subsampling_conv_kernel_size": 3,
                "subsampling_conv_stride": 2,
                "conv_kernel_size": 9,
                "num_mel_bins": self.sound_num_mel_bins,
                "sampling_rate": self.sound_sampling_rate,
                "projection_hidden_size": self.projector_hidden_size,
                "projection_bias": False,
            }
        (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# Hidden width of the timm ViTs vLLM's RADIO encoder accepts (vllm/transformers_utils/configs/radio.py).
_VIT_WIDTH = {"vit_small_patch16_224": 384, "vit_base_patch16_224": 768}
