"""How media errors name the input: one rule for vLLM's media connector, the Gym model server and
the trainer.

A media input is named by where it came from: a local file by its path relative to the media root
(``clips/a.mp4``), an ``http(s)://`` URL by itself, an inline ``data:`` URL by its media type
(``data:video/mp4``). The content is named beside it by this package's decoders
(``<bytes sha256:...>``, :func:`vllm_video_plugin.decode.source_label`), so an error reads
``clips/a.mp4 <bytes sha256:990819022a32c638>: not a readable media container``.

vLLM replaces what looks like a file path in every error message it answers (``sanitize_message``:
an absolute path, or any ``/dir/name.ext``), which would turn ``data/clips/a.mp4`` into
``data<path>``. :func:`vllm_message_name` writes a relative path of more than one directory as
``a.mp4 in data/clips/``, which it leaves alone. Pure Python: does not import vLLM.
"""

from __future__ import annotations

import os
import urllib.parse
import urllib.request
from pathlib import Path, PurePosixPath

__all__ = ["CONNECTOR_ENV", "CONNECTOR_NAME", "input_name", "vllm_message_name"]

CONNECTOR_NAME = "video_grpo"
"""The name of this package's media connector in vLLM's ``MEDIA_CONNECTOR_REGISTRY``
(:class:`vllm_video_plugin.connector.VideoGRPOMediaConnector`), which names the input in media errors."""
CONNECTOR_ENV = "VLLM_MEDIA_CONNECTOR"
"""vLLM's environment variable selecting the media connector by name."""

_MAX_URL_CHARS = 200


def input_name(reference: str, *, media_root: str | os.PathLike[str] | None) -> str:
    """The name of the media input at ``reference`` (a ``file://``, ``data:`` or ``http(s)://``
    URL, or a local path) for error messages.

    A local file inside ``media_root`` is named by its POSIX path relative to it (symlinks are
    not followed, so the name is the one the request used); a file outside it, or any file when
    ``media_root`` is ``None``, by its path as given.
    """
    scheme = reference.partition(":")[0].lower() if ":" in reference[:12] else ""
    if scheme == "data":
        media_type = reference[5:].partition(",")[0].partition(";")[0] or "text/plain"
        return f"data:{media_type}"
    if scheme in ("http", "https"):
        return reference if len(reference) <= _MAX_URL_CHARS else reference[: _MAX_URL_CHARS - 3] + "..."
    if scheme == "file":
        path = Path(urllib.request.url2pathname(urllib.parse.urlsplit(reference).path))
    else:
        path = Path(reference)
    if media_root is None:
        return path.as_posix()
    root = Path(media_root)
    candidate = path if path.is_absolute() else root / path
    for base in (root, root.resolve()):
        if candidate.is_relative_to(base):
            return candidate.relative_to(base).as_posix()
    return path.as_posix()


def vllm_message_name(name: str) -> str:
    """``name`` as vLLM's message sanitizer leaves it: ``clips/a.mp4`` as it is,
    ``data/clips/a.mp4`` as ``a.mp4 in data/clips/`` (see the module docstring)."""
    if "://" in name or name.startswith(("/", "data:")):
        return name
    path = PurePosixPath(name)
    if len(path.parts) <= 2:
        return name
    return f"{path.name} in {path.parent.as_posix()}/"
