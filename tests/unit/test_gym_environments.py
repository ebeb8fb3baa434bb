"""Grading of \\boxed{X} answers and the task rows of the video environments (video_mcqa, video_segments)."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from gym_video_env.environments import read_rows_jsonl, segment_tool_output, write_rows_jsonl
from gym_video_env.grading import extract_boxed, final_assistant_text, grade_choice
from video_grpo_demo.rows import (
    video_last_segment_rows,
    video_mcqa_rows,
    video_segment_question_rows,
    video_segments_rows,
)
from video_grpo_demo.synthetic import classify_colour
from video_grpo_demo.synthetic.frames import SATURATED_COLOURS

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{B}", "B"),
        ("\\boxed{A} then \\boxed{c}", "C"),
        ("\\boxed{\\text{D}}", "D"),
        ("\\boxed{(B).}", "B"),
        ("\\boxed{B and C}", None),
        ("\\boxed{Z}", None),
        ("the answer is B", None),
        ("\\boxed{B", None),
    ],
)
def test_grade_choice_reads_the_last_boxed_letter(text: str, expected: str | None) -> None:
    grade = grade_choice(text, "B", "ABCD")
    assert grade.extracted == expected
    assert grade.reward == (1.0 if expected == "B" else 0.0)


def test_grade_choice_rejects_an_answer_outside_the_options() -> None:
    with pytest.raises(ValueError, match="answer 'E' is not one of the option letters"):
        grade_choice("\\boxed{E}", "E", "ABCD")


def test_extract_boxed_balances_nested_braces() -> None:
    assert extract_boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"


def test_final_assistant_text_takes_the_last_assistant_message() -> None:
    output = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "first"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "clip"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "\\boxed{A}"}]},
        {"type": "function_call_output", "call_id": "c", "output": "x"},
    ]
    assert final_assistant_text(output) == "\\boxed{A}"
    assert final_assistant_text([]) == ""


def test_video_mcqa_rows_reference_clips_under_the_media_root(tmp_path: Path) -> None:
    rows = video_mcqa_rows(tmp_path, 3, seed=1, tasks=("colour", "count"))
    assert [row["task"] for row in rows] == ["colour", "count", "colour"]
    for row in rows:
        (message,) = row["responses_create_params"]["input"]
        video, text = message["content"]
        assert video["type"] == "input_video" and (tmp_path / video["video_url"]).is_file()
        assert "\\boxed{}" in text["text"] and row["answer"] in row["options"]
        assert f"{row['answer']}. {row['options'][row['answer']]}" in text["text"]


def test_video_segments_rows_answer_is_the_decoded_colour_sequence(tmp_path: Path) -> None:
    (row,) = video_segments_rows(tmp_path, 1, seed=3, num_segments=3)
    params = row["responses_create_params"]
    assert [tool["name"] for tool in params["tools"]] == ["watch_segment"]
    assert params["tools"][0]["parameters"]["properties"]["segment"]["enum"] == [1, 2, 3]
    # The prompt shows no video: the segments come from the environment.
    assert all(part["type"] == "input_text" for part in params["input"][0]["content"])
    colours = []
    for segment in row["segments"]:
        with av.open(tmp_path / segment) as container:
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
        colours.append(next(c for c in map(classify_colour, frames) if c != "black"))
    assert row["options"][row["answer"]] == ", ".join(colours)
    assert len(set(row["options"].values())) == len(row["options"]) == 4
    assert all(colour in SATURATED_COLOURS for colour in colours)


def _clip_colour(path: Path) -> str:
    with av.open(path) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    (colour,) = set(map(classify_colour, frames))  # whole clips: one colour in every frame
    return colour


def test_video_segments_rows_can_be_canonical_and_whole(tmp_path: Path) -> None:
    rows = video_segments_rows(tmp_path, 6, seed=1, num_segments=2, canonical_options=True, whole_clips=True)
    for row in rows:
        assert list(row["options"].values()) == sorted(row["options"].values())
        colours = [_clip_colour(tmp_path / segment) for segment in row["segments"]]
        assert row["options"][row["answer"]] == ", ".join(colours)


def test_a_segment_question_needs_the_named_segment_s_clip(tmp_path: Path) -> None:
    rows = video_segment_question_rows(tmp_path, 24, seed=2, num_segments=3, num_options=5)
    assert {row["named_segment"] for row in rows} == {1, 2, 3}
    texts = [row["responses_create_params"]["input"][0]["content"][0]["text"] for row in rows]
    # The named segment is the prompt's only number, and the text after it is the same in every
    # row: it sits a fixed distance before the model's call.
    assert [[c for c in text if c.isdigit()] for text in texts] == [
        [str(row["named_segment"])] for row in rows
    ]
    after_the_number = {
        text.split(f"segment {row['named_segment']}")[1] for text, row in zip(texts, rows, strict=True)
    }
    assert len(after_the_number) == 1
    for row in rows:
        params = row["responses_create_params"]
        assert params["tool_choice"] == "auto" and params["tools"][0]["name"] == "watch_segment"
        assert all(part["type"] == "input_text" for part in params["input"][0]["content"])
        assert f"segment {row['named_segment']}?" in params["input"][0]["content"][0]["text"]
        colours = [_clip_colour(tmp_path / segment) for segment in row["segments"]]
        assert len(set(colours)) == 3  # any other segment answers wrong
        assert row["options"][row["answer"]] == colours[row["named_segment"] - 1]
        assert set(colours) <= set(row["options"].values()) and len(row["options"]) == 5
        assert list(row["options"].values()) == sorted(row["options"].values())
        assert row["shown_segment"] is None


def test_a_last_segment_question_is_answered_by_the_last_clip_only(tmp_path: Path) -> None:
    rows = video_last_segment_rows(tmp_path, 30, seed=5, num_segments=3, num_options=6)
    assert {row["answer"] for row in rows} == set("ABCDEF")
    for row in rows:
        params = row["responses_create_params"]
        assert all(part["type"] == "input_text" for part in params["input"][0]["content"])  # no video
        assert row["options"] == dict(zip("ABCDEF", sorted(SATURATED_COLOURS), strict=True))
        colours = [_clip_colour(tmp_path / segment) for segment in row["segments"]]
        assert colours == row["segment_colours"]
        assert row["options"][row["answer"]] == colours[-1]
        assert len(set(colours)) == 3  # the earlier clips never show the answer
    # The same prompt in every row: only the clips differ.
    assert len({row["responses_create_params"]["input"][0]["content"][0]["text"] for row in rows}) == 1


def test_blank_later_clips_hide_the_answer(tmp_path: Path) -> None:
    shown = video_last_segment_rows(tmp_path / "shown", 8, seed=5, num_options=4)
    blank = video_last_segment_rows(tmp_path / "blank", 8, seed=5, num_options=4, later_clips="blank")
    assert {text for row in shown for text in row["options"].values()} <= set(SATURATED_COLOURS[:4])
    for a, b in zip(shown, blank, strict=True):
        assert (a["answer"], a["segment_colours"]) == (b["answer"], b["segment_colours"])
        assert a["segments"][0] == b["segments"][0]
        assert _clip_colour(tmp_path / "blank" / b["segments"][1]) == "black"
        assert _clip_colour(tmp_path / "shown" / a["segments"][1]) == a["options"][a["answer"]]


def test_earlier_segments_can_show_only_colours_that_are_no_option(tmp_path: Path) -> None:
    rows = video_last_segment_rows(
        tmp_path, 16, seed=6, num_segments=3, num_options=4, earlier_colours="non_option"
    )
    for row in rows:
        *earlier, last = [_clip_colour(tmp_path / segment) for segment in row["segments"]]
        assert set(earlier) <= set(SATURATED_COLOURS) - set(row["options"].values())
        assert row["options"][row["answer"]] == last
    with pytest.raises(ValueError, match="num_options below 6"):
        video_last_segment_rows(tmp_path, 1, seed=0, num_options=6, earlier_colours="non_option")


def test_still_segments_are_returned_as_images_of_the_frame_their_clip_repeats(tmp_path: Path) -> None:
    clips = video_last_segment_rows(tmp_path / "clips", 6, seed=5, num_segments=3, num_options=4)
    mixed = video_last_segment_rows(
        tmp_path / "mixed", 6, seed=5, num_segments=3, num_options=4, still_segments=(1, 3)
    )
    for a, b in zip(clips, mixed, strict=True):
        assert (a["answer"], a["segment_colours"]) == (b["answer"], b["segment_colours"])
        assert b["segments"][1] == a["segments"][1] and b["segments"][1].endswith(".mp4")
        for k in (0, 2):
            still, clip = tmp_path / "mixed" / b["segments"][k], tmp_path / "clips" / a["segments"][k]
            assert still.suffix == ".png"
            with av.open(clip) as container:
                first = next(container.decode(video=0)).to_ndarray(format="rgb24")
            image = np.asarray(Image.open(still).convert("RGB"))
            assert image.shape == first.shape and classify_colour(image) == _clip_colour(clip)
        parts = [segment_tool_output(b["segments"], k)[1] for k in (1, 2, 3)]
        assert [part["type"] for part in parts] == ["input_image", "input_video", "input_image"]
        assert parts[0] == {"type": "input_image", "image_url": b["segments"][0], "detail": "auto"}
    with pytest.raises(ValueError, match="still_segments must be segment numbers between 1 and 2"):
        video_last_segment_rows(tmp_path, 1, seed=0, num_options=4, still_segments=(3,))


def test_a_shown_fraction_of_segment_questions_carries_the_named_clip(tmp_path: Path) -> None:
    rows = video_segment_question_rows(tmp_path, 40, seed=4, shown_fraction=0.5)
    shown = [row for row in rows if row["shown_segment"] is not None]
    assert 10 <= len(shown) <= 30
    for row in shown:
        (video, text) = row["responses_create_params"]["input"][0]["content"]
        assert video == {"type": "input_video", "video_url": row["segments"][row["named_segment"] - 1]}
        assert f"segment {row['named_segment']} is shown here" in text["text"]
    with pytest.raises(ValueError, match="shown_fraction"):
        video_segment_question_rows(tmp_path, 1, seed=0, shown_fraction=1.5)
    with pytest.raises(ValueError, match="num_options must be between num_segments"):
        video_segment_question_rows(tmp_path, 1, seed=0, num_segments=3, num_options=2)


def test_a_same_colour_fraction_of_segment_questions_shows_the_answer_in_every_segment(
    tmp_path: Path,
) -> None:
    plain = video_segment_question_rows(tmp_path, 40, seed=5, num_segments=3)
    rows = video_segment_question_rows(tmp_path, 40, seed=5, num_segments=3, same_colour_fraction=0.5)
    same = [row for row in rows if row["same_colour"]]
    assert 10 <= len(same) <= 30 and not any(row["same_colour"] for row in plain)
    for row, before in zip(rows, plain, strict=True):
        colours = [_clip_colour(tmp_path / segment) for segment in row["segments"]]
        assert row["options"][row["answer"]] == colours[row["named_segment"] - 1]
        assert len(row["options"]) == 6 and list(row["options"].values()) == sorted(row["options"].values())
        if row["same_colour"]:
            assert len(set(colours)) == 1  # any call shows the answer
        else:  # the other rows are the ones drawn without the option
            assert row == before and len(set(colours)) == 3
    with pytest.raises(ValueError, match="same_colour_fraction"):
        video_segment_question_rows(tmp_path, 1, seed=0, same_colour_fraction=-0.1)


def test_rows_are_deterministic_and_round_trip_jsonl(tmp_path: Path) -> None:
    first = video_segments_rows(tmp_path / "a", 2, seed=5)
    second = video_segments_rows(tmp_path / "b", 2, seed=5)
    assert first == second
    assert read_rows_jsonl(write_rows_jsonl(first, tmp_path / "rows.jsonl")) == first


def test_segment_tool_output_is_a_caption_and_the_clip() -> None:
    assert segment_tool_output(["s/1.mp4", "s/2.mp4"], 2) == [
        {"type": "input_text", "text": "Segment 2 of 2:"},
        {"type": "input_video", "video_url": "s/2.mp4"},
    ]
    with pytest.raises(ValueError, match="segment must be between 1 and 2, got 3"):
        segment_tool_output(["s/1.mp4", "s/2.mp4"], 3)


@pytest.mark.parametrize(
    ("reference", "part_type"),
    [
        ("s/1.PNG", "input_image"),
        ("file:///m/s/1.jpg?v=2", "input_image"),
        ("data:image/png;base64,AAAA", "input_image"),
        ("s/1.mp4", "input_video"),
        ("s/png.webm", "input_video"),
        ("data:video/mp4;base64,AAAA", "input_video"),
    ],
)
def test_segment_tool_output_returns_a_still_as_an_image(reference: str, part_type: str) -> None:
    (_, part) = segment_tool_output([reference], 1)
    if part_type == "input_image":  # Gym's response schema requires an image part's detail
        assert part == {"type": part_type, "image_url": reference, "detail": "auto"}
    else:
        assert part == {"type": part_type, "video_url": reference}


def test_row_generators_reject_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n must be >= 1"):
        video_mcqa_rows(tmp_path, 0, seed=0)
    with pytest.raises(ValueError, match="num_options must be between 2 and"):
        video_segments_rows(tmp_path, 1, seed=0, num_segments=1, num_options=7)
