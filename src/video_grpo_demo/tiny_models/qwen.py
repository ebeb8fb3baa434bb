"""Tiny Qwen2.5-VL and Qwen3-VL (dense and MoE) checkpoints: random weights, real architecture, small
everything.

Both families share the Qwen special tokens and the ChatML layout of their chat templates; they
differ in the vision tower (Qwen3-VL: patch 16, learned position embeddings, deepstack) and in
M-RoPE (Qwen3-VL interleaves the sections). The files written are what the released checkpoints
contain (``config.json``, ``generation_config.json``, ``model.safetensors`` in float32, tokenizer,
image and video processor configs, ``chat_template.jinja``), so HF transformers, vLLM and
Megatron-Bridge load them through their ordinary code paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import Field, PositiveInt, model_validator
from transformers import (
    GenerationConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
)

from video_grpo_demo.tiny_models.builder import TinyModelSpec
from video_grpo_demo.tiny_models.tokenizer import build_tokenizer, load_chat_template

__all__ = [
    "QWEN_ADDED_TOKENS",
    "QWEN_SPECIAL_TOKENS",
    "RELEASED_PADDING_ROWS",
    "Qwen3VLMoeSpec",
    "Qwen3VLSpec",
    "Qwen25VLSpec",
]

#: Embedding rows of the released Qwen2.5-VL checkpoints beyond their tokenizer (151,936 - 151,665).
RELEASED_PADDING_ROWS = 271

#: Special tokens of the Qwen2-VL family, in the order of their ids in the released tokenizers.
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

#: The tool-call markers that follow them (not special: decoding keeps them, and vLLM's ``hermes``
#: tool-call parser finds the calls between them in the output text).
QWEN_ADDED_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>")

_ROLES = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
_NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}


class _QwenVLSpec(TinyModelSpec):
    """Knobs shared by the Qwen VL families. Sizes are element counts unless a name says otherwise."""

    bpe_vocab_size: PositiveInt = Field(
        384, description="Regular vocabulary (bytes + merges); the 14 special tokens come on top."
    )
    max_position_embeddings: PositiveInt = Field(4096, description="Longest sequence, in tokens.")
    rope_theta: float = 1_000_000.0
    text_hidden_size: PositiveInt = 256
    text_num_layers: PositiveInt = 2
    text_num_heads: PositiveInt = 2
    text_num_kv_heads: PositiveInt = 1
    text_head_dim: PositiveInt = Field(
        128, description="Attention head size; vLLM's CPU attention needs at least 32."
    )
    text_intermediate_size: PositiveInt = 512
    mrope_section: tuple[PositiveInt, PositiveInt, PositiveInt] = Field(
        (16, 24, 24), description="Rotary pairs for (time, height, width); must sum to text_head_dim / 2."
    )
    vision_depth: PositiveInt = 2
    vision_hidden_size: PositiveInt = 64
    vision_num_heads: PositiveInt = 2
    vision_intermediate_size: PositiveInt = 128
    patch_size: PositiveInt = 14
    spatial_merge_size: PositiveInt = 2
    temporal_patch_size: PositiveInt = 2
    image_min_pixels: PositiveInt = Field(56 * 56, description="Smallest resized image area, pixels.")
    image_max_pixels: PositiveInt = Field(224 * 224, description="Largest resized image area, pixels.")
    video_fps: float = Field(2.0, gt=0, description="Frames per second the video processor samples.")
    video_min_frames: PositiveInt = 4
    video_max_frames: PositiveInt = 64
    vocab_size: PositiveInt | None = Field(
        None,
        description=(
            "The model's vocabulary (embedding and output rows) when larger than the tokenizer's, "
            "as released checkpoints pad theirs (Qwen2.5-VL: 151,936 rows for 151,665 tokens): a "
            "full-size model built with the small local tokenizer, its regular vocabulary filled "
            "with decodable filler tokens up to the rows less the released padding "
            "(RELEASED_PADDING_ROWS) and the special tokens. ``None``: the tokenizer's size."
        ),
    )
    tie_word_embeddings: bool = False
    weights_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the saved weights (bfloat16 halves a full-size model's files)."
    )

    @model_validator(mode="after")
    def _check_shapes(self) -> _QwenVLSpec:
        if self.text_num_heads % self.text_num_kv_heads:
            raise ValueError(
                f"text_num_heads={self.text_num_heads} is not a multiple of "
                f"text_num_kv_heads={self.text_num_kv_heads}"
            )
        if 2 * sum(self.mrope_section) != self.text_head_dim:
            raise ValueError(
                f"mrope_section={self.mrope_section} must sum to text_head_dim / 2 "
                f"= {self.text_head_dim // 2}"
            )
        if self.vocab_size is not None and self.vocab_size < self.bpe_vocab_size:
            raise ValueError(
                f"vocab_size={self.vocab_size} is smaller than the tokenizer's "
                f"bpe_vocab_size={self.bpe_vocab_size}"
            )
        if self.vision_hidden_size % self.vision_num_heads:
            raise ValueError(
                f"vision_hidden_size={self.vision_hidden_size} is not a multiple of "
                f"vision_num_heads={self.vision_num_heads}"
            )
        return self

    #: The chat template under ``chat_templates/`` when it is not the family's name.
    template_family: ClassVar[str | None] = None

    # -- shared writing steps -------------------------------------------------------------------

    def _tokenizer(self) -> PreTrainedTokenizerFast:
        regular = None
        if self.vocab_size is not None:  # as released: the rows beyond the tokenizer are padding only
            special = len(QWEN_SPECIAL_TOKENS) + len(QWEN_ADDED_TOKENS)
            regular = self.vocab_size - RELEASED_PADDING_ROWS - special
        return build_tokenizer(
            bpe_vocab_size=self.bpe_vocab_size,
            regular_vocab_size=regular,
            special_tokens=QWEN_SPECIAL_TOKENS,
            chat_template=load_chat_template(self.template_family or self.family),
            roles=_ROLES,
            extra_special_tokens=_NAMED_TOKENS,
            added_tokens=QWEN_ADDED_TOKENS,
            model_max_length=self.max_position_embeddings,
        )

    def _token_ids(self, tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
        ids = tokenizer.convert_tokens_to_ids
        return {
            "image_token_id": ids("<|image_pad|>"),
            "video_token_id": ids("<|video_pad|>"),
            "vision_start_token_id": ids("<|vision_start|>"),
            "vision_end_token_id": ids("<|vision_end|>"),
        }

    def _write_model(
        self,
        out_dir: Path,
        *,
        seed: int,
        config: PreTrainedConfig,
        model_cls: type[PreTrainedModel],
        tokenizer: PreTrainedTokenizerFast,
        processor: ProcessorMixin,
    ) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config).to(getattr(torch, self.weights_dtype)).eval()
        model.save_pretrained(out_dir)
        GenerationConfig(
            bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
            pad_token_id=tokenizer.pad_token_id,
        ).save_pretrained(out_dir)
        processor.save_pretrained(out_dir)

    def _text_config(self, tokenizer: PreTrainedTokenizerFast, **extra: object) -> dict[str, object]:
        return {
            "vocab_size": max(len(tokenizer), self.vocab_size or 0),
            "hidden_size": self.text_hidden_size,
            "intermediate_size": self.text_intermediate_size,
            "num_hidden_layers": self.text_num_layers,
            "num_attention_heads": self.text_num_heads,
            "num_key_value_heads": self.text_num_kv_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **extra,
        }

    def _vision_config(self, **extra: object) -> dict[str, object]:
        """The vision tower's config fields both Qwen generations share, plus ``extra``."""
        return {
            "depth": self.vision_depth,
            "hidden_size": self.vision_hidden_size,
            "intermediate_size": self.vision_intermediate_size,
            "num_heads": self.vision_num_heads,
            "patch_size": self.patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "out_hidden_size": self.text_hidden_size,
            **extra,
        }

    def _processor_patching(self) -> dict[str, int]:
        """The patching arguments of the image and video processors."""
        return {
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.spatial_merge_size,
        }


class Qwen25VLSpec(_QwenVLSpec):
    """Tiny Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``), about 1.7 M parameters by default.

    Loads in HF transformers, vLLM and Megatron-Bridge's ``AutoBridge``. Keep ``text_head_dim`` at
    128 for Megatron-Bridge: its Qwen2.5-VL bridge ignores ``mrope_section`` and uses the default
    (16, 24, 24), which only fits a head size of 128.
    """

    family: ClassVar[str] = "qwen2_5_vl"
    builder_version: ClassVar[int] = 4  # 4: a full-size vocabulary's tokenizer filled (RELEASED_PADDING_ROWS)

    window_size: PositiveInt = Field(112, description="Vision window attention side, pixels.")
    fullatt_block_indexes: tuple[int, ...] = Field((1,), description="Vision blocks with full attention.")
    tokens_per_second: PositiveInt = Field(2, description="M-RoPE time positions per second of video.")
    video_min_pixels: PositiveInt = Field(56 * 56, description="Smallest resized frame area, pixels.")
    video_max_pixels: PositiveInt = Field(112 * 112, description="Largest resized frame area, pixels.")

    @model_validator(mode="after")
    def _check_head_dim(self) -> Qwen25VLSpec:
        # Qwen2.5-VL has no head_dim setting: every consumer derives it from hidden size and heads.
        if self.text_hidden_size != self.text_head_dim * self.text_num_heads:
            raise ValueError(
                f"text_hidden_size={self.text_hidden_size} must equal text_head_dim * text_num_heads "
                f"= {self.text_head_dim * self.text_num_heads} (Qwen2.5-VL derives the head size)"
            )
        return self

    def write(self, out_dir: Path, *, seed: int) -> None:
        from transformers import (
            Qwen2_5_VLConfig,
            Qwen2_5_VLForConditionalGeneration,
            Qwen2_5_VLProcessor,
            Qwen2VLImageProcessor,
            Qwen2VLVideoProcessor,
        )

        tokenizer = self._tokenizer()
        config = Qwen2_5_VLConfig(
            architectures=["Qwen2_5_VLForConditionalGeneration"],
            text_config=self._text_config(
                tokenizer,
                rope_parameters={
                    "rope_type": "default",
                    "mrope_section": list(self.mrope_section),
                    "rope_theta": self.rope_theta,
                },
            ),
            vision_config=self._vision_config(
                tokens_per_second=self.tokens_per_second,
                window_size=self.window_size,
                fullatt_block_indexes=list(self.fullatt_block_indexes),
            ),
            tie_word_embeddings=self.tie_word_embeddings,
            **self._token_ids(tokenizer),
        )
        vision = self._processor_patching()
        processor = Qwen2_5_VLProcessor(
            image_processor=Qwen2VLImageProcessor(
                min_pixels=self.image_min_pixels, max_pixels=self.image_max_pixels, **vision
            ),
            video_processor=Qwen2VLVideoProcessor(
                min_pixels=self.video_min_pixels,
                max_pixels=self.video_max_pixels,
                fps=self.video_fps,
                min_frames=self.video_min_frames,
                max_frames=self.video_max_frames,
                cap_pixels_per_frame=False,
                **vision,
            ),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
        self._write_model(
            out_dir,
            seed=seed,
            config=config,
            model_cls=Qwen2_5_VLForConditionalGeneration,
            tokenizer=tokenizer,
            processor=processor,
        )


class Qwen3VLSpec(_QwenVLSpec):
    """Tiny Qwen3-VL (``Qwen3VLForConditionalGeneration``): patch 16, deepstack, interleaved M-RoPE.

    Loads in HF transformers, vLLM and Megatron-Bridge (through :mod:`rl_bridge.megatron.qwen3_vl`).
    """

    family: ClassVar[str] = "qwen3_vl"
    builder_version: ClassVar[int] = 4  # 4: a full-size vocabulary's tokenizer filled

    patch_size: PositiveInt = 16
    mrope_section: tuple[PositiveInt, PositiveInt, PositiveInt] = (24, 20, 20)
    image_min_pixels: PositiveInt = 64 * 64
    image_max_pixels: PositiveInt = 256 * 256
    num_position_embeddings: PositiveInt = Field(
        64, description="Learned vision position grid, a perfect square (8 x 8 by default)."
    )
    deepstack_visual_indexes: tuple[int, ...] = Field(
        (0,), description="Vision blocks whose features are added into the first text layers."
    )
    video_min_pixels: PositiveInt = Field(
        4 * 64 * 64, description="Smallest resized video volume, frames x pixels."
    )
    video_max_pixels: PositiveInt = Field(
        16 * 128 * 128, description="Largest resized video volume, frames x pixels."
    )

    @model_validator(mode="after")
    def _check_vision(self) -> Qwen3VLSpec:
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(
                f"num_position_embeddings={self.num_position_embeddings} is not a perfect square"
            )
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.vision_depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {bad} outside the {self.vision_depth} vision blocks")
        return self

    def _model_classes(self) -> tuple[type[PreTrainedConfig], type[PreTrainedModel], dict[str, object]]:
        """The HF config and model classes, and text config fields beyond the dense ones."""
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        return Qwen3VLConfig, Qwen3VLForConditionalGeneration, {}

    def write(self, out_dir: Path, *, seed: int) -> None:
        from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

        tokenizer = self._tokenizer()
        config_cls, model_cls, text_extra = self._model_classes()
        config = config_cls(
            architectures=[model_cls.__name__],
            text_config=self._text_config(
                tokenizer,
                **text_extra,
                head_dim=self.text_head_dim,
                rope_parameters={
                    "rope_type": "default",
                    "mrope_section": list(self.mrope_section),
                    "mrope_interleaved": True,
                    "rope_theta": self.rope_theta,
                },
            ),
            vision_config=self._vision_config(
                num_position_embeddings=self.num_position_embeddings,
                deepstack_visual_indexes=list(self.deepstack_visual_indexes),
            ),
            tie_word_embeddings=self.tie_word_embeddings,
            **self._token_ids(tokenizer),
        )
        vision = self._processor_patching()
        processor = Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessor(
                size={"shortest_edge": self.image_min_pixels, "longest_edge": self.image_max_pixels},
                image_mean=[0.5, 0.5, 0.5],
                image_std=[0.5, 0.5, 0.5],
                **vision,
            ),
            video_processor=Qwen3VLVideoProcessor(
                size={"shortest_edge": self.video_min_pixels, "longest_edge": self.video_max_pixels},
                fps=self.video_fps,
                min_frames=self.video_min_frames,
                max_frames=self.video_max_frames,
                **vision,
            ),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
        self._write_model(
            out_dir,
            seed=seed,
            config=config,
            model_cls=model_cls,
            tokenizer=tokenizer,
            processor=processor,
        )


class Qwen3VLMoeSpec(Qwen3VLSpec):
    """Tiny Qwen3-VL MoE (``Qwen3VLMoeForConditionalGeneration``): :class:`Qwen3VLSpec` with every
    text layer's MLP a mixture of ``num_experts`` routed experts, ``experts_per_token`` per token."""

    family: ClassVar[str] = "qwen3_vl_moe"
    template_family: ClassVar[str | None] = "qwen3_vl"
    builder_version: ClassVar[int] = 2  # 2: a full-size vocabulary's tokenizer filled

    num_experts: PositiveInt = 4
    experts_per_token: PositiveInt = 2
    moe_intermediate_size: PositiveInt = Field(64, description="Hidden size of each expert's MLP.")

    @model_validator(mode="after")
    def _check_experts(self) -> Qwen3VLMoeSpec:
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token={self.experts_per_token} exceeds num_experts={self.num_experts}"
            )
        return self

    def _model_classes(self) -> tuple[type[PreTrainedConfig], type[PreTrainedModel], dict[str, object]]:
        from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

        experts = {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.experts_per_token,
            "moe_intermediate_size": self.moe_intermediate_size,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
        return Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, experts
