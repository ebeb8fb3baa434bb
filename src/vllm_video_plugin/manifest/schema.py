"""The manifest document: its schema, validated into a :class:`FrameManifest`.

The schema and its coverage rule are described in :mod:`vllm_video_plugin.manifest`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from vllm_video_plugin.errors import VideoGRPOError

__all__ = [
    "MANIFEST_FORMAT",
    "MILLISECOND_GRID_FPS",
    "FrameManifest",
    "ManifestError",
    "ManifestFrame",
    "parse_manifest",
]

MANIFEST_FORMAT: Final = "video_grpo.frames/v1"
"""Value of a manifest's ``format`` key."""
MILLISECOND_GRID_FPS: Final = 1000.0
"""Index rate, in indices per second, of a manifest that gives timestamps but no ``source_fps``."""
_TOP_KEYS: Final = frozenset({"format", "source_fps", "total_frames", "duration_s", "frames"})
_FRAME_KEYS: Final = frozenset({"path", "index", "timestamp_s"})
_MAX_FRAMES: Final = 2**31 - 1
"""Most source frames a manifest may describe (over 24 days on the millisecond grid), so source
indices are below it: the samplers, like vLLM's and transformers', hold frame indices in int32."""


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
            claim (see :mod:`vllm_video_plugin.manifest`), or, without ``source_fps``, a ``duration_s`` that
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


def _check_coverage(
    frames: Sequence[ManifestFrame], total_frames: int, fail: Callable[[str], ManifestError]
) -> None:
    """Refuse cached frames (sorted, indices unique) that leave more than their own spacing
    uncovered before the first or after the last, up to ``total_frames`` (see
    :mod:`vllm_video_plugin.manifest`)."""
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
