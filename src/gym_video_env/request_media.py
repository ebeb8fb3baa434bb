"""Media in one Gym Responses request: moved out of tool outputs, checked, and rewritten for Gym.

:func:`prepare_request_media` runs on the raw ``/v1/responses`` body, before Gym validates it:

1. a ``function_call_output`` carrying media either becomes the tool output plus a user message
   with the media (policy ``"relocate"``, through the ``relocate_tool_output_media`` hook) or
   fails the request (policy ``"reject"``);
2. media are allowed in user messages only: Gym turns a system or developer message's media into
   a chat system message with media parts, which its own chat request model then rejects (an HTTP
   500), so media in any other message fail the request here. Every media part of a user message
   is checked (``validate_media``) and converted (``convert_media_part``) by the installed
   handlers, and every part of a user, system or developer message must be of a type Gym knows;
3. each converted part is written back as the canonical Responses part Gym accepts and converts
   as it is: ``{"type": "input_video", "video_url": {"url": ...}}`` or ``{"type": "input_image",
   "image_url": ..., "detail": ...}``. Sources Gym does not know (``path``, ``frames_manifest``)
   thereby become the ``file://`` URL of the confined file.

The same rules apply to the items of a trajectory an agent records (:func:`relocate_tool_outputs`).
This module does not import NeMo Gym.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Literal, get_args

import pluggy

from gym_video_env.handlers import MEDIA_PART_TYPES, is_media_part
from gym_video_env.hookspecs import MediaError, MediaSettings
from gym_video_env.plugins import get_plugin_manager
from vllm_video_plugin.inputs import input_name

__all__ = [
    "TOOL_OUTPUT_MEDIA_POLICIES",
    "MediaRequestError",
    "ToolOutputMediaPolicy",
    "chat_media_urls",
    "name_media_error",
    "prepare_request_media",
    "relocate_tool_outputs",
]

ToolOutputMediaPolicy = Literal["relocate", "reject"]
"""What happens to media inside a tool output: ``"relocate"`` moves them into a user message that
directly follows the tool output; ``"reject"`` fails the request."""
TOOL_OUTPUT_MEDIA_POLICIES: tuple[str, ...] = get_args(ToolOutputMediaPolicy)

# Message roles whose content Gym converts part by part (assistant content is text only).
_INPUT_ROLES = frozenset({"user", "system", "developer"})
# The one role whose media parts Gym's chat conversion can pass to the model.
_MEDIA_ROLE = "user"
# Content part types of those messages that Gym converts (the Responses API's, plus input_video).
_KNOWN_PART_TYPES = frozenset({"input_text", "input_image", "input_video", "input_file", "input_audio"})


class MediaRequestError(ValueError):
    """A request's media were rejected. ``location`` names the part, e.g. ``input[2].content[1]``."""

    def __init__(self, location: str, reason: str) -> None:
        super().__init__(f"{location}: {reason}")
        self.location = location
        self.reason = reason


def prepare_request_media(
    body: dict[str, Any],
    settings: MediaSettings,
    *,
    tool_output_media: ToolOutputMediaPolicy = "relocate",
    plugin_manager: pluggy.PluginManager | None = None,
) -> dict[str, Any]:
    """A copy of the raw Responses request ``body`` with its media relocated, checked and canonical.

    A string ``input`` has no media and is kept. Items are otherwise copied only where they change.

    Args:
        body: the JSON body of a ``/v1/responses`` request.
        settings: media root and size limits for the checks.
        tool_output_media: see :data:`ToolOutputMediaPolicy`.
        plugin_manager: the media handlers; ``None`` means :func:`get_plugin_manager`.

    Raises:
        MediaRequestError: a part failed a check or could not be converted (the handler's
            :class:`MediaError` text is the reason), a message part has an unknown type, a message
            other than a user message holds media, or a tool output held media under ``"reject"``.
    """
    if tool_output_media not in TOOL_OUTPUT_MEDIA_POLICIES:
        raise ValueError(
            f"tool_output_media must be one of {', '.join(TOOL_OUTPUT_MEDIA_POLICIES)}, "
            f"got {tool_output_media!r}"
        )
    items = body.get("input")
    if not isinstance(items, list):
        return dict(body)
    pm = plugin_manager or get_plugin_manager()
    prepared: list[Any] = []
    for index, item in enumerate(items):
        location = f"input[{index}]"
        if _tool_output_media(item):
            if tool_output_media == "reject":
                raise MediaRequestError(
                    location,
                    "the tool output (function_call_output) carries media, and this server's tool-output "
                    "media policy is 'reject'; return media in a user message, or set "
                    "tool_output_media: relocate",
                )
            replacement = pm.hook.relocate_tool_output_media(item=item, settings=settings)
            if replacement is None:
                raise MediaRequestError(location, "no media handler moved the media out of this tool output")
            prepared += [_canonical_item(new, f"{location}(relocated)", settings, pm) for new in replacement]
        else:
            prepared.append(_canonical_item(item, location, settings, pm))
    return {**body, "input": prepared}


def relocate_tool_outputs(
    items: Iterable[dict[str, Any]],
    settings: MediaSettings,
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> list[dict[str, Any]]:
    """``items`` with every tool output that carries media replaced as the relocation hook says.

    For agents recording a trajectory: the result is what the model server sends on, so the
    recorded items and the model's prompt agree. Media are not checked or converted here.
    """
    pm = plugin_manager or get_plugin_manager()
    relocated: list[dict[str, Any]] = []
    for item in items:
        replacement = pm.hook.relocate_tool_output_media(item=item, settings=settings)
        relocated += [item] if replacement is None else replacement
    return relocated


def chat_media_urls(messages: Iterable[Any]) -> list[str]:
    """The URLs of the ``video_url`` and ``image_url`` parts of chat ``messages``, in order."""
    urls: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict) or part.get("type") not in ("video_url", "image_url"):
                continue
            ref = part.get(part["type"])
            url = ref.get("url") if isinstance(ref, dict) else ref
            if isinstance(url, str):
                urls.append(url)
    return urls


_CONTENT_LABEL = re.compile(r"<bytes sha256:([0-9a-f]{16})>")


def name_media_error(message: str, urls: Sequence[str], settings: MediaSettings) -> str:
    """vLLM's error ``message`` for a request whose media are ``urls``, with the failing input named.

    vLLM's loaders name a video by its content (``<bytes sha256:...>``); this package's media
    connector puts its name before that, relative to vLLM's allowed path and in a form vLLM's path
    filter leaves alone (``a.mp4 in data/clips/``). Here the input is named as the request named
    it: the local file (relative to :attr:`MediaSettings.media_root`) or ``data:`` URL whose
    content has that label, or the only media input of the request; the connector's name, if
    there, gives way to it. ``message`` is returned unchanged when it carries no content label,
    or no input can be told to be the one.
    """
    match = _CONTENT_LABEL.search(message)
    if match is None or not urls:
        return message
    candidates = [url for url in urls if _content_label(url) == match.group(1)]
    if not candidates and len(urls) == 1 and not urls[0].lower().startswith(("http://", "https://")):
        candidates = list(urls)
    if len(candidates) != 1:
        return message
    name = input_name(candidates[0], media_root=settings.media_root)
    if name in message:
        return message
    before = message[: match.start()].strip()
    if before and before.split(" in ")[0] == PurePosixPath(name).name:
        # This package's connector named it, relative to vLLM's allowed path and in the form
        # vLLM's filter leaves alone ("a.mp4 in data/clips/"): name it as the request did instead.
        return f"{name} {message[match.start() :]}"
    return f"{name} {message}"


def _content_label(url: str) -> str | None:
    """The first 16 hex digits of the SHA-256 of a ``file://`` or ``data:`` URL's bytes (``None``
    when they cannot be read)."""
    try:
        if url[:5].lower() == "data:":
            header, _, payload = url.partition(",")
            if header.lower().endswith(";base64"):
                data = base64.b64decode("".join(payload.split()), validate=True)
            else:
                data = urllib.parse.unquote_to_bytes(payload)
        elif url[:7].lower() == "file://":
            data = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path)).read_bytes()
        else:
            return None
    except (OSError, ValueError, binascii.Error):
        return None
    return hashlib.sha256(data).hexdigest()[:16]


def _tool_output_media(item: Any) -> bool:
    if not isinstance(item, dict) or item.get("type") != "function_call_output":
        return False
    output = item.get("output")
    return isinstance(output, list) and any(is_media_part(part) for part in output)


def _canonical_item(item: Any, location: str, settings: MediaSettings, pm: pluggy.PluginManager) -> Any:
    """``item`` with its media parts checked and rewritten; other items unchanged.

    Raises:
        MediaRequestError: media in an item other than a user message, or as :func:`_canonical_part`.
    """
    if not isinstance(item, dict):
        return item
    content = item.get("content")
    if not isinstance(content, list):
        return item
    role = item.get("role")
    if role != _MEDIA_ROLE:
        for index, part in enumerate(content):
            if is_media_part(part):
                raise MediaRequestError(
                    f"{location}.content[{index}]",
                    f"{part['type']} parts are allowed in user messages only, not in a message with "
                    f"role {role!r}; move the media into a user message",
                )
    if not isinstance(role, str) or role not in _INPUT_ROLES:
        return item
    parts = [
        _canonical_part(part, f"{location}.content[{index}]", settings, pm)
        for index, part in enumerate(content)
    ]
    return {**item, "content": parts}


def _canonical_part(part: Any, location: str, settings: MediaSettings, pm: pluggy.PluginManager) -> Any:
    if not isinstance(part, dict):
        return part  # Gym's own validation names non-object parts
    part_type = part.get("type")
    if not isinstance(part_type, str) or part_type not in _KNOWN_PART_TYPES:
        raise MediaRequestError(
            location,
            f"unknown content part type {part_type!r}; message content parts are "
            f"{', '.join(sorted(_KNOWN_PART_TYPES))}",
        )
    if part_type not in MEDIA_PART_TYPES:
        return part
    try:
        pm.hook.validate_media(part=part, settings=settings)
        converted = pm.hook.convert_media_part(part=part, settings=settings)
    except MediaError as error:
        raise MediaRequestError(location, str(error)) from error
    if converted is None:
        raise MediaRequestError(location, f"no media handler converts {part['type']!r} parts")
    return _responses_part(converted, location)


def _responses_part(chat_part: dict[str, Any], location: str) -> dict[str, Any]:
    """The Responses part that Gym's own converter turns into ``chat_part``."""
    match chat_part.get("type"):
        case "video_url":
            return {"type": "input_video", "video_url": {"url": chat_part["video_url"]["url"]}}
        case "image_url":
            image_url = chat_part["image_url"]
            part: dict[str, Any] = {"type": "input_image", "image_url": image_url["url"]}
            part["detail"] = image_url.get("detail", "auto")
            return part
        case other:
            raise MediaRequestError(
                location,
                f"a media handler converted the part to chat type {other!r}; Gym requests can carry "
                "'video_url' and 'image_url' parts only",
            )
