"""``video_segments``: the model watches the segments of a video through a tool, then answers.

The prompt shows no video. The tool ``watch_segment`` (``POST /watch_segment {"segment": k}``)
returns segment ``k``'s clip as content parts (a caption and an ``input_video`` part), which
``video_tools_agent`` puts into the trajectory; the media move out of the tool output into a user
message that follows it, so the next model turn sees the clip. When the model answers without
calling the tool, the agent asks ``/next_segment`` (its ``observation_route``), which returns the
first segment not yet seen (or nothing once all were seen), so every trajectory gets to see every
segment: several clips per trajectory, returned by the environment in later turns. A segment whose
reference is an image (``still_segments`` rows) comes back as an ``input_image`` still frame
instead, so a trajectory can hold an image in one turn and a video in another.

Rows (see :func:`video_grpo_demo.rows.video_segments_rows` and
:func:`~video_grpo_demo.rows.video_segment_question_rows`) carry ``segments`` (clip
references, relative to the media root, in segment order), ``options``, ``answer`` and, when the
question names one segment, ``named_segment``. The session seeded by ``/seed_session`` holds the
row's segments; ``/verify`` grades the final answer as ``video_mcqa`` does (``answer_format``:
the last ``\\boxed{X}``, or the whole answer as one letter), charges ``tool_call_cost`` per
``watch_segment`` call (``reward = correct - tool_call_cost * tool_calls``, so a policy learns to
stop calling once it knows) and reports the segments watched, the calls made and how many of
them asked for the named segment.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fastapi import Request
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY, is_nemo_gym_fastapi_entrypoint
from pydantic import BaseModel, ConfigDict, PrivateAttr

from gym_video_env.environments import segment_tool_output
from gym_video_env.grading import AnswerFormat, final_assistant_text, grade_choice


class VideoSegmentsConfig(BaseResourcesServerConfig):
    """Where the answer letter is read; the segments come with each row."""

    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS

    answer_format: AnswerFormat = "boxed"
    """``"boxed"``: the last ``\\boxed{X}``; ``"letter"``: the whole final answer is the letter."""
    tool_call_cost: float = 0.0
    """Subtracted from the reward per ``watch_segment`` call (valid or not)."""


class VideoSegmentsRunRequest(BaseRunRequest):
    """A ``video_segments`` row; other row fields are kept as they are."""

    model_config = ConfigDict(extra="allow")

    segments: list[str]
    """Clip references (relative to the media root, or URLs), in segment order."""
    options: dict[str, str]
    answer: str
    named_segment: int | None = None
    """The segment the question asks about (1-based), when it names one."""


class VideoSegmentsVerifyRequest(VideoSegmentsRunRequest, BaseVerifyRequest):
    pass


class VideoSegmentsVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")

    extracted_answer: str | None
    watched_segments: list[int]
    """Segments shown in this session (``watch_segment`` or ``/next_segment``), in order, 1-based."""
    correct: bool
    """The final answer is the right option (the reward before the tool-call cost)."""
    tool_calls: int
    """``watch_segment`` calls in this session, valid or not."""
    named_segment_calls: int | None
    """Calls that asked for ``named_segment`` (``None`` when the row names no segment)."""


class WatchSegmentRequest(BaseModel):
    segment: int
    """Segment number, 1-based."""


class ToolContentOutput(BaseModel):
    """A tool result made of Responses content parts (``input_text``, ``input_video``...)."""

    output: list[dict[str, Any]]


class VideoSegmentsResourcesServer(SimpleResourcesServer):
    ray_enabled = False
    config: VideoSegmentsConfig
    # Session id -> the row's segments and the segments watched so far.
    _segments: dict[str, list[str]] = PrivateAttr(default_factory=dict)
    _watched: dict[str, list[int]] = PrivateAttr(default_factory=dict)
    _calls: dict[str, list[int]] = PrivateAttr(default_factory=dict)

    def setup_webserver(self):
        app = super().setup_webserver()
        app.post("/watch_segment")(self.watch_segment)
        app.post("/next_segment")(self.next_segment)
        return app

    async def seed_session(self, request: Request, body: VideoSegmentsRunRequest) -> BaseSeedSessionResponse:
        session_id = request.session[SESSION_ID_KEY]
        self._segments[session_id] = list(body.segments)
        self._watched[session_id] = []
        self._calls[session_id] = []
        return BaseSeedSessionResponse()

    async def watch_segment(self, request: Request, body: WatchSegmentRequest) -> ToolContentOutput:
        """Segment ``body.segment``'s clip; an out-of-range number gets a text the model can act on."""
        session_id = request.session[SESSION_ID_KEY]
        segments = self._segments.get(session_id)
        if segments is None:
            return ToolContentOutput(
                output=[{"type": "input_text", "text": "No video in this session: it was not seeded."}]
            )
        self._calls[session_id].append(body.segment)
        try:
            output = segment_tool_output(segments, body.segment)
        except ValueError as error:
            return ToolContentOutput(output=[{"type": "input_text", "text": f"Invalid call: {error}."}])
        self._watched[session_id].append(body.segment)
        return ToolContentOutput(output=output)

    async def next_segment(self, request: Request) -> ToolContentOutput:
        """The first segment not watched yet; an empty ``output`` once every segment was watched."""
        session_id = request.session[SESSION_ID_KEY]
        segments = self._segments.get(session_id, [])
        watched = self._watched.setdefault(session_id, [])
        unseen = [number for number in range(1, len(segments) + 1) if number not in watched]
        if not unseen:
            return ToolContentOutput(output=[])
        watched.append(unseen[0])
        return ToolContentOutput(output=segment_tool_output(segments, unseen[0]))

    async def verify(self, request: Request, body: VideoSegmentsVerifyRequest) -> VideoSegmentsVerifyResponse:
        session_id = request.session.get(SESSION_ID_KEY)
        watched = self._watched.pop(session_id, []) if session_id is not None else []
        calls = self._calls.pop(session_id, []) if session_id is not None else []
        self._segments.pop(session_id, None)
        output = body.response.model_dump(mode="json")["output"]
        grade = grade_choice(
            final_assistant_text(output), body.answer, body.options, answer_format=self.config.answer_format
        )
        named = body.named_segment
        # The request's fields as validated (the response's token ids not dumped and validated again).
        return VideoSegmentsVerifyResponse(
            **dict(body),
            reward=grade.reward - self.config.tool_call_cost * len(calls),
            extracted_answer=grade.extracted,
            watched_segments=watched,
            correct=grade.reward == 1.0,
            tool_calls=len(calls),
            named_segment_calls=None if named is None else calls.count(named),
        )


if __name__ == "__main__":
    VideoSegmentsResourcesServer.run_webserver()
elif is_nemo_gym_fastapi_entrypoint(__file__):  # a uvicorn worker (rollout.gym_workers > 1)
    app = VideoSegmentsResourcesServer.run_webserver()
