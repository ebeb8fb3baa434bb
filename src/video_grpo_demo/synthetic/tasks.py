"""Seeded multiple-choice video tasks whose answers can be checked from the decoded frames.

Tasks:

- ``"colour"``: which colour (apart from black) appears; either the whole clip is that colour or
  only its last one or two frames are (the rest black), which catches samplers that skip the end.
- ``"count"``: how many times the screen flashes a colour; flashes of other colours distract, and
  every flash is separated from the next by at least one black frame.
- ``"order"``: in which order a circle, a square and a triangle appear.

A clip depends only on ``(task, seed, index)`` and the :class:`ClipConfig`, so clip ``i`` is the
same whatever ``n`` was asked for, and two runs with one seed write identical files.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, model_validator

from video_grpo_demo.synthetic.frames import (
    SATURATED_COLOURS,
    SHAPES,
    ColourName,
    Frame,
    ShapeName,
    shape_frame,
    solid_frame,
)
from video_grpo_demo.synthetic.writer import write_video

__all__ = [
    "TASKS",
    "ClipConfig",
    "TaskName",
    "TaskRecord",
    "generate_task_clips",
    "make_task_clip",
    "read_records_jsonl",
    "write_records_jsonl",
]

TaskName = Literal["colour", "count", "order"]
TASKS: Final[tuple[TaskName, ...]] = get_args(TaskName)
_TASK_STREAM: Final = {task: number for number, task in enumerate(TASKS)}
"""Mixed into the seed so that one seed gives unrelated clips for different tasks."""
_LETTERS: Final = "ABCDEFGH"
_MAX_FLASHES: Final = 5


@dataclass(frozen=True)
class ClipConfig:
    """Geometry, timing and encoding of generated clips."""

    width: int = 112
    """Frame width in pixels (>= 32)."""
    height: int = 112
    """Frame height in pixels (>= 32)."""
    num_frames: int = 16
    """Frames per clip (>= 5: the order task needs three shapes and two blank frames)."""
    fps: float = 8.0
    """Frame rate in frames per second."""
    num_options: int = 4
    """Multiple-choice options per question, 2 to 6 (lettered A, B, C...)."""
    codec: str | None = None
    """FFmpeg encoder; ``None`` means :func:`video_grpo_demo.synthetic.writer.default_codec`."""
    suffix: str = ".mp4"
    """File suffix, which also picks the container."""

    def __post_init__(self) -> None:
        if self.width < 32 or self.height < 32:
            raise ValueError(f"clips must be at least 32x32 pixels, got {self.width}x{self.height}")
        if self.num_frames < 5:
            raise ValueError(f"num_frames must be >= 5, got {self.num_frames}")
        if self.fps <= 0:
            raise ValueError(f"fps must be positive, got {self.fps}")
        if not 2 <= self.num_options <= 6:
            raise ValueError(f"num_options must be between 2 and 6, got {self.num_options}")
        if not self.suffix.startswith("."):
            raise ValueError(f"suffix must start with '.', got {self.suffix!r}")


class TaskRecord(BaseModel):
    """One generated question about one clip; :meth:`to_dict` gives a JSON-ready dataset row."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    """``"<task>-s<seed>-<index:05d>"``, also the clip's file stem."""
    task: TaskName
    seed: int
    index: int
    video: str
    """Clip file name, relative to the directory the clips were generated into."""
    question: str
    options: dict[str, str]
    """Option letter (``"A"``, ``"B"``...) -> option text, in letter order."""
    answer: str
    """Letter of the correct option."""
    metadata: dict[str, Any]
    """Ground truth per frame (``frame_colours`` or ``frame_shapes``), task parameters and clip geometry."""

    @model_validator(mode="after")
    def _check_options(self) -> TaskRecord:
        expected = list(_LETTERS[: len(self.options)])
        if list(self.options) != expected:
            raise ValueError(f"options must be lettered {expected}, got {list(self.options)}")
        if self.answer not in self.options:
            raise ValueError(f"answer {self.answer!r} is not one of the options {list(self.options)}")
        return self

    @property
    def answer_text(self) -> str:
        """Text of the correct option."""
        return self.options[self.answer]

    @property
    def prompt(self) -> str:
        """The question followed by one ``"A. text"`` line per option."""
        lines = [self.question, *(f"{letter}. {text}" for letter, text in self.options.items())]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of all fields."""
        return self.model_dump(mode="json")


@dataclass(frozen=True)
class _Clip:
    frames: list[Frame]
    question: str
    options: list[str]
    """Option texts in presentation order; ``options[correct]`` is the answer."""
    correct: int
    metadata: dict[str, Any]


_Option = TypeVar("_Option", bound=str)


def _pick_others(
    rng: np.random.Generator, pool: Sequence[_Option], exclude: str, count: int
) -> list[_Option]:
    """``count`` distinct items of ``pool`` other than ``exclude``, in random order."""
    others = [item for item in pool if item != exclude]
    return [others[i] for i in rng.choice(len(others), size=count, replace=False)]


def _shuffled_options(
    rng: np.random.Generator, correct: str, distractors: list[str]
) -> tuple[list[str], int]:
    options = [correct, *distractors]
    order = rng.permutation(len(options))
    shuffled = [options[i] for i in order]
    return shuffled, shuffled.index(correct)


def _colour_clip(rng: np.random.Generator, config: ClipConfig) -> _Clip:
    colour: ColourName = SATURATED_COLOURS[int(rng.integers(len(SATURATED_COLOURS)))]
    tail_only = bool(rng.integers(2))
    tail = int(rng.integers(1, 3)) if tail_only else config.num_frames
    labels: list[ColourName] = ["black"] * (config.num_frames - tail) + [colour] * tail
    options, correct = _shuffled_options(
        rng, colour, _pick_others(rng, SATURATED_COLOURS, colour, config.num_options - 1)
    )
    return _Clip(
        frames=[solid_frame(label, width=config.width, height=config.height) for label in labels],
        question="Apart from black, which colour appears in this video?",
        options=options,
        correct=correct,
        metadata={"colour": colour, "tail_only": tail_only, "frame_colours": labels},
    )


def _count_clip(rng: np.random.Generator, config: ClipConfig) -> _Clip:
    n = config.num_frames
    colour: ColourName = SATURATED_COLOURS[int(rng.integers(len(SATURATED_COLOURS)))]
    max_count = min(_MAX_FLASHES, (n + 1) // 2)  # one-frame flashes with one-frame gaps
    count = int(rng.integers(1, max_count + 1))
    distractors = _pick_others(rng, SATURATED_COLOURS, colour, int(rng.integers(0, 3)))
    events: list[ColourName] = [colour] * count + distractors
    events = [events[i] for i in rng.permutation(len(events))]
    lengths = [int(v) for v in rng.integers(1, 3, size=len(events))]

    def frames_needed() -> int:
        return sum(lengths) + len(events) - 1

    # Shorten two-frame flashes, then drop distractors, until the flashes and gaps fit the clip.
    while frames_needed() > n and 2 in lengths:
        lengths[lengths.index(2)] = 1
    while frames_needed() > n:
        drop = max(i for i, event in enumerate(events) if event != colour)
        del events[drop], lengths[drop]
    # Share the spare frames among the leading gap, the gaps between flashes and the trailing gap.
    extra = rng.multinomial(n - frames_needed(), [1 / (len(events) + 1)] * (len(events) + 1))
    labels: list[ColourName] = ["black"] * int(extra[0])
    for position, (event, length) in enumerate(zip(events, lengths, strict=True)):
        labels += [event] * length
        gap = int(extra[position + 1]) + (1 if position < len(events) - 1 else 0)
        labels += ["black"] * gap

    candidates = [str(v) for v in range(1, max(max_count, config.num_options) + 1)]
    chosen = sorted([str(count), *_pick_others(rng, candidates, str(count), config.num_options - 1)], key=int)
    return _Clip(
        frames=[solid_frame(label, width=config.width, height=config.height) for label in labels],
        question=f"How many times does the screen flash {colour}?",
        options=chosen,
        correct=chosen.index(str(count)),
        metadata={
            "colour": colour,
            "count": count,
            "distractor_colours": [event for event in events if event != colour],
            "frame_colours": labels,
        },
    )


def _order_clip(rng: np.random.Generator, config: ClipConfig) -> _Clip:
    order: list[ShapeName] = [SHAPES[i] for i in rng.permutation(len(SHAPES))]
    colours = _pick_others(rng, SATURATED_COLOURS, "black", len(SHAPES))
    # One blank frame between shapes; the remaining frames are shared as evenly as possible.
    shown = config.num_frames - (len(SHAPES) - 1)
    lengths = [shown // len(SHAPES)] * len(SHAPES)
    for i in rng.choice(len(SHAPES), size=shown % len(SHAPES), replace=False):
        lengths[i] += 1
    frames: list[Frame] = []
    labels: list[ShapeName | None] = []
    blank = solid_frame("black", width=config.width, height=config.height)
    for position, (shape, colour, length) in enumerate(zip(order, colours, lengths, strict=True)):
        if position:
            frames.append(blank)
            labels.append(None)
        drawn = shape_frame(shape, colour, width=config.width, height=config.height)
        frames += [drawn] * length
        labels += [shape] * length

    def text(shapes: Iterable[str]) -> str:
        return ", ".join(shapes)

    permutations = [text(p) for p in itertools.permutations(SHAPES)]
    options, correct = _shuffled_options(
        rng, text(order), _pick_others(rng, permutations, text(order), config.num_options - 1)
    )
    return _Clip(
        frames=frames,
        question="In which order do the shapes appear?",
        options=options,
        correct=correct,
        metadata={"shapes": order, "shape_colours": colours, "frame_shapes": labels},
    )


_BUILDERS: Final = {"colour": _colour_clip, "count": _count_clip, "order": _order_clip}


def make_task_clip(
    task: TaskName,
    out_dir: str | os.PathLike[str],
    *,
    seed: int,
    index: int,
    config: ClipConfig | None = None,
) -> TaskRecord:
    """Write clip ``index`` of ``task`` for ``seed`` into ``out_dir`` and return its record.

    The clip is a pure function of ``(task, seed, index, config)``.
    """
    if task not in _BUILDERS:
        raise ValueError(f"unknown task {task!r}; supported tasks are {', '.join(TASKS)}")
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be >= 0, got seed={seed}, index={index}")
    config = config or ClipConfig()
    rng = np.random.default_rng([seed, index, _TASK_STREAM[task]])
    clip = _BUILDERS[task](rng, config)
    record_id = f"{task}-s{seed}-{index:05d}"
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    written = write_video(
        directory / f"{record_id}{config.suffix}", clip.frames, fps=config.fps, codec=config.codec
    )
    return TaskRecord(
        id=record_id,
        task=task,
        seed=seed,
        index=index,
        video=written.path.name,
        question=clip.question,
        options=dict(zip(_LETTERS, clip.options, strict=False)),
        answer=_LETTERS[clip.correct],
        metadata={
            **clip.metadata,
            "num_frames": written.num_frames,
            "fps": written.fps,
            "width": written.width,
            "height": written.height,
            "codec": written.codec,
        },
    )


def generate_task_clips(
    out_dir: str | os.PathLike[str], n: int, task: TaskName, seed: int, *, config: ClipConfig | None = None
) -> list[TaskRecord]:
    """Write clips ``0..n-1`` of ``task`` for ``seed`` into ``out_dir`` (created if missing).

    File names are ``<task>-s<seed>-<index:05d><suffix>``; see :func:`make_task_clip`.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 clip, got {n}")
    return [make_task_clip(task, out_dir, seed=seed, index=index, config=config) for index in range(n)]


def write_records_jsonl(records: Iterable[TaskRecord], path: str | os.PathLike[str]) -> Path:
    """Write one JSON object per line (:meth:`TaskRecord.to_dict`) and return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record.to_dict(), sort_keys=True) + "\n")
    return out


def read_records_jsonl(path: str | os.PathLike[str]) -> list[TaskRecord]:
    """Read records written by :func:`write_records_jsonl` (validated; blank lines are skipped)."""
    with Path(path).open(encoding="utf-8") as handle:
        return [TaskRecord.model_validate_json(line) for line in handle if line.strip()]
