"""vLLM's media connector, naming the input when its media fail to load.

vLLM hands a video loader the media's bytes, never the URL, so the loaders can name a video by its
content only (``<bytes sha256:...>``). The connector is where vLLM still has the URL. Registered as
``video_grpo`` in vLLM's ``MEDIA_CONNECTOR_REGISTRY`` and selected with the environment variable
``VLLM_MEDIA_CONNECTOR=video_grpo`` (``rl_bridge.services.vllm_server`` sets it for the servers this
package starts), :class:`VideoGRPOMediaConnector` is vLLM's own ``http`` connector with one change,
on failure:

- a media error while loading (this package's loader errors, or a plain ``ValueError``, e.g. from
  vLLM's checks of a ``file://`` URL) becomes a
  :class:`~vllm_video_plugin.errors.MediaInputError` (a ``ValueError``: HTTP 400) whose message
  starts with the input's name (:func:`vllm_video_plugin.inputs.input_name`: a file by its path
  relative to ``--allowed-local-media-path``), the content's ``<bytes sha256:...>`` beside it;
- a ``file://`` URL naming no readable file (missing, a directory, not readable): vLLM's connector
  lets the ``OSError`` through, which vLLM answers HTTP 500 with the path replaced by ``<path>``;
  here it is a :class:`~vllm_video_plugin.errors.MediaInputError` naming the relative path (HTTP 400).

Everything else (a network error fetching an ``http(s)://`` URL, vLLM's own typed errors) passes
as it is. This module imports vLLM; :func:`vllm_video_plugin.register` imports it inside vLLM.
"""

from __future__ import annotations

from typing import Any, Final

from vllm.multimodal.media.connector import MediaConnector

from vllm_video_plugin.errors import MediaInputError, VideoGRPOError
from vllm_video_plugin.inputs import CONNECTOR_ENV, CONNECTOR_NAME, input_name, vllm_message_name

__all__ = ["CONNECTOR_ENV", "CONNECTOR_NAME", "VideoGRPOMediaConnector", "named_media_error"]

_FILE_ERRORS: Final = (
    (FileNotFoundError, "no such file"),
    (IsADirectoryError, "is a directory, not a media file"),
    (PermissionError, "is not readable (permission denied)"),
)


def named_media_error(url: str, error: BaseException, *, media_root: Any) -> BaseException:
    """``error``, raised while loading the media at ``url``, as the error to answer with: a
    :class:`~vllm_video_plugin.errors.MediaInputError` naming the input for a media error or a
    ``file://`` URL's ``OSError``; ``error`` itself otherwise (see the module docstring)."""
    name = vllm_message_name(input_name(url, media_root=media_root))
    if isinstance(error, OSError):
        if not url[:7].lower() == "file://":
            return error  # fetching a remote URL: vLLM's own handling (retries, 5xx)
        reason = next(
            (text for kind, text in _FILE_ERRORS if isinstance(error, kind)),
            f"cannot be read ({error.strerror or error})",
        )
        return MediaInputError(name, reason)
    if isinstance(error, MediaInputError):
        return error  # named already
    source, reason = getattr(error, "source", None), getattr(error, "reason", None)
    if isinstance(error, VideoGRPOError) and isinstance(source, str) and isinstance(reason, str):
        return MediaInputError(f"{name} {source}", reason)
    if isinstance(error, VideoGRPOError) or type(error) is ValueError:
        return MediaInputError(name, str(error))
    return error


class VideoGRPOMediaConnector(MediaConnector):
    """vLLM's media connector; a failure names the input (see the module docstring)."""

    def load_from_url(self, url: str, media_io: Any, *, fetch_timeout: int | None = None) -> Any:
        try:
            return super().load_from_url(url, media_io, fetch_timeout=fetch_timeout)
        except (ValueError, OSError) as error:
            named = named_media_error(url, error, media_root=self.allowed_local_media_path)
            if named is error:
                raise
            raise named from error

    async def load_from_url_async(self, url: str, media_io: Any, *, fetch_timeout: int | None = None) -> Any:
        try:
            return await super().load_from_url_async(url, media_io, fetch_timeout=fetch_timeout)
        except (ValueError, OSError) as error:
            named = named_media_error(url, error, media_root=self.allowed_local_media_path)
            if named is error:
                raise
            raise named from error
