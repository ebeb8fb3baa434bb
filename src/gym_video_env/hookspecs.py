"""Hook specifications of ``gym_video_env``: how media in Gym requests are converted, moved and checked.

Implementations are modules (or objects) registered through the ``gym_video_env.media_handlers``
entry-point group (see :mod:`gym_video_env.plugins`). The built-in handlers are registered the same
way, at ``trylast``, so an installed plugin gets the first say. An implementation may accept any
subset of a spec's arguments.

Parts and items are the JSON dicts of the OpenAI Responses API as Gym receives them (before Gym's
own validation, so extra keys such as ``path`` are still present). A caller runs
:func:`validate_media` on a part before :func:`convert_media_part`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pluggy

__all__ = [
    "PROJECT_NAME",
    "MediaError",
    "MediaSettings",
    "convert_media_part",
    "hookimpl",
    "hookspec",
    "relocate_tool_output_media",
    "validate_media",
]

#: The pluggy project name; hook implementations must use :data:`hookimpl` from this module.
PROJECT_NAME = "gym_video_env"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True)
class MediaSettings:
    """Where local media may come from and how large media may be. Passed to every hook."""

    media_root: Path | None = None
    """Directory that every local media file (a ``path``, a ``file://`` URL, a frame manifest)
    must resolve into, symlinks followed. ``None``: local files are rejected."""
    max_video_bytes: int | None = None
    """Largest video file or inline (``data:``) video payload, in bytes. ``None``: no limit."""
    max_image_bytes: int | None = None
    """Largest image file or inline (``data:``) image payload, in bytes. ``None``: no limit."""
    allow_remote_urls: bool = False
    """Whether ``http(s)://`` media URLs are passed on to vLLM, which then fetches them."""


class MediaError(ValueError):
    """A media part was rejected. ``source`` is the offending value as written, ``reason`` says why."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason


@hookspec(firstresult=True)
def convert_media_part(part: dict[str, Any], settings: MediaSettings) -> dict[str, Any] | None:
    """Convert one Responses-API media content part to the chat-completions part vLLM accepts.

    ``part`` is e.g. ``{"type": "input_video", "video_url": "file:///..."}`` (also ``path``, a
    ``data:`` URL or a cached-frame manifest) or ``{"type": "input_image", "image_url": ...}``; the
    result is e.g. ``{"type": "video_url", "video_url": {"url": "file:///..."}}``. Raise
    :class:`MediaError` for a part of your type that cannot be converted.

    Return ``None`` when the part is not one this implementation converts; the next one is asked.
    Stops at the first non-``None`` result.
    """


@hookspec(firstresult=True)
def relocate_tool_output_media(item: dict[str, Any], settings: MediaSettings) -> list[dict[str, Any]] | None:
    """Move media out of a tool output, which Gym 0.7 rejects when it holds video or images.

    ``item`` is one request input item. For a ``function_call_output`` whose ``output`` list holds
    media parts, return the items that replace it, in order: the tool output without its media
    (a text note in their place), then a user message carrying the media, directly after it.

    Return ``None`` when ``item`` carries no media this implementation moves; the item is kept
    as it is. Stops at the first non-``None`` result.
    """


@hookspec
def validate_media(part: dict[str, Any], settings: MediaSettings) -> None:
    """Check one media content part against ``settings`` (media root, size limits).

    Raise :class:`MediaError` naming the offending value and the reason to reject the part.
    Return ``None`` to accept it. Every implementation runs, so each can add its own checks.
    """
