"""Qwen2.5-VL and Qwen3-VL: the checkpoint's own HF video and image processors on vLLM's frames.

vLLM's Qwen2.5-VL and Qwen3-VL models process media with the checkpoint's HF processor (resize with
``smart_resize``, rescale, normalise, patchify), after its ``qwen2_vl`` / ``qwen3_vl`` loader sampled
the frames. Here the frames come from the shared sampling code and decode cache instead of a
second decode, and go through the same HF video processor with its own sampling turned off, so
the tensors are the ones vLLM's engine computed. Everything is read from the checkpoint: the
vision geometry, the pixel budget and the sampling rate (the contract of
:func:`qwen_contract`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from numpy.typing import NDArray

from rl_bridge.processors.base import MediaProcessingError, MediaProcessor, ProcessedMedia, ProcessorFamily
from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.geometry import check_geometry, read_processor_config, vision_geometry
from vllm_video_plugin.sampling import FrameSample, qwen2_5_seconds_per_temporal_patch

__all__ = ["QWEN_FAMILIES", "QwenVLProcessor", "qwen_contract"]

QWEN_FAMILIES: Final[dict[str, ProcessorFamily]] = {
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",  # the same vision tower and processors as dense Qwen3-VL
}
"""Checkpoint ``model_type`` -> processor family."""
_STYLES: Final = {"qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl"}


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"{model_dir}: cannot read the checkpoint config ({error})") from error


def qwen_contract(model_dir: str | Path) -> VideoSamplingContract:
    """The sampling contract of a Qwen2.5-VL or Qwen3-VL checkpoint, as its processor samples.

    ``fps``, ``min_frames`` and ``max_frames`` come from the checkpoint's video processor settings,
    the geometry (patch, merge and temporal patch sizes, pixel budget) from its config and
    processor settings.

    Raises:
        ValueError: not a Qwen2.5-VL / Qwen3-VL checkpoint, or it has no video processor settings.
    """
    directory = Path(model_dir)
    config = _read_config(directory)
    model_type = config.get("model_type")
    if model_type not in _STYLES:
        raise ValueError(f"{directory}: model_type {model_type!r} is not one of {sorted(_STYLES)}")
    settings = read_processor_config(directory)
    if settings is None:
        raise ValueError(f"{directory}: no video processor settings (processor or preprocessor config)")
    geometry = vision_geometry(config, settings)
    fields: dict[str, Any] = {
        "style": _STYLES[model_type],
        "temporal_patch_size": geometry.temporal_patch_size,
        "patch_size": geometry.patch_size,
        "spatial_merge_size": geometry.spatial_merge_size,
        "min_pixels": geometry.min_pixels,
        "max_pixels": geometry.max_pixels,
    }
    for name in ("fps", "min_frames", "max_frames"):
        if settings.get(name) is not None:
            fields[name] = float(settings[name]) if name == "fps" else int(settings[name])
    return VideoSamplingContract.model_validate({k: v for k, v in fields.items() if v is not None})


class QwenVLProcessor(MediaProcessor):
    """Policy tensors of Qwen2.5-VL (the training path) and Qwen3-VL checkpoints.

    Video tensors: ``pixel_values_videos`` ``[patches, C * T * P * P]``, ``video_grid_thw``
    ``[1, 3]`` and, for Qwen2.5-VL, ``second_per_grid_ts`` ``[1]`` (seconds per temporal patch).
    Image tensors: ``pixel_values`` and ``image_grid_thw``.
    """

    def __init__(self, model_dir: str | Path, contract: VideoSamplingContract | None = None) -> None:
        """
        Args:
            model_dir: the HF checkpoint directory (config and processor settings).
            contract: the contract vLLM's loader samples with; ``None`` means the checkpoint's own
                (:func:`qwen_contract`, what a server without ``--media-io-kwargs`` uses).

        Raises:
            ValueError: not a Qwen2.5-VL / Qwen3-VL checkpoint, or ``contract`` contradicts its
                geometry (both values named).
        """
        from transformers import AutoImageProcessor, AutoVideoProcessor

        directory = Path(model_dir)
        config = _read_config(directory)
        model_type = config.get("model_type")
        if model_type not in QWEN_FAMILIES:
            raise ValueError(f"{directory}: model_type {model_type!r} is not one of {sorted(QWEN_FAMILIES)}")
        self.family = QWEN_FAMILIES[model_type]
        if contract is None:
            contract = qwen_contract(directory)
        check_geometry(
            contract, vision_geometry(config, read_processor_config(directory)), checkpoint=str(directory)
        )
        self.contract = contract
        self._video = AutoVideoProcessor.from_pretrained(directory)
        self._image = AutoImageProcessor.from_pretrained(directory)
        self._merge = int(self._video.merge_size)
        self._temporal_patch = int(self._video.temporal_patch_size)
        self.video_token_id = int(config["video_token_id"])
        self.image_token_id = int(config["image_token_id"])

    @property
    def placeholder_token_ids(self) -> frozenset[int]:
        return frozenset({self.video_token_id, self.image_token_id})

    def process_video(self, frames: NDArray[np.uint8], sample: FrameSample) -> ProcessedMedia:
        from transformers.video_utils import VideoMetadata

        metadata = VideoMetadata(
            total_num_frames=sample.total_frames,
            fps=sample.source_fps,
            duration=sample.duration_s,
            frames_indices=list(sample.indices),
        )
        # A copy: decoded frames are read-only and shared with the decode cache.
        out = self._video(
            videos=[np.array(frames)], video_metadata=[metadata], do_sample_frames=False, return_tensors="pt"
        )
        grid = out["video_grid_thw"]
        t, h, w = (int(v) for v in grid[0])
        tensors = {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": grid}
        per_frame = h * w // self._merge**2
        if self.family == "qwen2_5_vl":
            # transformers' second_per_grid_ts: temporal patch / sampled fps, for any sampling style.
            seconds = qwen2_5_seconds_per_temporal_patch(
                len(sample.indices), sample.total_frames, sample.source_fps, self._temporal_patch
            )
            tensors["second_per_grid_ts"] = torch.tensor([seconds], dtype=torch.float32)
            runs: tuple[int, ...] = (t * per_frame,)
        else:  # Qwen3-VL stamps every temporal patch: "<t seconds><|vision_start|>pads<|vision_end|>"
            runs = (per_frame,) * t
        return ProcessedMedia("video", tensors, self.video_token_id, runs)

    def process_image(self, image: NDArray[np.uint8], *, source: str) -> ProcessedMedia:
        out = self._image(images=[np.array(image)], return_tensors="pt")
        grid = out["image_grid_thw"]
        tokens = int(grid.prod()) // self._merge**2
        if tokens < 1:
            raise MediaProcessingError(source, f"the image grid {grid.tolist()} gives no tokens")
        return ProcessedMedia(
            "image",
            {"pixel_values": out["pixel_values"], "image_grid_thw": grid},
            self.image_token_id,
            (tokens,),
        )
