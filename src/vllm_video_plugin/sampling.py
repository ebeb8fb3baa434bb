"""Frame sampling styles as pure functions, shared by vLLM's loader and the trainer.

Each style maps a video's frame count, frame rate and duration to the frame indices to decode, and
computes the timing text or values the matching model processor derives from them. Indices are
frame numbers in presentation order (0 = first frame). Everything here is numpy only: no vLLM, no
torch, so the Gym side can import it.

Sources replicated (vLLM 0.32 / transformers 5.19, as installed in the project's main environment):

- ``uniform``: ``vllm.multimodal.video.VideoBackend.compute_frames_index_to_sample`` (loaders
  ``opencv`` and ``nemotron_vl``).
- ``nemotron_rounded``: NeMo RL's Nemotron sampling (``nemo_rl/models/generation/vllm/
  video_utils.py``: ``_round_video_frame_count`` and ``_compute_video_timestamps``).
- ``qwen2_vl``: ``Qwen2VLVideoBackend.compute_frames_index_to_sample``, itself a port of
  ``transformers`` ``Qwen2VLVideoProcessor.sample_frames``, including its float32 ``torch.arange``.
- ``qwen3_vl``: ``Qwen3VLVideoBackend.compute_frames_index_to_sample``.
- Timestamps: Nemotron's ``calculate_timestamps`` (integer-millisecond frame duration,
  ``vllm/transformers_utils/processors/nano_nemotron_vl.py``), Qwen3-VL's ``_calculate_timestamps``
  (one timestamp per temporal patch), Qwen2.5-VL's ``second_per_grid_ts``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from vllm_video_plugin.contract import SamplingStyle, VideoSamplingContract
from vllm_video_plugin.errors import VideoSamplingError

__all__ = [
    "MIN_SOURCE_FPS",
    "QWEN3_UNKNOWN_FPS",
    "FrameSample",
    "PRESENTATION_INDEX_FPS",
    "nemotron_prompt_timestamps",
    "nemotron_rounded_indices",
    "presentation_timed",
    "qwen2_5_seconds_per_temporal_patch",
    "qwen2_vl_indices",
    "qwen3_prompt_timestamps",
    "qwen3_vl_indices",
    "sample_frames",
    "uniform_indices",
]

QWEN3_UNKNOWN_FPS: Final = 24.0
"""Source rate, in frames per second, that Qwen3-VL (HF and vLLM) assumes when a video reports none."""
_MS_PER_S: Final = 1000.0
PRESENTATION_INDEX_FPS: Final = 1000.0
"""Index rate of :func:`presentation_timed` samples: a millisecond clock, on which Qwen3-VL's and
Nemotron's timestamp arithmetic (``index / fps``; ``index * int(1000 / fps) / 1000``) is exact."""


@dataclass(frozen=True)
class FrameSample:
    """The frames a sampling style picked from one video, and the timing its model is shown.

    ``indices`` may repeat a frame (``nemotron_rounded`` fills a tubelet from a 1-frame video).
    """

    style: SamplingStyle
    indices: tuple[int, ...]
    """Source frame index of each sampled frame, in output order (presentation order)."""
    timestamps_s: tuple[float, ...]
    """Nominal presentation time of each sampled frame: ``index / source_fps``, in seconds."""
    total_frames: int
    """Frame count of the video that was sampled."""
    source_fps: float
    """Frame rate of the video in frames per second, as the style used it (Qwen3-VL substitutes
    :data:`QWEN3_UNKNOWN_FPS` for an unknown rate). This is the ``fps`` of vLLM's video metadata."""
    duration_s: float
    """Duration of the video in seconds, as given to the style."""
    temporal_patch_size: int
    prompt_timestamps_s: tuple[float, ...]
    """The timestamps the model's processor writes into the prompt, in seconds: one per frame for the
    Nemotron styles (``uniform``, ``nemotron_rounded``; :func:`nemotron_prompt_timestamps`), one
    per temporal patch for ``qwen3_vl`` (:func:`qwen3_prompt_timestamps`), none for ``qwen2_vl``."""
    seconds_per_temporal_patch: float | None
    """``qwen2_vl`` only: Qwen2.5-VL's ``second_per_grid_ts`` (seconds spanned by one temporal
    patch, the M-RoPE time step; :func:`qwen2_5_seconds_per_temporal_patch`). ``None`` otherwise."""


def _check_total(total_frames: int) -> None:
    if total_frames < 1:
        raise VideoSamplingError(f"the video has {total_frames} frames; sampling needs at least one")


def _check_duration(duration_s: float) -> None:
    if not math.isfinite(duration_s) or duration_s < 0:
        raise VideoSamplingError(f"duration {duration_s} s is not a finite, non-negative number")


MIN_SOURCE_FPS = 1e-6
"""Smallest usable source frame rate, frames per second (one frame in about 11.6 days): no real
video is slower, and the frame times a slower rate implies overflow floating point."""


def _check_fps(source_fps: float, style: str) -> None:
    if not math.isfinite(source_fps) or source_fps < MIN_SOURCE_FPS:
        raise VideoSamplingError(
            f"style {style!r} needs the video's frame rate, got {source_fps} frames/s (unknown or invalid)"
        )


def uniform_indices(
    total_frames: int, duration_s: float, *, num_frames: int | None, fps: float | None
) -> list[int]:
    """vLLM's uniform sampling (loaders ``opencv`` and ``nemotron_vl``).

    ``n = min(num_frames, total_frames, floor(duration_s * fps))`` (a ``None`` term is left out;
    at least 1), then every frame when ``n == total_frames``, else
    ``np.linspace(0, total_frames - 1, n, dtype=int)`` (truncated, not rounded).
    """
    _check_total(total_frames)
    _check_duration(duration_s)
    count = total_frames
    if num_frames is not None:
        count = min(num_frames, total_frames)
    if fps is not None and duration_s * fps < count:  # a product too large for a float caps nothing
        count = math.floor(duration_s * fps)
    count = max(1, count)
    if count == total_frames:
        return list(range(count))
    return np.linspace(0, total_frames - 1, count, dtype=int).tolist()


def nemotron_rounded_indices(
    total_frames: int, duration_s: float, *, num_frames: int, temporal_patch_size: int
) -> list[int]:
    """NeMo RL's Nemotron sampling: rounded uniform indices over whole tubelets.

    The count is ``min(num_frames, total_frames)`` rounded down to a multiple of
    ``temporal_patch_size``, but at least one tubelet (NeMo RL's rule also tries rounding up, which
    can never stay within both ``num_frames`` and ``total_frames``). Timestamps are
    ``linspace(0, (total_frames - 1) / fps, count)`` with ``fps = total_frames / duration_s``, and
    indices are ``round(timestamp * fps)`` (half to even), clamped to the video. A video of one
    frame, or without a duration, yields frame 0 repeated: 20 frames at 2 fps, 4 requested ->
    ``[0, 6, 13, 19]`` (stock uniform gives ``[0, 6, 12, 19]``); 1 frame, T=2 -> ``[0, 0]``.
    """
    _check_total(total_frames)
    _check_duration(duration_s)
    count = min(max(1, num_frames), total_frames)
    if temporal_patch_size > 1 and count % temporal_patch_size:
        count = max(temporal_patch_size, count - count % temporal_patch_size)
    if count <= 1 or duration_s <= 0 or total_frames <= 1:
        return [0] * count
    fps = total_frames / duration_s
    if not math.isfinite(fps):
        # A duration so short that the rate overflows: round(t * fps) is then exactly the rounded
        # linspace over the frame indices, which is what the timestamps stand for.
        return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()
    timestamps = np.linspace(0.0, (total_frames - 1) / fps, count, dtype=float)
    return [max(0, min(round(float(t) * fps), total_frames - 1)) for t in timestamps]


def _torch_float32_arange(end: int, step: float) -> np.ndarray:
    """``torch.arange(0, end, step)`` (default dtype float32) as torch's x86 CPU kernel computes it.

    The length is ``ceil(end / step)``. The kernel fills blocks of 16 values as two 8-lane float32
    vectors, each started from its first value rounded to float32 and continued with double
    ``step`` increments; a tail shorter than 16 is computed value by value in double. The values
    therefore differ in the last float32 bit from ``float32(i * step)`` inside blocks, which moves a
    truncated index by one frame on some inputs (checked against torch 2.13 for every ``end`` below
    2000 and step ``end / n``, ``n <= 768``).
    """
    size = math.ceil(end / step)
    values = (np.arange(size) * step).astype(np.float32)
    vectorized = size - size % 16
    if vectorized:
        position = np.arange(vectorized)
        lane = position % 8
        lane_start = (position - lane) * step
        values[:vectorized] = (lane_start.astype(np.float32).astype(np.float64) + lane * step).astype(
            np.float32
        )
    return values


def qwen2_vl_indices(
    total_frames: int,
    source_fps: float,
    *,
    fps: float,
    min_frames: int,
    max_frames: int,
    temporal_patch_size: int,
) -> list[int]:
    """Qwen2-VL / Qwen2.5-VL fps-based sampling (vLLM ``qwen2_vl`` loader, HF ``sample_frames``).

    ``n = total / source_fps * min(fps, 30)``, clamped to ``[min_frames, max_frames']`` and
    ``total`` where ``max_frames'`` is ``min(max_frames, total)`` floored to a multiple of
    ``temporal_patch_size``, then floored to such a multiple. Indices are
    ``torch.arange(0, total, total / n).int()`` in float32 (see :func:`_torch_float32_arange`),
    clamped to the last frame.

    Raises:
        VideoSamplingError: unknown frame rate, or fewer frames than ``temporal_patch_size`` (the
            count would be 0; stock vLLM and HF fail with ``ZeroDivisionError`` there).
    """
    _check_total(total_frames)
    _check_fps(source_fps, "qwen2_vl")
    capped_max = math.floor(min(max_frames, total_frames) / temporal_patch_size) * temporal_patch_size
    count = total_frames / source_fps * min(fps, 30)
    count = min(max(count, min_frames), capped_max, total_frames)
    count = math.floor(count / temporal_patch_size) * temporal_patch_size
    if count == 0:
        raise VideoSamplingError(
            f"style 'qwen2_vl' needs at least temporal_patch_size={temporal_patch_size} frames; the "
            f"video has {total_frames} (stock vLLM and transformers fail on it too)"
        )
    indices = _torch_float32_arange(total_frames, total_frames / count).astype(np.int32)
    return np.minimum(indices, total_frames - 1).tolist()


def qwen3_vl_indices(
    total_frames: int, source_fps: float, *, fps: float, min_frames: int, max_frames: int
) -> list[int]:
    """Qwen3-VL fps-based sampling (vLLM ``qwen3_vl`` loader).

    ``n = int(total / source_fps * min(fps, 30))`` clamped to ``[min_frames, max_frames]`` and to
    ``total``; indices ``np.linspace(0, total - 1, n).round()`` (half to even). An unknown
    ``source_fps`` (``<= 0``) counts as :data:`QWEN3_UNKNOWN_FPS`.

    Raises:
        VideoSamplingError: a positive ``source_fps`` that is not a usable rate (infinite, or so
            small that a frame's duration overflows).
    """
    _check_total(total_frames)
    if source_fps > 0:
        _check_fps(source_fps, "qwen3_vl")
    rate = source_fps if source_fps > 0 else QWEN3_UNKNOWN_FPS
    # Clamped to the total before int(): total / rate can overflow to inf (same count otherwise).
    count = int(min(total_frames / rate * min(fps, 30), total_frames))
    count = min(max(count, min_frames), max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()


def nemotron_prompt_timestamps(indices: Sequence[int], source_fps: float) -> tuple[float, ...]:
    """Seconds Nemotron's processor writes for each frame ("Frame 2 sampled at 1.12 seconds").

    The frame duration is whole milliseconds, ``int(1000 / source_fps)``, so at 29.97 fps frame 30
    is at ``30 * 33 / 1000 = 0.99`` s.
    """
    _check_fps(source_fps, "nemotron timestamps")
    frame_ms = int(_MS_PER_S / source_fps)
    return tuple(int(index) * frame_ms / 1000.0 for index in indices)


def qwen3_prompt_timestamps(
    indices: Sequence[int], source_fps: float, temporal_patch_size: int
) -> tuple[float, ...]:
    """Seconds Qwen3-VL's processor writes before each temporal patch ("<1.2 seconds>").

    The indices are padded to a multiple of ``temporal_patch_size`` by repeating the last one; each
    patch is stamped with the mean of its first and last frame's ``index / source_fps``.
    """
    if not indices:
        raise VideoSamplingError("Qwen3-VL timestamps need at least one frame index")
    padded = list(indices)
    if len(padded) % temporal_patch_size:
        padded += [padded[-1]] * (temporal_patch_size - len(padded) % temporal_patch_size)
    seconds = [index / source_fps for index in padded]
    return tuple(
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
        for i in range(0, len(seconds), temporal_patch_size)
    )


def qwen2_5_seconds_per_temporal_patch(
    num_sampled: int, total_frames: int, source_fps: float, temporal_patch_size: int
) -> float:
    """Qwen2.5-VL's ``second_per_grid_ts``: ``temporal_patch_size / sampled_fps`` in seconds, where
    ``sampled_fps = num_sampled / total_frames * source_fps`` (transformers ``VideoMetadata``)."""
    return temporal_patch_size / (num_sampled / total_frames * source_fps)


def sample_frames(
    total_frames: int, source_fps: float, duration_s: float, contract: VideoSamplingContract
) -> FrameSample:
    """Apply ``contract``'s style to a video.

    Args:
        total_frames: frames in the video.
        source_fps: the video's frame rate in frames per second (vLLM passes the container's rate;
            ``<= 0`` means unknown, which only ``qwen3_vl`` accepts).
        duration_s: the video's duration in seconds. vLLM uses ``total_frames / source_fps``; pass the
            same for parity (:attr:`vllm_video_plugin.decode.VideoSourceInfo.duration_s` does).
        contract: the sampling contract.

    Raises:
        VideoSamplingError: the style cannot sample this video (no frames, unknown rate where one
            is needed, too few frames for ``qwen2_vl``).
    """
    _check_total(total_frames)
    _check_duration(duration_s)
    if 0 < source_fps < MIN_SOURCE_FPS:
        raise VideoSamplingError(
            f"source frame rate {source_fps} frames/s is below {MIN_SOURCE_FPS} (one frame in more than "
            "11 days): not a usable rate"
        )
    style = contract.style
    tps = contract.temporal_patch_size
    seconds_per_patch: float | None = None
    if style == "uniform":
        _check_fps(source_fps, style)
        indices = uniform_indices(total_frames, duration_s, num_frames=contract.num_frames, fps=contract.fps)
    elif style == "nemotron_rounded":
        _check_fps(source_fps, style)
        assert contract.num_frames is not None  # the contract requires it for this style
        indices = nemotron_rounded_indices(
            total_frames, duration_s, num_frames=contract.num_frames, temporal_patch_size=tps
        )
    else:
        assert (
            contract.fps is not None and contract.min_frames is not None and contract.max_frames is not None
        )
        if style == "qwen2_vl":
            indices = qwen2_vl_indices(
                total_frames,
                source_fps,
                fps=contract.fps,
                min_frames=contract.min_frames,
                max_frames=contract.max_frames,
                temporal_patch_size=tps,
            )
            seconds_per_patch = qwen2_5_seconds_per_temporal_patch(
                len(indices), total_frames, source_fps, tps
            )
        else:
            indices = qwen3_vl_indices(
                total_frames,
                source_fps,
                fps=contract.fps,
                min_frames=contract.min_frames,
                max_frames=contract.max_frames,
            )
            source_fps = source_fps if source_fps > 0 else QWEN3_UNKNOWN_FPS
    if style in ("uniform", "nemotron_rounded"):
        prompt_timestamps = nemotron_prompt_timestamps(indices, source_fps)
    elif style == "qwen3_vl":
        prompt_timestamps = qwen3_prompt_timestamps(indices, source_fps, tps)
    else:
        prompt_timestamps = ()
    return FrameSample(
        style=style,
        indices=tuple(indices),
        timestamps_s=tuple(index / source_fps for index in indices),
        total_frames=total_frames,
        source_fps=float(source_fps),
        duration_s=float(duration_s),
        temporal_patch_size=tps,
        prompt_timestamps_s=prompt_timestamps,
        seconds_per_temporal_patch=seconds_per_patch,
    )


def presentation_timed(sample: FrameSample, pts_seconds: Sequence[float]) -> FrameSample:
    """``sample`` with the times its model is shown taken from each frame's presentation time.

    ``pts_seconds`` are the sampled frames' presentation times from the start of the video, in
    output order. The result counts time on a millisecond clock: ``source_fps`` is
    :data:`PRESENTATION_INDEX_FPS`, ``indices`` are ``round(pts * 1000)`` and ``total_frames`` the
    duration on that clock, so that the metadata vLLM's and transformers' processors receive (the
    ``fps`` and ``frames_indices`` of the video metadata) gives prompt timestamps equal to the
    presentation times, to the millisecond, through their own unchanged arithmetic.
    ``timestamps_s`` and ``prompt_timestamps_s`` are recomputed. The frames are the same: only
    their timing changes. Not for ``qwen2_vl``, whose prompt has no times.

    Raises:
        VideoSamplingError: a style without prompt times, or a count that does not match the sample.
    """
    if sample.style == "qwen2_vl":
        raise VideoSamplingError("presentation timestamps: style 'qwen2_vl' writes no times into the prompt")
    if len(pts_seconds) != len(sample.indices):
        raise VideoSamplingError(
            f"presentation timestamps: {len(pts_seconds)} times for {len(sample.indices)} sampled frames"
        )
    fps = PRESENTATION_INDEX_FPS
    indices = tuple(max(round(float(t) * fps), 0) for t in pts_seconds)
    if sample.style == "qwen3_vl":
        prompt = qwen3_prompt_timestamps(indices, fps, sample.temporal_patch_size)
    else:
        prompt = nemotron_prompt_timestamps(indices, fps)
    return FrameSample(
        style=sample.style,
        indices=indices,
        timestamps_s=tuple(index / fps for index in indices),
        total_frames=max(round(sample.duration_s * fps), max(indices) + 1),
        source_fps=fps,
        duration_s=sample.duration_s,
        temporal_patch_size=sample.temporal_patch_size,
        prompt_timestamps_s=prompt,
        seconds_per_temporal_patch=None,
    )
