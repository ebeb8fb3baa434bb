"""Built-in ``input_image`` handler: Responses ``input_image`` part to vLLM's chat ``image_url`` part.

Sources resolve as for videos (see :mod:`gym_video_env.handlers`); the Responses ``detail`` field,
when present, is kept, since chat ``image_url`` parts have the same field.
"""

from __future__ import annotations

from typing import Any

from gym_video_env import hookimpl
from gym_video_env.handlers import IMAGE_PART_TYPE, check_media, media_url
from gym_video_env.hookspecs import MediaSettings


@hookimpl(trylast=True)
def convert_media_part(part: dict[str, Any], settings: MediaSettings) -> dict[str, Any] | None:
    if part.get("type") != IMAGE_PART_TYPE:
        return None
    image_url: dict[str, Any] = {"url": media_url(part, settings)}
    if part.get("detail") is not None:
        image_url["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image_url}


@hookimpl(trylast=True)
def validate_media(part: dict[str, Any], settings: MediaSettings) -> None:
    if part.get("type") == IMAGE_PART_TYPE:
        check_media(part, settings, max_bytes=settings.max_image_bytes)
