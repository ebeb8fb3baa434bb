"""Exceptions raised by :mod:`vllm_video_plugin`.

Every error derives from :class:`VideoGRPOError` and from :class:`ValueError`, so callers can catch
either this package's errors or the built-in category (vLLM turns a ``ValueError`` raised while
loading media into an HTTP 400 for the request instead of a server error).
"""

from __future__ import annotations

__all__ = ["MediaInputError", "VideoDecodeError", "VideoGRPOError", "VideoSamplingError"]


class VideoGRPOError(Exception):
    """Base class of this package's errors."""


class VideoSamplingError(VideoGRPOError, ValueError):
    """A sampling style cannot sample the given video (for example too few frames for its rules)."""


class VideoDecodeError(VideoGRPOError, ValueError):
    """A video cannot be decoded, or breaks a decode limit.

    ``source`` names the input: a file path, or ``"<bytes sha256:0123abcd...>"`` for in-memory bytes;
    ``reason`` says what went wrong.
    """

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason

    def __reduce__(self) -> tuple[type[VideoDecodeError], tuple[str, str]]:
        # Keep the two-argument constructor working across process boundaries (pickling).
        return (type(self), (self.source, self.reason))


class MediaInputError(VideoGRPOError, ValueError):
    """A media input cannot be loaded: a file that is missing or unreadable, or media that failed
    to load, named by where it came from.

    ``source`` names the input (:func:`vllm_video_plugin.inputs.input_name`, with the content's
    ``"<bytes sha256:...>"`` beside it when it was read); ``reason`` says what went wrong.
    """

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason

    def __reduce__(self) -> tuple[type[MediaInputError], tuple[str, str]]:
        return (type(self), (self.source, self.reason))
