"""The video environments' rows: their request shapes, the ``watch_segment`` tool, JSONL files.

Two environments, each a Gym resources server shipped with this package:

- ``video_mcqa``: one clip in the prompt and a multiple-choice question about it
  (:func:`mcqa_row`); the verifier grades the ``\\boxed{X}`` letter of the final answer.
- ``video_segments``: a video split into segments that the prompt does not show. The model calls
  the tool ``watch_segment`` (:func:`watch_segment_tool`) and the environment returns that
  segment's clip (:func:`segment_tool_output`); the question needs every segment, or names one of
  them (the model must choose which segment to watch, and when to stop watching). Graded like
  ``video_mcqa``. A segment may be a still frame instead of a clip (its reference an image): the
  environment then returns an image in that turn and clips in the others, so one trajectory holds
  both kinds of media.

Rows are Gym dataset rows: ``responses_create_params`` (the request) plus the verifier's fields.
Clips are written under the media root and referenced by their path relative to it, as a
schemeless URL (``{"type": "input_video", "video_url": "video_mcqa/colour-s0-00000.mp4"}``), which
Gym's request schema accepts; a dataset thus moves with its media root. The video model server
resolves the references (see :mod:`gym_video_env.handlers`).

Generators that write clips and their rows are found by name in the entry point group
:data:`ROW_GENERATORS_GROUP` (:func:`row_generator`); this distribution's demo
(``video_grpo_demo.rows``) registers ``video_mcqa`` and ``video_segments``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Final

from gym_video_env.grading import BOXED_INSTRUCTION

__all__ = [
    "ROW_GENERATORS_GROUP",
    "WATCH_SEGMENT_TOOL_NAME",
    "RowGenerator",
    "mcqa_row",
    "read_rows_jsonl",
    "row_generator",
    "segment_tool_output",
    "segments_request",
    "watch_segment_tool",
    "write_rows_jsonl",
]

WATCH_SEGMENT_TOOL_NAME: Final = "watch_segment"
# A segment reference with one of these suffixes (or a data:image/ URL) is a still frame.
_IMAGE_SUFFIXES: Final = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
ROW_GENERATORS_GROUP: Final = "gym_video_env.row_generators"
"""Entry point group of the row generators, by environment name (``python -m gym_video_env.datasets
generate NAME``); each loads a :data:`RowGenerator`."""

RowGenerator = Callable[..., list[dict[str, Any]]]
"""``generator(media_root, n, *, seed) -> rows``: writes the clips of ``n`` rows under
``media_root`` and returns the rows."""


def row_generator(name: str) -> RowGenerator:
    """The row generator registered as ``name`` in :data:`ROW_GENERATORS_GROUP`.

    Raises:
        LookupError: no entry point of that name is installed (the message names the group, the
            name and the names installed).
    """
    found = metadata.entry_points(group=ROW_GENERATORS_GROUP, name=name)
    if not found:
        installed = sorted(ep.name for ep in metadata.entry_points(group=ROW_GENERATORS_GROUP))
        raise LookupError(
            f"no row generator {name!r}: entry point group {ROW_GENERATORS_GROUP!r} has "
            f"{', '.join(installed) or 'no entry points'} (the demo's are declared in video-grpo's "
            "pyproject.toml: reinstall the package)"
        )
    return next(iter(found)).load()


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


def watch_segment_tool(num_segments: int) -> dict[str, Any]:
    """The Responses-API function tool ``watch_segment`` for a video of ``num_segments`` segments."""
    return {
        "type": "function",
        "name": WATCH_SEGMENT_TOOL_NAME,
        "description": "Show one segment of the video; its clip comes in the next turn.",
        "parameters": {
            "type": "object",
            "properties": {"segment": {"type": "integer", "enum": list(range(1, num_segments + 1))}},
            "required": ["segment"],
            "additionalProperties": False,
        },
        "strict": True,
    }


def segments_request(prompt: str, num_segments: int) -> dict[str, Any]:
    """The request of a segments row: the question as text (no video: the environment returns
    the clips) and the ``watch_segment`` tool."""
    text = f"{prompt}\n{BOXED_INSTRUCTION}"
    return {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}],
        "tools": [watch_segment_tool(num_segments)],
    }


def segment_tool_output(segments: Sequence[str], segment: int) -> list[dict[str, Any]]:
    """The content parts ``watch_segment`` returns for ``segment`` (1-based): a caption and the clip,
    or the still frame when the segment's reference is an image (a file with an image suffix,
    ``.png``, ``.jpg``..., or a ``data:image/`` URL): an ``input_image`` part then, with the
    ``detail`` that Gym's response schema (OpenAI's) requires of image parts.

    Raises:
        ValueError: ``segment`` is not between 1 and ``len(segments)``.
    """
    if not 1 <= segment <= len(segments):
        raise ValueError(f"segment must be between 1 and {len(segments)}, got {segment}")
    reference = segments[segment - 1]
    media = (
        {"type": "input_image", "image_url": reference, "detail": "auto"}
        if _is_image(reference)
        else {"type": "input_video", "video_url": reference}
    )
    return [{"type": "input_text", "text": f"Segment {segment} of {len(segments)}:"}, media]


def _is_image(reference: str) -> bool:
    if reference[:11].lower() == "data:image/":
        return True
    path = reference.split("?", 1)[0].split("#", 1)[0]
    return path.lower().endswith(_IMAGE_SUFFIXES)


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
