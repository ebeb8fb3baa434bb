"""The vLLM video loader of this package, registered as :data:`~vllm_video_plugin.contract.VIDEO_LOADER_NAME`.

Select it with the contract's media-io block, server-wide or (with ``--trust-request-mm-kwargs``)
per request::

    --media-io-kwargs '{"video": <VideoSamplingContract.to_media_io_kwargs() as JSON>}'

vLLM calls :meth:`VideoGRPOLoader.load_bytes` with the media's bytes and the block's keys (minus
``video_backend``). The bytes are sniffed (:func:`~vllm_video_plugin.manifest.sniff_media`):

- an encoded video is decoded by :func:`~vllm_video_plugin.decode.decode_frames` through the
  process-wide decode cache (:func:`~vllm_video_plugin.cache.shared_decode_cache`), so the G
  requests of a GRPO group decode once;
- a JSON frame manifest or a zip/tar bundle is sampled and read by
  :func:`~vllm_video_plugin.manifest.load_manifest_frames` (not cached: a manifest's files can
  change under the same manifest bytes).

Besides the contract's fields the block may hold ``decode_limits``, resource bounds per video
(the fields of :class:`~vllm_video_plugin.decode.DecodeLimits`: ``max_input_bytes``,
``max_frame_pixels``, ``max_frames``, ``timeout_s``; unset ones keep their defaults), e.g.::

    --media-io-kwargs '{"video": {..., "decode_limits": {"max_input_bytes": 268435456, "timeout_s": 30}}}'

A request over a limit is answered HTTP 400 naming the limit. Per-request media-io kwargs (only
with ``--trust-request-mm-kwargs``) can change the limits too: a server that trusts request
kwargs trusts its clients with its resources.

The block may also hold ``media_root``, the directory JSON manifests'
frame paths are confined to. The environment variable
:data:`~vllm_video_plugin.manifest.MEDIA_ROOT_ENV` sets it too; when both are set, ``media_root``
may only narrow the environment's root (per-request media-io kwargs can set it, so the
environment variable is what bounds a server that trusts request kwargs).

The returned metadata holds exactly the keys vLLM's own loaders return (``total_num_frames``,
``fps``, ``duration``, ``video_backend``, ``frames_indices``, ``do_sample_frames``): Qwen2-VL,
Qwen2.5-VL and Qwen3-VL build ``transformers.VideoMetadata`` from all of them but
``do_sample_frames`` and fail on any other key; Nemotron Nano VL reads ``fps`` and
``frames_indices`` and ignores the rest. ``do_sample_frames`` is always false: the frames are the
contract's sample, final, as the trainer's processors take them. (vLLM's own loaders set it when
they return every frame, and Qwen3-VL's processor then samples again by its own rule: a ``uniform``
contract taking all 16 frames of a clip was served as 4.)

The loader cannot tell which model it serves (vLLM hands it the media's bytes and the block's keys),
so what the model's processor reads besides the frames is stated in the block, written for the
model (:func:`vllm_video_plugin.geometry.fit_contract`): with ``keep_video_bytes: true`` an encoded
video's metadata also holds ``original_video_bytes``, the input itself, as vLLM's ``nemotron_vl``
loader returns it. With ``use_audio_in_video`` set server-wide (``--mm-processor-kwargs``), vLLM's
Nemotron Omni processor decodes the video's audio track from those bytes (``load_audio_pyav``) and
fails the request without them; Qwen's ``VideoMetadata`` fails with them. Unset, the bytes do not
travel, whatever the style (the style says how frames are chosen, not which model reads them). The
bytes are the input the loader already accepted under ``max_input_bytes``, so they are bounded by
it; frame manifests and bundles carry none (their frames have no audio track). The ``video_grpo``
model loader checks a server-wide block against the checkpoint at start-up.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from vllm.multimodal.video import VideoLoader

from vllm_video_plugin.cache import shared_decode_cache
from vllm_video_plugin.contract import (
    KEEP_VIDEO_BYTES_OPTION,
    VIDEO_BYTES_KEY,
    VIDEO_LOADER_NAME,
    VideoSamplingContract,
)
from vllm_video_plugin.decode import DecodeLimits, source_label
from vllm_video_plugin.errors import VideoDecodeError
from vllm_video_plugin.manifest import MEDIA_ROOT_ENV, ManifestError, load_manifest_frames, sniff_media
from vllm_video_plugin.sampling import FrameSample

__all__ = [
    "DECODE_LIMITS_OPTION",
    "KEEP_VIDEO_BYTES_OPTION",
    "VIDEO_BYTES_KEY",
    "MEDIA_ROOT_OPTION",
    "VideoGRPOLoader",
    "hf_video_metadata",
    "resolve_media_root",
]

MEDIA_ROOT_OPTION = "media_root"
"""Key of the media-io ``"video"`` block naming the manifests' media root."""
DECODE_LIMITS_OPTION = "decode_limits"
"""Key of the media-io ``"video"`` block holding :class:`~vllm_video_plugin.decode.DecodeLimits` fields."""


def _keeps_video_bytes(option: Any) -> bool:
    """Whether an encoded video's metadata carries its bytes: the block's ``keep_video_bytes``,
    false when unset (see the module docstring).

    Raises:
        ValueError: ``option`` is not a boolean or ``None``.
    """
    if option is not None and not isinstance(option, bool):
        raise ValueError(f"{KEEP_VIDEO_BYTES_OPTION}={option!r} is not a boolean")
    return bool(option)


def resolve_media_root(option: str | os.PathLike[str] | None) -> Path | None:
    """The media root for JSON manifests: ``option`` (the block's ``media_root``) or
    ``$VIDEO_GRPO_MEDIA_ROOT``; ``None`` when neither is set.

    Raises:
        ManifestError: both are set and ``option`` resolves outside the environment's root.
    """
    env = os.environ.get(MEDIA_ROOT_ENV) or None
    if option is None:
        return Path(env) if env is not None else None
    root = Path(option)
    if env is not None and not root.resolve().is_relative_to(Path(env).resolve()):
        raise ManifestError(
            f"{MEDIA_ROOT_OPTION}={str(option)!r}",
            f"is outside {MEDIA_ROOT_ENV}={env!r}; the option may only narrow the environment's root",
        )
    return root


def hf_video_metadata(sample: FrameSample) -> dict[str, Any]:
    """vLLM's video metadata for frames sampled as ``sample`` (see the module docstring).

    ``do_sample_frames`` is false: the frames are final, and no processor samples them again.
    """
    return {
        "total_num_frames": sample.total_frames,
        "fps": sample.source_fps,
        "duration": sample.duration_s,
        "video_backend": VIDEO_LOADER_NAME,
        "frames_indices": list(sample.indices),
        "do_sample_frames": False,
    }


class VideoGRPOLoader(VideoLoader):
    """Contract-driven loader for encoded videos, frame manifests and frame bundles."""

    @classmethod
    def load_bytes(
        cls,
        data: bytes,
        num_frames: int = -1,
        media_root: str | None = None,
        decode_limits: dict[str, Any] | None = None,
        keep_video_bytes: bool | None = None,
        **kwargs: Any,
    ) -> tuple[NDArray[np.uint8], dict[str, Any]]:
        """Frames and metadata of one video.

        Args:
            data: an encoded video, a JSON frame manifest, or a zip/tar frame bundle.
            num_frames: the block's ``num_frames`` (``-1``: not set), as vLLM passes it.
            media_root: directory JSON manifests' frame paths are confined to (see
                :func:`resolve_media_root`).
            decode_limits: :class:`~vllm_video_plugin.decode.DecodeLimits` fields (``None``: the
                defaults); ``max_input_bytes`` also bounds a manifest or bundle plus its frames.
            keep_video_bytes: whether an encoded video's metadata carries ``data`` as
                :data:`VIDEO_BYTES_KEY`; ``None``: it does not.
            **kwargs: the other keys of the media-io ``"video"`` block: the contract's fields.

        Returns:
            ``(frames, metadata)``: read-only RGB frames ``(N, H, W, 3)`` uint8 (shared with the
            decode cache) and :func:`hf_video_metadata` (plus :data:`VIDEO_BYTES_KEY` as above).

        Raises:
            ValueError: an invalid contract, decode limit (unknown key named) or
                ``keep_video_bytes``, or
                :class:`~vllm_video_plugin.errors.VideoDecodeError`,
                :class:`~vllm_video_plugin.errors.VideoSamplingError`,
                :class:`~vllm_video_plugin.manifest.ManifestError` (all ``ValueError``: vLLM
                answers the request with HTTP 400).
        """
        contract = VideoSamplingContract.from_media_io_kwargs({"num_frames": num_frames, **kwargs})
        limits = DecodeLimits.from_mapping(decode_limits or {})
        keep_bytes = _keeps_video_bytes(keep_video_bytes)
        if sniff_media(data) == "video":
            if len(data) > limits.max_input_bytes:
                # Checked before the cache too: a cached decode skips the decoder's own checks.
                raise VideoDecodeError(
                    source_label(data),
                    f"the input is {len(data)} bytes, over the limit of {limits.max_input_bytes} bytes",
                )
            batch = shared_decode_cache().get_or_decode(data, contract, limits=limits)
            assert batch.sample is not None  # decoded by contract
            metadata = hf_video_metadata(batch.sample)
            if keep_bytes:
                metadata[VIDEO_BYTES_KEY] = data  # within max_input_bytes, checked above
            return batch.data, metadata
        frames = load_manifest_frames(
            data, contract, media_root=resolve_media_root(media_root), limits=limits
        )
        frames.data.flags.writeable = False
        return frames.data, hf_video_metadata(frames.sample)
