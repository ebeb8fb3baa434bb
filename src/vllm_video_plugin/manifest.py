"""Cached-frame manifests: videos whose frames are already image files, with their real timing.

A manifest is a JSON document listing frame files and where each frame sits in its source video.
The sampling contract is applied over the **source** video's index space (its frame count, rate
and duration, as the manifest states them), and each sampled index is served by the cached frame
nearest to it; a manifest that caches every frame the contract samples therefore yields exactly
the frames, indices and timestamps that decoding the source video would.

Schema (version 1; unknown keys are rejected)::

    {
      "format": "video_grpo.frames/v1",   # required marker
      "source_fps": 30.0,       # frame rate of the source video, frames/s (optional, see below)
      "total_frames": 900,      # frames in the source video (optional: last frame index + 1)
      "duration_s": 30.0,       # source duration, seconds (optional: total_frames / source_fps)
      "frames": [               # at least one; any order; one shape for all
        {"path": "clip/000000.png", "index": 0},          # source frame index...
        {"path": "clip/000015.png", "timestamp_s": 0.5}   # ...or presentation time, seconds
      ]
    }

A frame gives ``index`` (its source frame index) or ``timestamp_s`` (its presentation time; the
index is ``round(timestamp_s * source_fps)``).

With ``source_fps`` the cached frames must cover the source the manifest claims: the cache may be
sparse (every 15th frame, say), but no more than its own spacing (the widest gap between two
consecutive cached frames; 1 for a single frame) may lie before its first frame or after its last
one, up to ``total_frames``. A manifest whose frame count disagrees with its entries (one cached
frame claiming ``total_frames=100000``, or the first 20 frames of a 100-frame source) is refused:
every index the contract samples past the cached frames would be served by the same cached frame,
one frame repeated in place of frames the manifest does not hold.

Without ``source_fps`` every frame must give ``timestamp_s``, and the listed frames are taken to be
the whole video (a variable-rate video, or frames extracted at irregular times): the contract
samples them by position, like a decoder samples a video's frames, at their mean rate
(``len(frames) / duration_s``). Their indices are then reported on a millisecond grid
(``fps`` 1000, index ``round(timestamp_s * 1000)``), which carries the irregular timing exactly
into Nemotron's and Qwen3-VL's prompt timestamps.

Where the frame files are. vLLM hands a video loader the bytes of the media only, never its URL, so
paths cannot be relative to the manifest's own location:

- a plain JSON manifest names files relative to a **media root** (or absolute paths inside it),
  configured by the server (the loader's ``media_root`` option or :data:`MEDIA_ROOT_ENV`). Every
  path must resolve, symlinks followed, to a file inside the root; ``..`` components are refused;
- a **bundle** is one self-contained file: a zip or an uncompressed tar holding ``manifest.json``
  and the frame files it names (paths relative to the bundle; regular members only). It needs no
  media root, and works over ``file://``, ``data:`` and ``http(s)://`` URLs alike.

Frame files are PNG, JPEG, WebP or BMP images, decoded with Pillow (as vLLM decodes images) to
RGB. Only the frames the contract picks are read. This module does not import vLLM.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import json
import math
import os
import posixpath
import tarfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final, Literal

import numpy as np
from numpy.typing import NDArray
from PIL import Image, UnidentifiedImageError

from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.decode import DEFAULT_LIMITS, DecodeLimits, source_label
from vllm_video_plugin.errors import VideoGRPOError
from vllm_video_plugin.sampling import (
    FrameSample,
    nemotron_prompt_timestamps,
    qwen2_5_seconds_per_temporal_patch,
    qwen3_prompt_timestamps,
    sample_frames,
)

__all__ = [
    "BUNDLE_MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "MEDIA_ROOT_ENV",
    "MILLISECOND_GRID_FPS",
    "FrameManifest",
    "ManifestError",
    "ManifestFrame",
    "ManifestFrames",
    "MediaKind",
    "load_manifest_frames",
    "parse_manifest",
    "sniff_media",
]

MANIFEST_FORMAT: Final = "video_grpo.frames/v1"
"""Value of a manifest's ``format`` key."""
BUNDLE_MANIFEST_NAME: Final = "manifest.json"
"""Name of the manifest inside a zip or tar bundle."""
MEDIA_ROOT_ENV: Final = "VIDEO_GRPO_MEDIA_ROOT"
"""Environment variable naming the directory that manifest frame paths are confined to."""
MILLISECOND_GRID_FPS: Final = 1000.0
"""Index rate, in indices per second, of a manifest that gives timestamps but no ``source_fps``."""

_IMAGE_FORMATS: Final = ("PNG", "JPEG", "WEBP", "BMP")
_TOP_KEYS: Final = frozenset({"format", "source_fps", "total_frames", "duration_s", "frames"})
_FRAME_KEYS: Final = frozenset({"path", "index", "timestamp_s"})
_TAR_MAGIC_OFFSET: Final = 257
_MAX_FRAMES: Final = 2**31 - 1
"""Most source frames a manifest may describe (over 24 days on the millisecond grid), so source
indices are below it: the samplers, like vLLM's and transformers', hold frame indices in int32."""

MediaKind = Literal["manifest", "zip", "tar", "video"]
"""What a media payload is: a JSON manifest, a zip or tar bundle, or anything else (a video)."""


class ManifestError(VideoGRPOError, ValueError):
    """A manifest or bundle is malformed, names a file it may not read, or a frame cannot be read.

    ``source`` names the manifest (``"<bytes sha256:...>"``, or a path) and, where one is at fault,
    the frame file; ``reason`` says what is wrong.
    """

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason

    def __reduce__(self) -> tuple[type[ManifestError], tuple[str, str]]:
        return (type(self), (self.source, self.reason))


@dataclass(frozen=True)
class ManifestFrame:
    """One cached frame."""

    index: int
    """Source frame index (on the millisecond grid for a manifest without ``source_fps``)."""
    path: str
    """The file as the manifest names it."""


@dataclass(frozen=True)
class FrameManifest:
    """A validated manifest: the source video's geometry in time and its cached frames."""

    source_fps: float
    """Frame rate of the source in frames per second (:data:`MILLISECOND_GRID_FPS` when the
    manifest gives none); the ``fps`` of vLLM's video metadata."""
    frame_rate_known: bool
    """Whether the manifest gave ``source_fps``. When not, the listed frames are the whole video
    and are sampled by position; indices are on the millisecond grid."""
    total_frames: int
    """Frames in the source (indices on the millisecond grid when ``source_fps`` was absent)."""
    duration_s: float
    """Duration of the source in seconds."""
    frames: tuple[ManifestFrame, ...]
    """Cached frames in increasing index order, indices unique."""


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


def sniff_media(data: bytes | bytearray | memoryview) -> MediaKind:
    """Tell a manifest, a zip bundle, a tar bundle and anything else (a video) apart by content."""
    head = bytes(data[:512])
    if head.lstrip()[:1] == b"{":
        return "manifest"
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[_TAR_MAGIC_OFFSET : _TAR_MAGIC_OFFSET + 5] == b"ustar":
        return "tar"
    return "video"


def parse_manifest(text: str | bytes | bytearray | memoryview, *, source: str) -> FrameManifest:
    """Validate a manifest document (JSON text) and resolve every frame's source index.

    Args:
        text: the manifest JSON.
        source: how errors name the manifest (a path or ``"<bytes sha256:...>"``).

    Raises:
        ManifestError: not JSON (or nested too deeply to parse), not a version-1 manifest, unknown
            or missing keys, wrong types, numbers out of range (``total_frames`` over 2**31 - 1, a
            frame's index, given or from ``timestamp_s``, over 2**31 - 2), a frame with both or
            neither of ``index`` and ``timestamp_s``, two frames at one index, an index beyond
            ``total_frames``, with ``source_fps`` cached frames that do not cover the source they
            claim (see the module docstring), or, without ``source_fps``, a ``duration_s`` that
            gives no finite mean frame rate (zero, or tiny).
    """
    try:
        document = json.loads(bytes(text) if not isinstance(text, str) else text)
    except ValueError as error:  # not UTF-8, a syntax error, or an integer too long to convert
        raise ManifestError(source, f"not valid JSON ({error})") from error
    except RecursionError as error:
        raise ManifestError(source, "not a manifest: the JSON is nested too deeply to parse") from error
    if not isinstance(document, dict):
        raise ManifestError(source, f"a manifest is a JSON object, got {type(document).__name__}")
    fail = _failer(source)
    unknown = sorted(set(document) - _TOP_KEYS)
    if unknown:
        raise fail(f"unknown keys {unknown}; a manifest has {sorted(_TOP_KEYS)}")
    if document.get("format") != MANIFEST_FORMAT:
        raise fail(f"format is {document.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    source_fps = _optional_number(document, "source_fps", fail, positive=True)
    total_frames = _optional_int(document, "total_frames", fail, minimum=1, maximum=_MAX_FRAMES)
    duration_s = _optional_number(document, "duration_s", fail, positive=False)
    raw_frames = document.get("frames")
    if not isinstance(raw_frames, list) or not raw_frames:
        raise fail("frames must be a non-empty list")

    rate = source_fps if source_fps is not None else MILLISECOND_GRID_FPS
    frames: dict[int, ManifestFrame] = {}
    for position, entry in enumerate(raw_frames):
        where = f"frames[{position}]"
        if not isinstance(entry, dict):
            raise fail(f"{where} must be an object with path and index or timestamp_s")
        unknown = sorted(set(entry) - _FRAME_KEYS)
        if unknown:
            raise fail(f"{where} has unknown keys {unknown}; a frame has {sorted(_FRAME_KEYS)}")
        path = entry.get("path")
        if not isinstance(path, str) or not path:
            raise fail(f"{where}.path must be a non-empty string")
        if ("index" in entry) == ("timestamp_s" in entry):
            raise fail(f"{where} ({path}) needs exactly one of index and timestamp_s")
        if "index" in entry:
            if source_fps is None:
                raise fail(f"{where} ({path}) gives an index, which needs the manifest's source_fps")
            index = _optional_int(entry, "index", fail, minimum=0, maximum=_MAX_FRAMES - 1, where=where)
        else:
            seconds = _optional_number(entry, "timestamp_s", fail, positive=False, where=where)
            assert seconds is not None
            exact_index = seconds * rate
            index = round(exact_index) if math.isfinite(exact_index) else None
            if index is None or index >= _MAX_FRAMES:
                raise fail(
                    f"{where} ({path}) timestamp_s={seconds!r} is out of range: at {rate!r} frames/s it "
                    f"is past the last source index a manifest may have, {_MAX_FRAMES - 1}"
                )
        assert index is not None
        if index in frames:
            raise fail(f"{where} ({path}) and {frames[index].path} are both at source index {index}")
        frames[index] = ManifestFrame(index=index, path=path)

    ordered = tuple(frames[index] for index in sorted(frames))
    last = ordered[-1].index
    if total_frames is None:
        total_frames = last + 1
    elif last >= total_frames:
        raise fail(f"frame {ordered[-1].path} is at source index {last}, beyond total_frames={total_frames}")
    if source_fps is not None:
        _check_coverage(ordered, total_frames, fail)
    if duration_s is None:
        duration_s = total_frames / rate
        if not math.isfinite(duration_s):
            raise fail(f"total_frames={total_frames} / source_fps={rate!r} overflows; give duration_s")
    elif source_fps is None and (duration_s == 0 or not math.isfinite(len(ordered) / duration_s)):
        raise fail(
            f"duration_s={duration_s!r} gives no finite mean frame rate (len(frames) / duration_s), "
            "which is what a manifest without source_fps is sampled at"
        )
    return FrameManifest(
        source_fps=rate,
        frame_rate_known=source_fps is not None,
        total_frames=total_frames,
        duration_s=duration_s,
        frames=ordered,
    )


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
        read = _directory_reader(Path(media_root), label)
        return _pick(manifest, contract, read, label, limits.max_input_bytes - len(data), limits)
    if kind == "zip":
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as bundle:
                return _pick_from_bundle(_zip_reader(bundle, label), contract, label, len(data), limits)
        except zipfile.BadZipFile as error:
            raise ManifestError(label, f"not a readable zip bundle ({error})") from error
    if kind == "tar":
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as bundle:
                return _pick_from_bundle(_tar_reader(bundle, label), contract, label, len(data), limits)
        except tarfile.TarError as error:
            raise ManifestError(label, f"not a readable tar bundle ({error})") from error
    raise ManifestError(label, "not a frame manifest or bundle (it looks like an encoded video)")


def _check_coverage(
    frames: Sequence[ManifestFrame], total_frames: int, fail: Callable[[str], ManifestError]
) -> None:
    """Refuse cached frames (sorted, indices unique) that leave more than their own spacing
    uncovered before the first or after the last, up to ``total_frames`` (the module docstring)."""
    indices = [frame.index for frame in frames]
    spacing = max((after - before for before, after in zip(indices, indices[1:], strict=False)), default=1)
    first, last = frames[0], frames[-1]
    apart = f"the cached frames lie at most {spacing} apart" if len(frames) > 1 else "it caches one frame"
    if first.index >= spacing:
        raise fail(
            f"its first cached frame {first.path} is at source index {first.index} and {apart}: source "
            f"frames 0-{first.index - 1} have no cached frame near them (number the frames from the "
            "source's first frame, or cache its start)"
        )
    if total_frames - 1 - last.index >= spacing:
        raise fail(
            f"total_frames={total_frames}, but its last cached frame {last.path} is at source index "
            f"{last.index} and {apart}: source frames {last.index + 1}-{total_frames - 1} have no cached "
            "frame near them (give the source's real total_frames, or cache frames up to its end)"
        )


# -- selection --------------------------------------------------------------------------------------

_Reader = Callable[[str, int], bytes]
"""Reads a frame file by its manifest path, refusing more than the given number of bytes."""


def _pick_from_bundle(
    read: _Reader, contract: VideoSamplingContract, label: str, size: int, limits: DecodeLimits
) -> ManifestFrames:
    budget = limits.max_input_bytes - size
    text = read(BUNDLE_MANIFEST_NAME, budget)
    manifest = parse_manifest(text, source=label)
    return _pick(manifest, contract, read, label, budget - len(text), limits)


def _pick(
    manifest: FrameManifest,
    contract: VideoSamplingContract,
    read: _Reader,
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
        images[frame.index] = _decode_image(raw, f"{label} frame {frame.path}", limits)
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


# -- reading frame files ----------------------------------------------------------------------------


def _decode_image(raw: bytes, where: str, limits: DecodeLimits) -> NDArray[np.uint8]:
    try:
        with Image.open(io.BytesIO(raw), formats=_IMAGE_FORMATS) as image:
            width, height = image.size
            if width * height > limits.max_frame_pixels:
                raise ManifestError(
                    where,
                    f"is {width}x{height} ({width * height} pixels), over the limit of "
                    f"{limits.max_frame_pixels} pixels",
                )
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as error:
        raise ManifestError(where, f"not a readable {'/'.join(_IMAGE_FORMATS)} image ({error})") from error


def _check_relative(path: str, where: str) -> PurePosixPath:
    """``path`` as a relative POSIX path without ``..``, or a :class:`ManifestError`."""
    pure = PurePosixPath(path)
    if "\\" in path or "\0" in path:
        raise ManifestError(where, "backslashes and NUL characters are not allowed in frame paths")
    if ".." in pure.parts:
        raise ManifestError(where, "'..' is not allowed in frame paths")
    return pure


def _directory_reader(media_root: Path, label: str) -> _Reader:
    try:
        root = media_root.resolve(strict=True)
    except OSError as error:
        raise ManifestError(label, f"the media root {media_root} does not exist ({error})") from error
    if not root.is_dir():
        raise ManifestError(label, f"the media root {media_root} is not a directory")

    def read(path: str, max_bytes: int) -> bytes:
        where = f"{label} frame {path}"
        candidate = Path(_check_relative(path, where))
        if not candidate.is_absolute():
            candidate = root / candidate
        try:
            resolved = candidate.resolve(strict=True)
        except OSError as error:
            raise ManifestError(where, f"no such file under the media root {root} ({error})") from error
        if not resolved.is_relative_to(root):
            raise ManifestError(where, f"resolves to {resolved}, outside the media root {root}")
        if not resolved.is_file():
            raise ManifestError(where, f"{resolved} is not a regular file")
        size = resolved.stat().st_size
        if size > max_bytes:
            raise ManifestError(where, f"is {size} bytes, over the {max_bytes} bytes left of the read limit")
        return resolved.read_bytes()

    return read


def _bundle_name(path: str, where: str) -> str:
    pure = _check_relative(path, where)
    if pure.is_absolute():
        raise ManifestError(where, "paths inside a bundle must be relative")
    return posixpath.normpath(str(pure))


def _zip_reader(bundle: zipfile.ZipFile, label: str) -> _Reader:
    members = {posixpath.normpath(info.filename): info for info in bundle.infolist() if not info.is_dir()}

    def read(path: str, max_bytes: int) -> bytes:
        where = f"{label} member {path}"
        info = members.get(_bundle_name(path, where))
        if info is None:
            raise ManifestError(where, "is not in the zip bundle")
        if info.file_size > max_bytes:
            raise ManifestError(
                where, f"is {info.file_size} bytes, over the {max_bytes} bytes left of the read limit"
            )
        with bundle.open(info) as member:
            raw = member.read(max_bytes + 1)
        if len(raw) > max_bytes:  # the header under-reported the size
            raise ManifestError(where, f"holds more than the {max_bytes} bytes left of the read limit")
        return raw

    return read


def _tar_reader(bundle: tarfile.TarFile, label: str) -> _Reader:
    members = {posixpath.normpath(info.name): info for info in bundle.getmembers()}

    def read(path: str, max_bytes: int) -> bytes:
        where = f"{label} member {path}"
        info = members.get(_bundle_name(path, where))
        if info is None:
            raise ManifestError(where, "is not in the tar bundle")
        if not info.isfile():
            raise ManifestError(where, "is not a regular file (links are not followed in bundles)")
        if info.size > max_bytes:
            raise ManifestError(
                where, f"is {info.size} bytes, over the {max_bytes} bytes left of the read limit"
            )
        member = bundle.extractfile(info)
        assert member is not None  # regular files always extract
        with member:
            return member.read()

    return read


# -- validation helpers -----------------------------------------------------------------------------


def _failer(source: str) -> Callable[[str], ManifestError]:
    return lambda reason: ManifestError(source, reason)


def _optional_number(
    document: dict[str, object],
    key: str,
    fail: Callable[[str], ManifestError],
    *,
    positive: bool,
    where: str = "",
) -> float | None:
    value = document.get(key)
    if value is None:
        return None
    name = f"{where}.{key}" if where else key
    number = _finite_float(value)
    if number is None:
        raise fail(f"{name} must be a finite number, got {_short_repr(value)}")
    if number < 0 or (positive and number == 0):
        raise fail(f"{name} must be {'positive' if positive else 'non-negative'}, got {_short_repr(value)}")
    return number


def _optional_int(
    document: dict[str, object],
    key: str,
    fail: Callable[[str], ManifestError],
    *,
    minimum: int,
    maximum: int,
    where: str = "",
) -> int | None:
    value = document.get(key)
    if value is None:
        return None
    name = f"{where}.{key}" if where else key
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(f"{name} must be an integer >= {minimum}, got {_short_repr(value)}")
    if value > maximum:
        raise fail(f"{name} must be at most {maximum}, got {_short_repr(value)}")
    return value


def _finite_float(value: object) -> float | None:
    """``value`` as a finite float; ``None`` for a bool, a non-number, a NaN or infinity, or an integer
    beyond the float range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _short_repr(value: object, max_chars: int = 60) -> str:
    """``repr(value)`` cut for an error message (a JSON integer may have thousands of digits)."""
    text = repr(value)
    return text if len(text) <= max_chars else f"{text[: max_chars - 3]}..."
