"""The dataset command line: convert video-QA formats to Gym rows, validate rows, generate synthetic rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gym_video_env.datasets import main, validate_row
from gym_video_env.environments import read_rows_jsonl, write_rows_jsonl
from gym_video_env.hookspecs import MediaSettings
from video_grpo_demo.rows import video_mcqa_rows
from video_grpo_demo.synthetic import indexed_frames, write_video

pytestmark = pytest.mark.unit


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "videos").mkdir(parents=True)
    write_video(root / "videos" / "v1.mp4", indexed_frames(4, width=64, height=64), fps=4)
    (root / "videos" / "broken.mp4").write_bytes(b"not a video at all")
    return root


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _video(row: dict[str, Any]) -> str:
    return row["responses_create_params"]["input"][0]["content"][0]["video_url"]


def test_convert_video_r1_json(media_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = [
        {
            "problem_id": 7,
            "problem": "What is shown?",
            "data_type": "video",
            "problem_type": "multiple choice",
            "options": ["A. a cat", "B. a dog"],
            "solution": "<answer>B</answer>",
            "path": "videos/v1.mp4",
        },
        {"problem": "Image question", "data_type": "image", "solution": "A", "path": "x.png"},
        {"problem": "Missing path", "data_type": "video", "solution": "<answer>A</answer>"},
    ]
    source = tmp_path / "video_r1.json"
    source.write_text(json.dumps(records))
    out = tmp_path / "rows.jsonl"
    status, stdout, stderr = _run(
        ["convert", "--format", "video-r1", str(source), str(out), "--media-root", str(media_root)], capsys
    )
    assert status == 1
    assert "wrote 1 rows" in stdout and "2 records could not be converted" in stdout
    assert f"{source}:2: data_type is 'image'" in stderr
    assert f"{source}:3: missing field 'path'" in stderr
    (row,) = read_rows_jsonl(out)
    assert row["task_id"] == "7" and row["answer"] == "B" and row["options"] == {"A": "a cat", "B": "a dog"}
    assert _video(row) == "videos/v1.mp4"
    assert "B. a dog" in row["responses_create_params"]["input"][0]["content"][1]["text"]


def test_convert_nextqa_csv_with_absolute_video_paths(
    media_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "nextqa.csv"
    source.write_text(
        "video,question,answer,qid,type,a0,a1,a2,a3,a4\n"
        "v1,why did the boy run,2,3,CW,a,b,c,d,e\n"
        "v1,what next,9,4,TN,a,b,c,d,e\n"
        "missing,who,0,5,DO,a,b,c,d,e\n"
    )
    out = tmp_path / "rows.jsonl"
    template = f"{media_root}/videos/{{video}}.mp4"
    status, _, stderr = _run(
        ["convert", "--format", "nextqa", str(source), str(out), "--media-root", str(media_root)]
        + ["--video-template", template],
        capsys,
    )
    assert status == 1
    assert f"{source}:3: answer index 9 is not one of the 5 options" in stderr
    assert f"{source}:4: " in stderr and "no such file" in stderr
    (row,) = read_rows_jsonl(out)
    assert row["task_id"] == "v1-3" and row["answer"] == "C" and list(row["options"]) == list("ABCDE")
    assert _video(row) == "videos/v1.mp4"


def test_convert_generic_jsonl_rejects_videos_outside_the_root(
    media_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "elsewhere.mp4").write_bytes(b"\x00")
    lines = [
        {"prompt": "Colour?", "video": "videos/v1.mp4", "answer": "A", "options": ["red", "blue"]},
        "{not json",
        {"prompt": "Escape", "video": "../elsewhere.mp4", "answer": "A"},
        {"prompt": "Bad answer", "video": "videos/v1.mp4", "answer": "C", "options": {"A": "x", "B": "y"}},
        {"prompt": "Free form", "video": "videos/v1.mp4", "answer": "a red square"},
    ]
    source = tmp_path / "generic.jsonl"
    source.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "rows.jsonl"
    status, _, stderr = _run(
        ["convert", "--format", "generic", str(source), str(out), "--media-root", str(media_root)], capsys
    )
    assert status == 1
    assert f"{source}:2: invalid JSON" in stderr
    assert f"{source}:3: " in stderr and "outside the media root" in stderr
    assert f"{source}:4: answer 'C' is not one of the option letters ['A', 'B']" in stderr
    first, free_form = read_rows_jsonl(out)
    assert first["options"] == {"A": "red", "B": "blue"}
    assert "options" not in free_form and free_form["answer"] == "a red square"


def test_validate_reports_each_bad_row_with_its_line(
    media_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = video_mcqa_rows(media_root, 1, seed=0, tasks=("colour",))[0]

    def with_video(reference: str) -> dict[str, Any]:
        row = json.loads(json.dumps(good))
        row["responses_create_params"]["input"][0]["content"][0]["video_url"] = reference
        return row

    bad_answer = {**good, "answer": "Z"}
    rows = [
        good,
        with_video("videos/broken.mp4"),
        with_video("../../etc/passwd"),
        bad_answer,
        {"no": "params"},
    ]
    path = write_rows_jsonl(rows, tmp_path / "rows.jsonl")
    status, stdout, stderr = _run(["validate", str(path), "--media-root", str(media_root)], capsys)
    assert status == 1
    assert "5 rows, 1 valid, 4 invalid" in stdout
    assert f"{path}:2: input[0].content[0]: videos/broken.mp4: does not decode" in stderr
    assert f"{path}:3: input[0].content[0]: ../../etc/passwd: resolves to" in stderr
    assert f"{path}:4: answer 'Z' is not one of the option letters" in stderr
    assert f"{path}:5: missing responses_create_params" in stderr
    # Without decoding, the broken file passes (it exists inside the root).
    status, stdout, _ = _run(["validate", str(path), "--media-root", str(media_root), "--no-decode"], capsys)
    assert "5 rows, 2 valid, 3 invalid" in stdout


def test_validate_row_checks_size_limits(media_root: Path) -> None:
    row = video_mcqa_rows(media_root, 1, seed=0, tasks=("colour",))[0]
    assert validate_row(row, MediaSettings(media_root=media_root)) == []
    (problem,) = validate_row(row, MediaSettings(media_root=media_root, max_video_bytes=10), decode=False)
    assert "more than the limit of 10 bytes" in problem


def test_generate_writes_rows_that_validate(
    media_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "segments.jsonl"
    status, stdout, _ = _run(
        ["generate", "video_segments", str(out), "--media-root", str(media_root), "-n", "2"], capsys
    )
    assert status == 0 and "wrote 2 rows" in stdout
    rows = read_rows_jsonl(out)
    assert len(rows) == 2 and all(
        (media_root / segment).is_file() for row in rows for segment in row["segments"]
    )
    status, stdout, _ = _run(["validate", str(out), "--media-root", str(media_root)], capsys)
    assert status == 0 and "2 rows, 2 valid, 0 invalid" in stdout
