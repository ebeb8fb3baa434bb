"""What a decode may be given and how much: the input types, their labels and :class:`DecodeLimits`."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["DEFAULT_LIMITS", "DecodeLimits", "VideoSource", "source_label"]

VideoSource = bytes | bytearray | memoryview | str | os.PathLike[str]
"""Encoded video: its bytes, or the path of a file."""


@dataclass(frozen=True)
class DecodeLimits:
    """Refusals that protect a server from hostile or oversized input.

    Each is checked before the work it bounds: the size before opening, the frame size before
    decoding (from the stream header), the frame count after the demux pass and before decoding.
    """

    max_input_bytes: int = 1 << 30
    """Largest encoded input, in bytes (default 1 GiB)."""
    max_frame_pixels: int = 7680 * 4320
    """Largest frame area, width times height in pixels (default 8K UHD, 33.2 million)."""
    max_frames: int = 500_000
    """Most frames a video may contain (default 500 000: 2.3 hours at 60 frames/s)."""
    timeout_s: float = 120.0
    """Wall-clock budget for one call, in seconds, checked between packets (default 120)."""

    def __post_init__(self) -> None:
        for name in ("max_input_bytes", "max_frame_pixels", "max_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeLimits.{name} must be a positive integer, got {value!r}")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"DecodeLimits.timeout_s must be a number of seconds >= 0, got {timeout!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, base: DecodeLimits | None = None) -> DecodeLimits:
        """Limits from a configuration mapping (e.g. the ``decode_limits`` key of vLLM's media-io
        ``"video"`` block): the given fields over ``base`` (``None``: the defaults).

        Raises:
            ValueError: an unknown key (named, with the known ones) or an invalid value.
        """
        if not isinstance(values, Mapping):
            raise ValueError(
                f"decode limits must be a mapping of field to value, got {type(values).__name__}"
            )
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown decode limits {unknown}; the limits are {sorted(known)}")
        return dataclasses.replace(base or cls(), **values)


DEFAULT_LIMITS: Final = DecodeLimits()


def source_label(source: VideoSource) -> str:
    """How errors name ``source``: its path, or ``"<bytes sha256:...>"`` (first 16 hex digits)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<bytes sha256:{hashlib.sha256(source).hexdigest()[:16]}>"
    return os.fspath(source)
