"""Built-in ``input_video`` handler: Responses ``input_video`` part to vLLM's chat ``video_url`` part.

A local ``path``, ``file://`` URL or cached-frame manifest becomes the ``file://`` URL of the file it
resolves to inside the media root; ``data:`` URLs and (when allowed) ``http(s)://`` URLs pass on as
they are. vLLM needs ``--allowed-local-media-path`` covering the media root to read local files.
"""

from __future__ import annotations

from typing import Any

from gym_video_env import hookimpl
from gym_video_env.handlers import VIDEO_PART_TYPE, check_media, media_url
from gym_video_env.hookspecs import MediaSettings


@hookimpl(trylast=True)
def convert_media_part(part: dict[str, Any], settings: MediaSettings) -> dict[str, Any] | None:
    if part.get("type") != VIDEO_PART_TYPE:
        return None
    return {"type": "video_url", "video_url": {"url": media_url(part, settings)}}


@hookimpl(trylast=True)
def validate_media(part: dict[str, Any], settings: MediaSettings) -> None:
    if part.get("type") == VIDEO_PART_TYPE:
        check_media(part, settings, max_bytes=settings.max_video_bytes)
