"""Task rows for the video environments, generated from synthetic clips with verifiable answers.

Two environments, each a Gym resources server shipped with this package:

- ``video_mcqa``: one clip in the prompt and a multiple-choice question about it
  (:func:`video_mcqa_rows`); the verifier grades the ``\\boxed{X}`` letter of the final answer.
- ``video_segments``: a video split into segments that the prompt does not show. The model calls
  the tool ``watch_segment`` and the environment returns that segment's clip; the question needs
  every segment (:func:`video_segments_rows`). Graded like ``video_mcqa``.

Rows are Gym dataset rows: ``responses_create_params`` (the request) plus the verifier's fields.
Clips are written under the media root and referenced by their path relative to it, as a
schemeless URL (``{"type": "input_video", "video_url": "video_mcqa/colour-s0-00000.mp4"}``), which
Gym's request schema accepts; a dataset thus moves with its media root. The video model server
resolves the references (see :mod:`gym_video_env.handlers`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from gym_video_env.grading import BOXED_INSTRUCTION
from gym_video_env.synthetic import SATURATED_COLOURS, TASKS, ClipConfig, TaskName, make_task_clip

__all__ = [
    "WATCH_SEGMENT_TOOL_NAME",
    "mcqa_row",
    "read_rows_jsonl",
    "segment_tool_output",
    "video_mcqa_rows",
    "video_segments_rows",
    "watch_segment_tool",
    "write_rows_jsonl",
]

WATCH_SEGMENT_TOOL_NAME: Final = "watch_segment"
_LETTERS: Final = "ABCDEFGH"
# Mixed into the seed so that segment questions do not reuse the clips of video_mcqa rows.
_SEGMENTS_STREAM: Final = 101


def mcqa_row(
    *, video_url: str, prompt: str, task_id: str, task: str, options: dict[str, str], answer: str
) -> dict[str, Any]:
    """One ``video_mcqa`` row: a user message with the clip then the prompt, and the verifier's fields.

    ``video_url`` is the clip's reference (a path relative to the media root, or a URL);
    ``options`` maps letters to option texts and ``answer`` is the correct letter.
    """
    content = [
        {"type": "input_video", "video_url": video_url},
        {"type": "input_text", "text": prompt},
    ]
    return {
        "responses_create_params": {"input": [{"role": "user", "content": content}]},
        "task_id": task_id,
        "task": task,
        "options": options,
        "answer": answer,
    }


def video_mcqa_rows(
    media_root: str | os.PathLike[str],
    n: int,
    *,
    seed: int,
    tasks: Sequence[TaskName] = TASKS,
    config: ClipConfig | None = None,
    subdir: str = "video_mcqa",
) -> list[dict[str, Any]]:
    """Write ``n`` clips under ``media_root/subdir`` and return one ``video_mcqa`` row per clip.

    Row ``i`` asks task ``tasks[i % len(tasks)]`` about clip ``i`` of that task. Fields besides
    ``responses_create_params``: ``task_id``, ``task``, ``options`` (letter -> text) and
    ``answer`` (the correct letter).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 row, got {n}")
    if not tasks:
        raise ValueError("tasks must name at least one task")
    rows = []
    for index in range(n):
        task = tasks[index % len(tasks)]
        record = make_task_clip(task, Path(media_root) / subdir, seed=seed, index=index, config=config)
        rows.append(
            mcqa_row(
                video_url=f"{subdir}/{record.video}",
                prompt=f"{record.prompt}\n{BOXED_INSTRUCTION}",
                task_id=record.id,
                task=record.task,
                options=record.options,
                answer=record.answer,
            )
        )
    return rows


def watch_segment_tool(num_segments: int) -> dict[str, Any]:
    """The Responses-API function tool ``watch_segment`` for a video of ``num_segments`` segments."""
    return {
        "type": "function",
        "name": WATCH_SEGMENT_TOOL_NAME,
        "description": "Watch one segment of the video. Its clip is shown to you after this call.",
        "parameters": {
            "type": "object",
            "properties": {
                "segment": {
                    "type": "integer",
                    "enum": list(range(1, num_segments + 1)),
                    "description": f"Segment number, 1 to {num_segments}.",
                }
            },
            "required": ["segment"],
            "additionalProperties": False,
        },
        "strict": True,
    }


def video_segments_rows(
    media_root: str | os.PathLike[str],
    n: int,
    *,
    seed: int,
    num_segments: int = 2,
    num_options: int = 4,
    config: ClipConfig | None = None,
    subdir: str = "video_segments",
) -> list[dict[str, Any]]:
    """Write ``n * num_segments`` clips under ``media_root/subdir`` and return ``n`` rows.

    Each segment shows one colour (the ``colour`` task's clips); the question asks for the colours
    of all segments in order, so an answer needs every segment. Fields besides
    ``responses_create_params`` (whose prompt has no video and whose tools hold
    :func:`watch_segment_tool`): ``task_id``, ``segments`` (clip paths relative to the media root,
    in segment order), ``options`` and ``answer``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 row, got {n}")
    if num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    if not 2 <= num_options <= min(len(_LETTERS), len(SATURATED_COLOURS) ** num_segments):
        raise ValueError(
            f"num_options must be between 2 and {len(_LETTERS)} and at most the number of colour "
            f"sequences ({len(SATURATED_COLOURS)}**{num_segments}), got {num_options}"
        )
    out_dir = Path(media_root) / subdir
    rows = []
    for row in range(n):
        records = [
            make_task_clip("colour", out_dir, seed=seed, index=row * num_segments + k, config=config)
            for k in range(num_segments)
        ]
        colours = [record.metadata["colour"] for record in records]
        rng = np.random.default_rng([seed, row, _SEGMENTS_STREAM])
        options, correct = _sequence_options(rng, colours, num_options)
        letters = _LETTERS[: len(options)]
        question = (
            f"A video is split into {num_segments} segments, which you have not seen. Call "
            f"{WATCH_SEGMENT_TOOL_NAME} with a segment number (1 to {num_segments}) to watch a segment. "
            "Apart from black, which colour does each segment show, in segment order?"
        )
        prompt = "\n".join(
            [question, *(f"{letter}. {text}" for letter, text in zip(letters, options, strict=True))]
        )
        rows.append(
            {
                "responses_create_params": {
                    "input": [
                        {
                            "role": "user",
                            "content": [{"type": "input_text", "text": f"{prompt}\n{BOXED_INSTRUCTION}"}],
                        }
                    ],
                    "tools": [watch_segment_tool(num_segments)],
                },
                "task_id": f"segments-s{seed}-{row:05d}",
                "segments": [f"{subdir}/{record.video}" for record in records],
                "options": dict(zip(letters, options, strict=True)),
                "answer": letters[correct],
            }
        )
    return rows


def segment_tool_output(segments: Sequence[str], segment: int) -> list[dict[str, Any]]:
    """The content parts ``watch_segment`` returns for ``segment`` (1-based): a caption and the clip.

    Raises:
        ValueError: ``segment`` is not between 1 and ``len(segments)``.
    """
    if not 1 <= segment <= len(segments):
        raise ValueError(f"segment must be between 1 and {len(segments)}, got {segment}")
    return [
        {"type": "input_text", "text": f"Segment {segment} of {len(segments)}:"},
        {"type": "input_video", "video_url": segments[segment - 1]},
    ]


def _sequence_options(
    rng: np.random.Generator, colours: Sequence[str], num_options: int
) -> tuple[list[str], int]:
    """Option texts (the correct colour sequence among distinct wrong ones) and the correct index."""
    correct = ", ".join(colours)
    wrong: set[str] = set()
    while len(wrong) < num_options - 1:
        candidate = ", ".join(
            SATURATED_COLOURS[i] for i in rng.integers(len(SATURATED_COLOURS), size=len(colours))
        )
        if candidate != correct:
            wrong.add(candidate)
    options = [correct, *sorted(wrong)]
    order = rng.permutation(len(options))
    shuffled = [options[i] for i in order]
    return shuffled, shuffled.index(correct)


def write_rows_jsonl(rows: Iterable[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write one JSON row per line and return the path (parent directories are created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True) + "\n")
    return out


def read_rows_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read the rows of a JSONL file (blank lines are skipped)."""
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
