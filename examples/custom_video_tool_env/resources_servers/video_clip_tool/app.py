"""``video_clip_tool``: a resources server whose tool cuts a clip out of a longer video.

The row names a long video under the media root (``video``) and asks about part of it. The tool
``cut_clip`` (``POST /cut_clip {"start_s": 2.0, "end_s": 4.0}``) decodes that span of the row's
video, writes it as a new clip under ``<media_root>/<clips_dir>/`` and answers with content parts:
a caption and an ``input_video`` part naming the clip relative to the media root.
``video_tools_agent`` puts the parts into the ``function_call_output`` and moves the video into a
user message right after it, so the next model turn sees the clip. ``/verify`` grades the final
answer's ``\\boxed{X}`` against the row's ``answer``, as ``video_mcqa`` does.
"""

from __future__ import annotations

import hashlib
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

import av
import numpy as np
from fastapi import HTTPException, Request
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY
from pydantic import BaseModel, ConfigDict, PositiveFloat, PrivateAttr

from gym_video_env import MediaSettings
from gym_video_env.grading import final_assistant_text, grade_choice
from gym_video_env.handlers import resolve_local_media
from gym_video_env.hookspecs import MediaError
from video_grpo_demo.synthetic import write_video


class VideoClipToolConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS

    media_root: str
    """The directory the rows' videos are in; the cut clips are written under it too. The same as
    the model server's ``media_root`` (``${video_media_root}`` in both configs)."""
    clips_dir: str = "tool_clips"
    """Sub-directory of the media root for the cut clips."""
    max_clip_s: PositiveFloat = 10.0
    """Longest clip one call may cut, in seconds."""


class VideoClipRunRequest(BaseRunRequest):
    """A row: ``video`` (relative to the media root), ``options`` and ``answer``; other fields kept."""

    model_config = ConfigDict(extra="allow")

    video: str
    options: dict[str, str]
    answer: str


class VideoClipVerifyRequest(VideoClipRunRequest, BaseVerifyRequest):
    pass


class VideoClipVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")

    extracted_answer: str | None
    clips: list[str]
    """The clips cut in this session, relative to the media root."""


class CutClipRequest(BaseModel):
    start_s: float
    """Start of the span, seconds from the start of the row's video."""
    end_s: float
    """End of the span (exclusive), seconds."""


class ToolContentOutput(BaseModel):
    """A tool result made of Responses content parts; ``video_tools_agent`` relocates its media."""

    output: list[dict[str, Any]]


class VideoClipToolServer(SimpleResourcesServer):
    ray_enabled = False
    config: VideoClipToolConfig
    # Session id -> the row's video (a path inside the media root) and the clips cut so far.
    _videos: dict[str, Path] = PrivateAttr(default_factory=dict)
    _clips: dict[str, list[str]] = PrivateAttr(default_factory=dict)

    def setup_webserver(self):
        app = super().setup_webserver()
        app.post("/cut_clip")(self.cut_clip)
        return app

    @property
    def media_root(self) -> Path:
        return Path(self.config.media_root).resolve()

    async def seed_session(self, request: Request, body: VideoClipRunRequest) -> BaseSeedSessionResponse:
        session_id = request.session[SESSION_ID_KEY]
        # The same confinement as the model server's: symlinks followed, nothing outside the root.
        # A bad row is refused with HTTP 400 and its reason (the agent passes that on).
        try:
            self._videos[session_id] = resolve_local_media(
                body.video, MediaSettings(media_root=self.media_root)
            )
        except MediaError as error:
            raise HTTPException(status_code=400, detail=f"video: {error}") from error
        self._clips[session_id] = []
        return BaseSeedSessionResponse()

    async def cut_clip(self, request: Request, body: CutClipRequest) -> ToolContentOutput:
        """The span ``[start_s, end_s)`` of the session's video as a new clip; a text for a bad call."""
        source = self._videos.get(request.session[SESSION_ID_KEY])
        if source is None:
            return _text("No video in this session: it was not seeded.")
        if not 0 <= body.start_s < body.end_s or body.end_s - body.start_s > self.config.max_clip_s:
            return _text(
                f"Invalid call: need 0 <= start_s < end_s and at most {self.config.max_clip_s} s, "
                f"got start_s={body.start_s}, end_s={body.end_s}."
            )
        frames, fps = _decode_span(source, body.start_s, body.end_s)
        if not frames:
            return _text(
                f"Invalid call: the video has no frames between {body.start_s} s and {body.end_s} s."
            )
        name = hashlib.sha256(f"{source}:{body.start_s}:{body.end_s}".encode()).hexdigest()[:16]
        clip = self.media_root / self.config.clips_dir / f"{source.stem}-{name}.mp4"
        clip.parent.mkdir(parents=True, exist_ok=True)
        write_video(clip, frames, fps=fps)
        reference = clip.relative_to(self.media_root).as_posix()
        self._clips[request.session[SESSION_ID_KEY]].append(reference)
        return ToolContentOutput(
            output=[
                {"type": "input_text", "text": f"Seconds {body.start_s} to {body.end_s} of the video:"},
                {"type": "input_video", "video_url": reference},
            ]
        )

    async def verify(self, request: Request, body: VideoClipVerifyRequest) -> VideoClipVerifyResponse:
        session_id = request.session.get(SESSION_ID_KEY)
        self._videos.pop(session_id, None)
        clips = self._clips.pop(session_id, [])
        output = body.response.model_dump(mode="json")["output"]
        grade = grade_choice(final_assistant_text(output), body.answer, body.options, answer_format="boxed")
        return VideoClipVerifyResponse(
            **body.model_dump(), reward=grade.reward, extracted_answer=grade.extracted, clips=clips
        )


def _text(text: str) -> ToolContentOutput:
    return ToolContentOutput(output=[{"type": "input_text", "text": text}])


def _decode_span(path: Path, start_s: float, end_s: float) -> tuple[list[np.ndarray], Fraction]:
    """RGB frames of ``path`` presented in ``[start_s, end_s)``, and the video's frame rate."""
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            fps = stream.average_rate or Fraction(25)
            frames = [
                frame.to_ndarray(format="rgb24")
                for frame in container.decode(stream)
                if frame.time is not None and start_s <= frame.time < end_s
            ]
    except (av.error.FFmpegError, IndexError) as error:
        raise MediaError(str(path), f"does not decode: {error}") from error
    return frames, Fraction(fps)


if __name__ == "__main__":
    VideoClipToolServer.run_webserver()
