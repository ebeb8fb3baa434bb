"""Nemotron Nano VL (V2, Omni): video frames resized and normalised exactly as vLLM's own processor.

Nemotron checkpoints have no HF processor; vLLM implements one
(``vllm/transformers_utils/processors/nano_nemotron_vl.py``, ``NanoNemotronVLProcessor``). This
module reproduces its video path bit for bit, without importing vLLM:

- frame size (:func:`video_frame_size`): ``video_target_num_patches`` (or ``video_target_img_size``)
  patches per frame, keeping the aspect ratio when ``video_maintain_aspect_ratio`` (patch grid
  ``round(sqrt(t / aspect))`` by ``round(sqrt(t * aspect))``, snapped to a multiple of
  ``1 / downsample_ratio``, up when that stays within the budget, else down), a square grid
  otherwise; without a patch budget, ``force_image_size`` squared;
- pixels: uint8 NHWC -> float32 NCHW, bicubic resize (``align_corners=False``, ``antialias=True``)
  only when the size changes, ``(x / 255 - mean) / std``, cast to the processor dtype;
- tokens: ``int((H * W // patch**2) * downsample_ratio**2)`` placeholders per tubelet of
  ``video_temporal_patch_size`` frames (``ceil(N / T)`` tubelets), one ``<img>...</img>`` run each.

Tensors follow Megatron-Bridge's Nemotron Omni model inputs: ``pixel_values`` ``[N, 3, H, W]``,
``imgs_sizes`` ``[N, 2]`` int32 (height, width) and ``num_frames`` ``[1]`` int32. Geometry is read
from the checkpoint config as vLLM reads it (``AutoConfig`` with the checkpoint's remote code).

Audio in video (Omni checkpoints, those with a ``sound_config``): when vLLM serves a video with
``use_audio_in_video``, its Nemotron processor decodes the track from the bytes the loader kept
(``original_video_bytes``) and turns it into Parakeet log-mel features. Those steps are not
reimplemented here: :meth:`NemotronVLProcessor.process_video_audio` calls the same vLLM functions
in the same order (``load_audio_pyav`` under ``VLLM_MAX_AUDIO_DECODE_DURATION_S``, the multimodal
data parser's resampling to the sound config's rate and mono, ``ParakeetExtractor``), so the policy
hears what vLLM heard. This imports vLLM (installed with the trainer).
"""

from __future__ import annotations

import io
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from rl_bridge.processors.base import MediaProcessingError, MediaProcessor, ProcessedMedia
from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.geometry import check_geometry, vision_geometry
from vllm_video_plugin.sampling import FrameSample

__all__ = ["AUDIO_CONTEXT_TOKEN", "NemotronVLProcessor", "nemotron_pixels", "video_frame_size"]

#: The placeholder each audio feature replaces (vLLM's ``AUDIO_CONTEXT``), between ``<so_start>``
#: and ``<so_end>``.
AUDIO_CONTEXT_TOKEN = "<so_embedding>"

_LOG = logging.getLogger(__name__)


def video_frame_size(
    width: int,
    height: int,
    *,
    target_num_patches: int,
    keep_aspect: bool,
    patch_size: int,
    downsample_ratio: float,
) -> tuple[int, int]:
    """Target ``(width, height)`` in pixels of a ``width`` x ``height`` frame under a patch budget
    (vLLM's ``get_video_target_size_and_feature_size``)."""
    divisor = round(1 / downsample_ratio)
    if not keep_aspect:
        side = max(divisor, int(math.sqrt(target_num_patches)) // divisor * divisor)
        return side * patch_size, side * patch_size
    aspect = width / max(height, 1)
    rows = max(1, round(math.sqrt(target_num_patches / aspect)))
    cols = max(1, round(math.sqrt(target_num_patches * aspect)))
    if divisor > 1:
        rows_up = rows + (divisor - rows % divisor if rows % divisor else 0)
        cols_up = cols + (divisor - cols % divisor if cols % divisor else 0)
        if rows_up * cols_up <= target_num_patches:
            rows, cols = rows_up, cols_up
        else:
            rows = max(divisor, rows - rows % divisor)
            cols = max(divisor, cols - cols % divisor)
    return cols * patch_size, rows * patch_size


def nemotron_pixels(
    frames: NDArray[np.uint8],
    size: tuple[int, int] | None,
    mean: torch.Tensor,
    std: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``(N, H, W, 3)`` uint8 frames -> ``(N, 3, h, w)`` normalised pixels, as vLLM computes them.

    ``size`` is the target ``(height, width)``, ``None`` to keep the frames' size; ``mean`` and
    ``std`` are ``(1, 3, 1, 1)`` float32.
    """
    # torch.tensor copies: decoded frames are read-only (shared with the decode cache).
    tensor = torch.tensor(frames).permute(0, 3, 1, 2).to(dtype=torch.float32)
    if size is not None:
        tensor = torch.nn.functional.interpolate(
            tensor, size=size, mode="bicubic", align_corners=False, antialias=True
        )
    return ((tensor / 255.0 - mean) / std).to(dtype=dtype).contiguous()


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    return torch.float32


class NemotronVLProcessor(MediaProcessor):
    """Policy tensors of a Nemotron Nano VL V2 / Omni checkpoint (videos only)."""

    family = "nemotron_vl"

    def __init__(
        self, model_dir: str | Path, contract: VideoSamplingContract, *, dtype: torch.dtype | None = None
    ) -> None:
        """
        Args:
            model_dir: the HF checkpoint directory; its config is loaded with its remote code,
                as vLLM loads it.
            contract: the contract vLLM's loader samples with (the frame count is a serving
                setting, not in the checkpoint).
            dtype: pixel dtype; ``None`` means the config's ``dtype``, as vLLM's processor uses.

        Raises:
            ValueError: ``contract`` contradicts the checkpoint's geometry (both values named).
        """
        from transformers import AutoConfig

        directory = Path(model_dir)
        config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
        check_geometry(contract, vision_geometry(config, None), checkpoint=str(directory))
        self.contract = contract
        vision = getattr(config, "vision_config", config)
        self.patch_size = int(config.patch_size)
        self.downsample_ratio = float(config.downsample_ratio)
        self.image_size = int(config.force_image_size)
        self.temporal_patch_size = int(getattr(vision, "video_temporal_patch_size", 1))
        self.keep_aspect = bool(getattr(vision, "video_maintain_aspect_ratio", False))
        target = getattr(vision, "video_target_num_patches", None)
        image_size = getattr(vision, "video_target_img_size", None)
        if target is not None and image_size is not None:
            raise ValueError(
                f"{directory}: vision_config sets both video_target_num_patches and video_target_img_size"
            )
        if target is None and image_size is not None:
            target = math.ceil(image_size / self.patch_size) ** 2
        self.target_num_patches: int | None = None if target is None else int(target)
        self.mean = torch.Tensor(config.norm_mean).reshape(1, 3, 1, 1)
        self.std = torch.Tensor(config.norm_std).reshape(1, 3, 1, 1)
        self.dtype = dtype if dtype is not None else _dtype(getattr(config, "dtype", None))
        self.image_token_id = int(config.img_context_token_id)
        self.directory = directory
        self.sound_config = getattr(config, "sound_config", None)
        """The checkpoint's audio encoder settings (``None``: no audio, a VL rather than Omni model)."""
        self.audio_token_id: int | None = None
        self._audio_extractor: Any = None
        if self.sound_config is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
            token_id = tokenizer.convert_tokens_to_ids(AUDIO_CONTEXT_TOKEN)
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(
                    f"{directory}: the config has a sound_config but the tokenizer has no "
                    f"{AUDIO_CONTEXT_TOKEN} token for the audio features"
                )
            self.audio_token_id = token_id

    @property
    def placeholder_token_ids(self) -> frozenset[int]:
        if self.audio_token_id is None:
            return frozenset({self.image_token_id})
        return frozenset({self.image_token_id, self.audio_token_id})

    def frame_size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` in pixels that a ``width`` x ``height`` video frame is resized to."""
        if self.target_num_patches is None:
            return self.image_size, self.image_size
        return video_frame_size(
            width,
            height,
            target_num_patches=self.target_num_patches,
            keep_aspect=self.keep_aspect,
            patch_size=self.patch_size,
            downsample_ratio=self.downsample_ratio,
        )

    def process_video(self, frames: NDArray[np.uint8], sample: FrameSample) -> ProcessedMedia:
        count, height, width = frames.shape[:3]
        target_w, target_h = self.frame_size(width, height)
        size = None if (target_h, target_w) == (height, width) else (target_h, target_w)
        pixels = nemotron_pixels(frames, size, self.mean, self.std, self.dtype)
        tokens = int((target_h * target_w // self.patch_size**2) * self.downsample_ratio**2)
        tubelets = math.ceil(count / self.temporal_patch_size) if self.temporal_patch_size > 1 else count
        tensors = {
            "pixel_values": pixels,
            "imgs_sizes": torch.tensor([[target_h, target_w]] * count, dtype=torch.int32),
            "num_frames": torch.tensor([count], dtype=torch.int32),
        }
        return ProcessedMedia("video", tensors, self.image_token_id, (tokens,) * tubelets)

    def process_video_audio(self, data: bytes, *, source: str) -> ProcessedMedia | None:
        """The audio features of the encoded video ``data``'s own track, computed by the vLLM code
        its Nemotron processor runs with ``use_audio_in_video``
        (``NanoNemotronVLMultiModalProcessor._extract_audio_from_videos``, the data parser, and
        ``NanoNemotronVLProcessor._preprocess_audio``).

        Returns:
            ``None`` when vLLM finds no usable track (it then shows the video without audio and
            adds no audio placeholders): no audio stream, undecodable audio, or longer than
            ``VLLM_MAX_AUDIO_DECODE_DURATION_S``. Otherwise tensors as vLLM's model receives them:
            ``input_audio_features`` ``[clips, T, mel]`` in :attr:`dtype`, ``feature_attention_mask``
            ``[clips, T]`` bool, ``audio_num_clips`` ``[1]``; one run of :attr:`audio_token_id`.

        Raises:
            MediaProcessingError: the checkpoint has no ``sound_config`` (no audio encoder).
        """
        if self.sound_config is None or self.audio_token_id is None:
            raise MediaProcessingError(
                source, f"{self.directory} has no sound_config: the policy hears no audio (not an Omni model)"
            )
        from vllm import envs
        from vllm.multimodal.media.audio import load_audio_pyav
        from vllm.multimodal.parse import AudioProcessorItems

        try:
            decoded = load_audio_pyav(io.BytesIO(data), max_duration_s=envs.VLLM_MAX_AUDIO_DECODE_DURATION_S)
        except Exception as error:  # vLLM treats any failure as "no audio stream"
            _LOG.debug("%s: no audio track taken (%s), as vLLM skips it", source, error)
            return None
        items = self._audio_parser().parse_mm_data({"audio": [decoded]})
        audio = items.get_items("audio", AudioProcessorItems).get(0)
        extractor = self._extractor()
        features = extractor([audio])
        tensors = {
            # vLLM casts the processor's floating outputs to the model dtype (the pixels' dtype).
            "input_audio_features": features["input_audio_features"].to(dtype=self.dtype),
            "feature_attention_mask": features["feature_attention_mask"],
            "audio_num_clips": torch.tensor(features["audio_num_clips"], dtype=torch.int64),
        }
        tokens = extractor.audio_token_count(len(audio))
        return ProcessedMedia("audio", tensors, self.audio_token_id, (tokens,))

    def _audio_parser(self) -> Any:
        """vLLM's data parser as its Nemotron processing info builds it for audio: resampling to
        the sound config's rate (its default resampler) and down to one channel."""
        from vllm.multimodal.parse import MultiModalDataParser

        return MultiModalDataParser(target_sr=self.sound_config.sampling_rate, target_channels=1)

    def _extractor(self) -> Any:
        """vLLM's Parakeet feature extractor for the checkpoint's sound config, made once."""
        if self._audio_extractor is None:
            from vllm.model_executor.models.parakeet import ParakeetExtractor

            self._audio_extractor = ParakeetExtractor(self.sound_config)
        return self._audio_extractor

    def process_image(self, image: NDArray[np.uint8], *, source: str) -> ProcessedMedia:
        raise MediaProcessingError(
            source, "images are not supported for Nemotron VL policies (only videos are reproduced)"
        )
