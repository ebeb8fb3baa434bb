"""``video_mcqa``: multiple-choice questions about a video in the prompt, graded from ``\\boxed{X}``.

Rows (see :func:`video_grpo_demo.rows.video_mcqa_rows`) carry ``options`` (letter -> text)
and ``answer`` (the correct letter) next to ``responses_create_params``. ``/verify`` reads the
last ``\\boxed{...}`` of the final assistant message: reward 1.0 for the correct letter, else 0.0.
Use it with the stock ``simple_agent`` (``configs/video_mcqa.yaml``).
"""

from __future__ import annotations

from typing import ClassVar

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import is_nemo_gym_fastapi_entrypoint
from pydantic import ConfigDict

from gym_video_env.grading import AnswerFormat, final_assistant_text, grade_choice


class VideoMCQAConfig(BaseResourcesServerConfig):
    """Grading depends on the row and on where the answer letter is read."""

    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS

    answer_format: AnswerFormat = "boxed"
    """``"boxed"``: the last ``\\boxed{X}``; ``"letter"``: the whole final answer is the letter."""


class VideoMCQARunRequest(BaseRunRequest):
    """A ``video_mcqa`` row; other row fields (``task_id``, ``task``...) are kept as they are."""

    model_config = ConfigDict(extra="allow")

    options: dict[str, str]
    """Option letter -> option text."""
    answer: str
    """Letter of the correct option."""


class VideoMCQAVerifyRequest(VideoMCQARunRequest, BaseVerifyRequest):
    pass


class VideoMCQAVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")

    extracted_answer: str | None
    """The letter read from the final answer; ``None`` when there was no valid ``\\boxed{X}``."""


class VideoMCQAResourcesServer(SimpleResourcesServer):
    ray_enabled = False
    config: VideoMCQAConfig

    async def verify(self, body: VideoMCQAVerifyRequest) -> VideoMCQAVerifyResponse:
        output = body.response.model_dump(mode="json")["output"]
        grade = grade_choice(
            final_assistant_text(output), body.answer, body.options, answer_format=self.config.answer_format
        )
        # The request's fields as validated (the response's token ids not dumped and validated again).
        return VideoMCQAVerifyResponse(**dict(body), reward=grade.reward, extracted_answer=grade.extracted)


if __name__ == "__main__":
    VideoMCQAResourcesServer.run_webserver()
elif is_nemo_gym_fastapi_entrypoint(__file__):  # a uvicorn worker (rollout.gym_workers > 1)
    app = VideoMCQAResourcesServer.run_webserver()
