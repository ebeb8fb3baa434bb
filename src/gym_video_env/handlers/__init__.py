"""Built-in media handlers and what they share: reading a part's media reference, confining files.

Each module in this package is a plugin in the ``gym_video_env.media_handlers`` entry-point group,
registered like a third party's (see :mod:`gym_video_env.plugins`).

Where a part's media may be, by key (exactly one per part):

- ``path``: a local file, relative to the media root or absolute;
- ``frames_manifest`` (``input_video`` only): a local cached-frame manifest, resolved like ``path``;
- ``video_url`` / ``video`` (``input_video``) or ``image_url`` (``input_image``): a URL, given as a
  string or as ``{"url": ...}``: ``file://`` (a local file), ``data:`` (inline) or ``http(s)://``;
  a reference without a scheme (``clips/a.mp4``) is a local file, resolved like ``path``. Gym's own
  request schema accepts only these keys, so datasets use a schemeless reference to stay portable
  across machines (the media root moves, the rows do not change).

Every local file must resolve (symlinks followed) to an existing file inside
:attr:`MediaSettings.media_root <gym_video_env.hookspecs.MediaSettings.media_root>`.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gym_video_env.hookspecs import MediaError, MediaSettings

__all__ = [
    "IMAGE_PART_TYPE",
    "MEDIA_PART_TYPES",
    "VIDEO_PART_TYPE",
    "MediaRef",
    "check_media",
    "is_media_part",
    "media_ref",
    "media_url",
    "resolve_local_media",
]

VIDEO_PART_TYPE = "input_video"
IMAGE_PART_TYPE = "input_image"
MEDIA_PART_TYPES = frozenset({VIDEO_PART_TYPE, IMAGE_PART_TYPE})

_SOURCE_KEYS: dict[str, tuple[str, ...]] = {
    VIDEO_PART_TYPE: ("path", "frames_manifest", "video_url", "video"),
    IMAGE_PART_TYPE: ("path", "image_url"),
}
_PATH_KEYS = frozenset({"path", "frames_manifest"})


@dataclass(frozen=True)
class MediaRef:
    """Where one part's media bytes are."""

    kind: Literal["file", "data", "remote"]
    """``file``: a local file; ``data``: an inline ``data:`` URL; ``remote``: an ``http(s)://`` URL."""
    value: str
    """For ``file``, the path as written (relative paths are relative to the media root); else the URL."""
    key: str
    """The part key it was read from, e.g. ``path`` or ``video_url``."""
    is_manifest: bool = False
    """Whether the file is a cached-frame manifest rather than an encoded video or image."""


def is_media_part(part: object) -> bool:
    """Whether ``part`` (any JSON value) is an ``input_video`` or ``input_image`` content part."""
    if not isinstance(part, dict):
        return False
    part_type = part.get("type")
    return isinstance(part_type, str) and part_type in MEDIA_PART_TYPES


def media_ref(part: dict[str, Any]) -> MediaRef:
    """Read where the media of an ``input_video`` or ``input_image`` part is.

    Raises:
        MediaError: the part has no source key or several, or its URL is empty, malformed or of an
            unsupported scheme.
    """
    part_type = part.get("type")
    if not isinstance(part_type, str) or part_type not in _SOURCE_KEYS:
        raise MediaError(repr(part_type), f"not a media part type; expected one of {sorted(_SOURCE_KEYS)}")
    keys = [key for key in _SOURCE_KEYS[part_type] if key in part]
    if len(keys) != 1:
        raise MediaError(
            part_type,
            f"needs exactly one of {', '.join(_SOURCE_KEYS[part_type])}, got {keys or 'none'}",
        )
    key = keys[0]
    raw = part[key]
    value = raw.get("url") if isinstance(raw, dict) else raw
    if not isinstance(value, str) or not value.strip():
        raise MediaError(f"{part_type}.{key}", f"must be a non-empty string, got {raw!r}")
    if key in _PATH_KEYS:
        return MediaRef("file", value, key, is_manifest=key == "frames_manifest")
    return _url_ref(value, key)


def _url_ref(url: str, key: str) -> MediaRef:
    try:
        parsed = urllib.parse.urlsplit(url)
    except ValueError as error:  # e.g. an unclosed IPv6 bracket: http://[::1
        raise MediaError(_shorten(url), f"not a valid URL ({error})") from error
    scheme = parsed.scheme.lower()
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(url, f"file URLs must name a local file, not host {parsed.netloc!r}")
        return MediaRef("file", urllib.request.url2pathname(parsed.path), key)
    if scheme == "data":
        return MediaRef("data", url, key)
    if scheme in ("http", "https"):
        return MediaRef("remote", url, key)
    if not scheme:
        return MediaRef("file", url, key)
    raise MediaError(
        _shorten(url),
        f"unsupported URL scheme {scheme!r}; use file://, data:, http(s):// or a path relative to the "
        "media root",
    )


def resolve_local_media(path: str, settings: MediaSettings) -> Path:
    """Resolve a local media path (relative to the media root, or absolute) to a file inside the root.

    Symlinks are followed before the check, so a link pointing out of the root is rejected.

    Raises:
        MediaError: no media root is configured, the path cannot be resolved (a NUL character, a name
            too long), resolves outside the root, or is not a file.
    """
    if settings.media_root is None:
        raise MediaError(path, "local media files are not allowed: no media root is configured")
    root = settings.media_root.resolve()
    candidate = Path(path)
    try:
        resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
        inside = resolved.is_relative_to(root)
        is_file = inside and resolved.is_file()
    except (OSError, ValueError) as error:  # a name too long, a NUL character
        detail = error.strerror if isinstance(error, OSError) else error
        raise MediaError(_shorten(path), f"not a usable file path ({detail})") from error
    if not inside:
        raise MediaError(path, f"resolves to {resolved}, which is outside the media root {root}")
    if not is_file:
        raise MediaError(path, f"no such file: {resolved} (media root {root})")
    return resolved


def media_url(part: dict[str, Any], settings: MediaSettings) -> str:
    """The URL vLLM should load a part's media from: ``file://`` of the confined file, or the URL.

    Raises:
        MediaError: as :func:`media_ref` and :func:`resolve_local_media`, or a remote URL while
            :attr:`MediaSettings.allow_remote_urls` is off.
    """
    ref = media_ref(part)
    if ref.kind == "file":
        return resolve_local_media(ref.value, settings).as_uri()
    _check_remote_allowed(ref, settings)
    return ref.value


def check_media(part: dict[str, Any], settings: MediaSettings, *, max_bytes: int | None) -> None:
    """Check a part's source and its size in bytes against ``max_bytes`` (``None``: no limit).

    Cached-frame manifests are checked for confinement only: their size says nothing about the
    media. The size of remote media is not known before vLLM fetches it.

    Raises:
        MediaError: as :func:`media_url`, or the media is larger than ``max_bytes``.
    """
    ref = media_ref(part)
    num_bytes: int | None = None
    if ref.kind == "file":
        path = resolve_local_media(ref.value, settings)
        num_bytes = None if ref.is_manifest else path.stat().st_size
    elif ref.kind == "data":
        num_bytes = _data_url_num_bytes(ref.value)
    else:
        _check_remote_allowed(ref, settings)
    if max_bytes is not None and num_bytes is not None and num_bytes > max_bytes:
        raise MediaError(
            _shorten(ref.value), f"is {num_bytes} bytes, more than the limit of {max_bytes} bytes"
        )


def _check_remote_allowed(ref: MediaRef, settings: MediaSettings) -> None:
    if ref.kind == "remote" and not settings.allow_remote_urls:
        raise MediaError(
            ref.value, "remote media URLs are not allowed (MediaSettings.allow_remote_urls is off)"
        )


def _data_url_num_bytes(url: str) -> int:
    """Size in bytes of the payload of a ``data:`` URL (RFC 2397), base64 or percent-encoded.

    Base64 sizes are computed from the payload length, without decoding it.
    """
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(_shorten(url), "malformed data URL: no ',' before the payload")
    if not header.lower().endswith(";base64"):
        return len(urllib.parse.unquote_to_bytes(payload))
    payload = "".join(payload.split())
    if len(payload) % 4:
        raise MediaError(
            _shorten(url), f"invalid base64 payload: length {len(payload)} is not a multiple of 4"
        )
    padding = len(payload) - len(payload.rstrip("="))
    return len(payload) // 4 * 3 - padding


def _shorten(text: str, max_chars: int = 80) -> str:
    """``text`` cut for an error message (data URLs can be megabytes long)."""
    return text if len(text) <= max_chars else f"{text[: max_chars - 3]}..."
