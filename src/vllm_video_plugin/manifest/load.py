"""Sampling a manifest with a contract and reading the frames it picks.

The contract runs over the source video's index space and each sampled index is served by the
nearest cached frame (see :mod:`vllm_video_plugin.manifest`).
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import os
import tarfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.decode import DEFAULT_LIMITS, DecodeLimits, source_label
from vllm_video_plugin.manifest.files import (
    BUNDLE_MANIFEST_NAME,
    MEDIA_ROOT_ENV,
    FrameReader,
    decode_image,
    directory_reader,
    sniff_media,
    tar_reader,
    zip_reader,
)
from vllm_video_plugin.manifest.schema import FrameManifest, ManifestError, parse_manifest
from vllm_video_plugin.sampling import (
    FrameSample,
    nemotron_prompt_timestamps,
    qwen2_5_seconds_per_temporal_patch,
    qwen3_prompt_timestamps,
    sample_frames,
)

__all__ = ["ManifestFrames", "load_manifest_frames"]


@dataclass(frozen=True, eq=False)
class ManifestFrames:
    """The frames a contract picked from a manifest."""

    data: NDArray[np.uint8]
    """RGB frames, ``(N, height, width, 3)`` uint8."""
    sample: FrameSample
    """What the contract sampled, re-timed to the cached frames that serve it: ``indices`` are the
    source indices of the rows of :attr:`data`."""
    requested_indices: tuple[int, ...]
    """Source indices the contract asked for; equal to ``sample.indices`` when every one is cached."""
    manifest: FrameManifest


def load_manifest_frames(
    data: bytes | bytearray | memoryview,
    contract: VideoSamplingContract,
    *,
    media_root: str | os.PathLike[str] | None,
    limits: DecodeLimits = DEFAULT_LIMITS,
) -> ManifestFrames:
    """Sample a manifest or bundle with ``contract`` and read the frames it picks.

    Args:
        data: a JSON manifest, or a zip or tar bundle (see :func:`sniff_media`).
        contract: the sampling contract, applied over the source video's index space.
        media_root: directory the frame paths of a JSON manifest are confined to; ``None`` means
            none is configured, which only bundles accept.
        limits: ``max_input_bytes`` bounds ``data`` plus the frame bytes read (uncompressed, for a
            bundle), ``max_frame_pixels`` each frame's area.

    Raises:
        ManifestError: as :func:`parse_manifest`; a path that is absolute outside the root,
            contains ``..``, escapes it through a symlink, or is missing; no media root for a JSON
            manifest; a bundle without ``manifest.json``; an unreadable or oversized image; frames
            of different shapes. The message names the manifest, the frame file and the reason.
        VideoSamplingError: the contract's style cannot sample the source (e.g. ``qwen2_vl`` on a
            source shorter than one temporal patch).
    """
    label = source_label(data)
    if len(data) > limits.max_input_bytes:
        raise ManifestError(label, f"is {len(data)} bytes, over the limit of {limits.max_input_bytes} bytes")
    kind = sniff_media(data)
    if kind == "manifest":
        if media_root is None:
            raise ManifestError(
                label,
                f"frame files of a JSON manifest need a media root: set {MEDIA_ROOT_ENV} or the video "
                "loader's media_root option (or send a zip/tar bundle instead)",
            )
        manifest = parse_manifest(data, source=label)
        read = directory_reader(Path(media_root), label)
        return _pick(manifest, contract, read, label, limits.max_input_bytes - len(data), limits)
    if kind == "zip":
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as bundle:
                return _pick_from_bundle(zip_reader(bundle, label), contract, label, len(data), limits)
        except zipfile.BadZipFile as error:
            raise ManifestError(label, f"not a readable zip bundle ({error})") from error
    if kind == "tar":
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as bundle:
                return _pick_from_bundle(tar_reader(bundle, label), contract, label, len(data), limits)
        except tarfile.TarError as error:
            raise ManifestError(label, f"not a readable tar bundle ({error})") from error
    raise ManifestError(label, "not a frame manifest or bundle (it looks like an encoded video)")


def _pick_from_bundle(
    read: FrameReader, contract: VideoSamplingContract, label: str, size: int, limits: DecodeLimits
) -> ManifestFrames:
    budget = limits.max_input_bytes - size
    text = read(BUNDLE_MANIFEST_NAME, budget)
    manifest = parse_manifest(text, source=label)
    return _pick(manifest, contract, read, label, budget - len(text), limits)


def _pick(
    manifest: FrameManifest,
    contract: VideoSamplingContract,
    read: FrameReader,
    label: str,
    budget: int,
    limits: DecodeLimits,
) -> ManifestFrames:
    if manifest.frame_rate_known:
        requested = sample_frames(manifest.total_frames, manifest.source_fps, manifest.duration_s, contract)
        cached = [frame.index for frame in manifest.frames]
        chosen = [manifest.frames[_nearest(cached, index)] for index in requested.indices]
    else:
        # The listed frames are the video: sample positions at their mean rate.
        count = len(manifest.frames)
        mean_fps = count / manifest.duration_s
        by_position = sample_frames(count, mean_fps, manifest.duration_s, contract)
        chosen = [manifest.frames[position] for position in by_position.indices]
        requested = dataclasses.replace(
            by_position,
            indices=tuple(frame.index for frame in chosen),
            source_fps=manifest.source_fps,
            total_frames=manifest.total_frames,
        )
    images: dict[int, NDArray[np.uint8]] = {}
    for frame in chosen:
        if frame.index in images:
            continue
        raw = read(frame.path, budget)
        budget -= len(raw)
        images[frame.index] = decode_image(raw, f"{label} frame {frame.path}", limits)
    first = chosen[0]
    shape = images[first.index].shape
    for frame in chosen:
        if images[frame.index].shape != shape:
            height, width = images[frame.index].shape[:2]
            raise ManifestError(
                f"{label} frame {frame.path}",
                f"is {width}x{height}, frame {first.path} is {shape[1]}x{shape[0]}; all frames must "
                "have one size",
            )
    data = np.stack([images[frame.index] for frame in chosen])
    indices = [frame.index for frame in chosen]
    return ManifestFrames(
        data=data,
        sample=_retime(requested, indices, force=not manifest.frame_rate_known),
        requested_indices=requested.indices,
        manifest=manifest,
    )


def _nearest(sorted_indices: Sequence[int], index: int) -> int:
    """Position of the value nearest ``index`` in ``sorted_indices`` (the lower one on a tie)."""
    position = bisect.bisect_left(sorted_indices, index)
    if position == 0:
        return 0
    if position == len(sorted_indices):
        return position - 1
    before, after = sorted_indices[position - 1], sorted_indices[position]
    return position - 1 if index - before <= after - index else position


def _retime(sample: FrameSample, indices: Sequence[int], *, force: bool = False) -> FrameSample:
    """``sample`` with its frames at ``indices`` (of ``sample.source_fps``), timing recomputed as
    the processors compute it; unchanged when the indices are (unless ``force``)."""
    if tuple(indices) == sample.indices and not force:
        return sample
    fps = sample.source_fps
    if sample.style == "qwen3_vl":
        prompt = qwen3_prompt_timestamps(indices, fps, sample.temporal_patch_size)
    elif sample.style == "qwen2_vl":
        prompt = ()
    else:
        prompt = nemotron_prompt_timestamps(indices, fps)
    seconds_per_patch = sample.seconds_per_temporal_patch
    if seconds_per_patch is not None:
        seconds_per_patch = qwen2_5_seconds_per_temporal_patch(
            len(indices), sample.total_frames, fps, sample.temporal_patch_size
        )
    return dataclasses.replace(
        sample,
        indices=tuple(indices),
        timestamps_s=tuple(index / fps for index in indices),
        prompt_timestamps_s=prompt,
        seconds_per_temporal_patch=seconds_per_patch,
    )
