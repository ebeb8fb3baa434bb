"""Config class of NemotronH Nano VL V2 checkpoints, loaded as remote code (``auto_map``).

This file is copied next to ``config.json`` of tiny Nemotron VL models and imported by
``AutoConfig.from_pretrained(..., trust_remote_code=True)`` (which vLLM calls); the package never
imports it. Like the released checkpoints' config class, it nests a ``NemotronHConfig`` as
``llm_config`` (vLLM reads it as ``text_config``) and keeps the RADIO vision settings, whose
encoder size vLLM derives from ``vision_config.args["model"]``. An Omni-style model also has a
``sound_config`` (the Parakeet audio encoder and its feature extractor's settings), kept as a plain
``PretrainedConfig`` as vLLM reads it; without one vLLM serves no audio.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig
from transformers.models.nemotron_h import NemotronHConfig


class NemotronH_Nano_VL_V2_Config(PretrainedConfig):
    model_type = "NemotronH_Nano_VL_V2"
    is_composition = True

    def __init__(
        self,
        vision_config: dict[str, Any] | None = None,
        llm_config: dict[str, Any] | None = None,
        force_image_size: int = 512,
        patch_size: int = 16,
        downsample_ratio: float = 0.5,
        template: str | None = None,
        ps_version: str = "v2",
        image_tag_type: str = "internvl",
        projector_hidden_size: int = 4096,
        vit_hidden_size: int = 1280,
        use_thumbnail: bool = True,
        norm_mean: tuple[float, float, float] | list[float] = (0.48145466, 0.4578275, 0.40821073),
        norm_std: tuple[float, float, float] | list[float] = (0.26862954, 0.26130258, 0.27577711),
        img_context_token_id: int | None = None,
        sound_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.vision_config = PretrainedConfig(**(vision_config or {}))
        self.llm_config = NemotronHConfig(**(llm_config or {}))
        self.force_image_size = force_image_size
        self.patch_size = patch_size
        self.downsample_ratio = downsample_ratio
        self.template = template
        self.ps_version = ps_version
        self.image_tag_type = image_tag_type
        self.projector_hidden_size = projector_hidden_size
        self.vit_hidden_size = vit_hidden_size
        self.use_thumbnail = use_thumbnail
        self.norm_mean = list(norm_mean)
        self.norm_std = list(norm_std)
        self.img_context_token_id = img_context_token_id
        self.sound_config = None if sound_config is None else PretrainedConfig(**sound_config)
        super().__init__(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output["vision_config"] = self.vision_config.to_dict()
        output["llm_config"] = self.llm_config.to_dict()
        if self.sound_config is not None:
            output["sound_config"] = self.sound_config.to_dict()
        return output
