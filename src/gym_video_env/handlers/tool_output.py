"""Built-in tool-output handler: media in a ``function_call_output`` move to a user message after it.

Gym 0.7 rejects video inside a tool output and cannot convert images there, so an environment
that returns media from a tool gets them delivered as the next user message instead, the way
Gym's ``image_tools_agent`` injects images. The tool output keeps its other parts, plus a text
note that says what moved.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gym_video_env import hookimpl
from gym_video_env.handlers import IMAGE_PART_TYPE, VIDEO_PART_TYPE, is_media_part

_NOUNS = {VIDEO_PART_TYPE: ("video", "videos"), IMAGE_PART_TYPE: ("image", "images")}


@hookimpl(trylast=True)
def relocate_tool_output_media(item: dict[str, Any]) -> list[dict[str, Any]] | None:
    output = item.get("output")
    if item.get("type") != "function_call_output" or not isinstance(output, list):
        return None
    media = [part for part in output if is_media_part(part)]
    if not media:
        return None
    kept = [part for part in output if not is_media_part(part)]
    note = {"type": "input_text", "text": _note(media)}
    return [
        {**item, "output": [*kept, note]},
        {"type": "message", "role": "user", "content": media},
    ]


def _note(media: list[dict[str, Any]]) -> str:
    """E.g. ``[moved to the next user message: 1 video and 2 images]``."""
    counts = Counter(part["type"] for part in media)
    phrases = [
        f"{counts[part_type]} {noun if counts[part_type] == 1 else plural}"
        for part_type, (noun, plural) in _NOUNS.items()
        if counts[part_type]
    ]
    return f"[moved to the next user message: {' and '.join(phrases)}]"
