"""Rows of the video environments built from synthetic clips with verifiable answers.

Each generator writes its clips under a media root and returns rows of ``video_mcqa`` or
``video_segments`` (shapes: :mod:`gym_video_env.environments`):

- :func:`video_mcqa_rows`: one clip and a multiple-choice question about it;
- :func:`video_segments_rows`: the colours of every segment of a video the prompt does not show;
- :func:`video_segment_question_rows`: the colour of the one segment the question names;
- :func:`video_last_segment_rows`: the colour of the last segment.

``video_mcqa_rows`` and ``video_segments_rows`` are the ``video_mcqa`` and ``video_segments``
entry points of ``gym_video_env.row_generators`` (``python -m gym_video_env.datasets generate``).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
from PIL import Image

from gym_video_env.environments import (
    WATCH_SEGMENT_TOOL_NAME,
    mcqa_row,
    segments_request,
    watch_segment_tool,
)
from gym_video_env.grading import BOXED_INSTRUCTION
from video_grpo_demo.synthetic import SATURATED_COLOURS, TASKS, ClipConfig, TaskName, make_task_clip
from video_grpo_demo.synthetic.frames import solid_frame
from video_grpo_demo.synthetic.writer import write_video

__all__ = [
    "video_last_segment_rows",
    "video_mcqa_rows",
    "video_segment_question_rows",
    "video_segments_rows",
]

_LETTERS: Final = "ABCDEFGH"
# Mixed into the seed so that segment questions do not reuse the clips of video_mcqa rows.
_SEGMENTS_STREAM: Final = 101
_SEGMENT_QUESTION_STREAM: Final = 102
_SAME_COLOUR_STREAM: Final = 103
_LAST_SEGMENT_STREAM: Final = 104


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


def video_segments_rows(
    media_root: str | os.PathLike[str],
    n: int,
    *,
    seed: int,
    num_segments: int = 2,
    num_options: int = 4,
    config: ClipConfig | None = None,
    canonical_options: bool = False,
    whole_clips: bool = False,
    subdir: str = "video_segments",
) -> list[dict[str, Any]]:
    """Write ``n * num_segments`` clips under ``media_root/subdir`` and return ``n`` rows.

    Each segment shows one colour (the ``colour`` task's clips); the question asks for the colours
    of all segments in order, so an answer needs every segment. Fields besides
    ``responses_create_params`` (whose prompt has no video and whose tools hold
    :func:`watch_segment_tool`): ``task_id``, ``segments`` (clip paths relative to the media root,
    in segment order), ``options`` and ``answer``.

    ``canonical_options``: the option texts sorted (a letter then means the same sequence in every
    row that offers it) instead of shuffled; ``whole_clips``: only clips that show their colour in
    every frame (the others are skipped), instead of also clips that show it in the last frame or
    two only.
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
    index = 0
    for row in range(n):
        records = []
        while len(records) < num_segments:
            record = make_task_clip("colour", out_dir, seed=seed, index=index, config=config)
            index += 1
            if whole_clips and record.metadata["tail_only"]:
                (out_dir / record.video).unlink()
                continue
            records.append(record)
        colours = [record.metadata["colour"] for record in records]
        rng = np.random.default_rng([seed, row, _SEGMENTS_STREAM])
        options, correct = _sequence_options(rng, colours, num_options)
        if canonical_options:
            answer_text = options[correct]
            options = sorted(options)
            correct = options.index(answer_text)
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
                "responses_create_params": segments_request(prompt, num_segments),
                "task_id": f"segments-s{seed}-{row:05d}",
                "segments": [f"{subdir}/{record.video}" for record in records],
                "options": dict(zip(letters, options, strict=True)),
                "answer": letters[correct],
            }
        )
    return rows


def video_segment_question_rows(
    media_root: str | os.PathLike[str],
    n: int,
    *,
    seed: int,
    num_segments: int = 3,
    num_options: int = 6,
    config: ClipConfig | None = None,
    instruction: str = BOXED_INSTRUCTION,
    shown_fraction: float = 0.0,
    same_colour_fraction: float = 0.0,
    subdir: str = "video_segment_question",
) -> list[dict[str, Any]]:
    """``n`` rows whose question names one segment of a video the prompt does not show.

    Each row's video has ``num_segments`` segments of distinct colours, each segment one clip that
    shows its colour in every frame (one clip per colour, written once under ``media_root/subdir``).
    The question asks the colour of segment ``k``; answering needs a ``watch_segment(k)`` call (any
    other segment shows another colour), and nothing in the prompt tells the colour. The options
    are colours sorted by name, so a letter always names the same colour; they hold the answer and
    the other segments' colours. Fields besides ``responses_create_params`` (tools:
    :func:`watch_segment_tool`; ``tool_choice: "auto"``): ``task_id``, ``segments`` (clip paths
    relative to the media root, in segment order), ``named_segment`` (``k``, 1-based),
    ``shown_segment``, ``options`` and ``answer``.

    With ``shown_fraction`` > 0, about that fraction of the rows (chosen with ``seed``) show the
    named segment's clip in the prompt (``shown_segment: k``; ``None`` in the others): questions
    answerable without a call, on which a call only costs. Mixed into training rows they are
    perception data: a model that cannot yet read a clip learns to, while the other rows teach it
    to ask for the clip it needs.

    With ``same_colour_fraction`` > 0, about that fraction of the rows (chosen with ``seed``) fill
    every segment with the named colour (``same_colour: true``): any call shows the answer, in the
    turn and the position where the task shows it. Mixed into training rows they teach a model that
    cannot yet read a clip to read the one a call returns; the rows of distinct colours teach it
    which segment to ask for, a choice that pays only once it can read the clip.

    Raises:
        ValueError: ``n < 1``, fewer than 2 segments, more segments than colours,
            ``num_options`` outside ``[num_segments, number of colours]``, or ``shown_fraction``
            or ``same_colour_fraction`` outside ``[0, 1]``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 row, got {n}")
    if not 2 <= num_segments <= len(SATURATED_COLOURS):
        raise ValueError(f"num_segments must be between 2 and {len(SATURATED_COLOURS)}, got {num_segments}")
    if not num_segments <= num_options <= min(len(SATURATED_COLOURS), len(_LETTERS)):
        raise ValueError(
            f"num_options must be between num_segments={num_segments} and {len(SATURATED_COLOURS)}, "
            f"got {num_options}"
        )
    for name, fraction in (
        ("shown_fraction", shown_fraction),
        ("same_colour_fraction", same_colour_fraction),
    ):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {fraction}")
    config = config or ClipConfig()
    out_dir = Path(media_root) / subdir
    out_dir.mkdir(parents=True, exist_ok=True)
    clips: dict[str, str] = {}
    for colour in SATURATED_COLOURS:
        frames = [solid_frame(colour, width=config.width, height=config.height)] * config.num_frames
        written = write_video(
            out_dir / f"{colour}{config.suffix}", frames, fps=config.fps, codec=config.codec
        )
        clips[colour] = f"{subdir}/{written.path.name}"
    rows = []
    for row in range(n):
        rng = np.random.default_rng([seed, row, _SEGMENT_QUESTION_STREAM])
        colours = [
            SATURATED_COLOURS[i] for i in rng.choice(len(SATURATED_COLOURS), num_segments, replace=False)
        ]
        named = int(rng.integers(num_segments)) + 1
        # A stream of its own: rows without same-colour segments stay what they were.
        same = bool(np.random.default_rng([seed, row, _SAME_COLOUR_STREAM]).random() < same_colour_fraction)
        if same:
            colours = [colours[named - 1]] * num_segments
        others = [c for c in SATURATED_COLOURS if c not in colours]
        extra = [others[i] for i in rng.choice(len(others), num_options - len(set(colours)), replace=False)]
        shown = bool(rng.random() < shown_fraction)
        texts = sorted({*colours, *extra})
        letters = _LETTERS[: len(texts)]
        options = dict(zip(letters, texts, strict=True))
        # The named segment is the only number in the prompt: a count of segments beside it would
        # be a second number for a model to tell apart from the one to ask for.
        question = f"Which colour fills segment {named}?"
        if shown:
            question = f"Video segment {named} is shown here. {question}"
        # The options come first and the question last, right before the fixed instruction: the
        # segment number then sits the same number of tokens before the model's call in every
        # row, a position one attention head can learn to copy from (after options of varying
        # length it moves from row to row).
        prompt = "\n".join([*(f"{letter}. {text}" for letter, text in options.items()), question])
        content: list[dict[str, Any]] = (
            [{"type": "input_video", "video_url": clips[colours[named - 1]]}] if shown else []
        )
        content.append({"type": "input_text", "text": f"{prompt}\n{instruction}"})
        rows.append(
            {
                "responses_create_params": {
                    "input": [{"role": "user", "content": content}],
                    "tools": [watch_segment_tool(num_segments)],
                    "tool_choice": "auto",
                },
                "task_id": f"segment-question-s{seed}-{row:05d}",
                "segments": [clips[colour] for colour in colours],
                "named_segment": named,
                "shown_segment": named if shown else None,
                "same_colour": same,
                "options": options,
                "answer": next(letter for letter, text in options.items() if text == colours[named - 1]),
            }
        )
    return rows


def video_last_segment_rows(
    media_root: str | os.PathLike[str],
    n: int,
    *,
    seed: int,
    num_segments: int = 2,
    num_options: int = 6,
    config: ClipConfig | None = None,
    later_clips: Literal["shown", "blank"] = "shown",
    earlier_colours: Literal["any", "non_option"] = "any",
    still_segments: Collection[int] = (),
    subdir: str = "video_last_segment",
) -> list[dict[str, Any]]:
    """``n`` rows asking the colour of the last of ``num_segments`` segments the prompt does not show.

    Every segment is one clip filled with one colour in every frame (one clip per colour, written
    once under ``media_root/subdir``). The last segment's colour is the answer, drawn from the
    first ``num_options`` palette colours, which are the options, sorted by name (a letter always
    names the same colour). The earlier segments show distinct other colours, never the answer's:
    their clips alone do not tell it (a model that reads only the first clip answers below
    chance), and a model that reads every clip must tell which one came last.
    ``earlier_colours="non_option"``: the earlier segments show only colours that are no option
    (needs ``num_options`` below the number of colours), so a model that reads which option colour
    the clips show answers right without telling which clip came last; the answer is still in the
    last clip only.

    ``later_clips="blank"`` (the control): every segment after the first is a black clip, so the
    answer is in no clip the model sees; a model that learns from the shown task then stays at
    chance or below. Fields besides ``responses_create_params`` (no video; tools:
    :func:`watch_segment_tool`): ``task_id``, ``segments`` (clip paths relative to the media root,
    in segment order, as the environment returns them), ``segment_colours`` (what each segment
    shows before any blanking), ``options`` and ``answer``.

    ``still_segments``: segment numbers (1-based) that the environment returns as a still frame
    (an ``input_image``: a PNG of the frame the segment's clip repeats, written under
    ``media_root/subdir``) instead of the clip; the others stay clips. ``(1,)`` with two segments:
    an image in the first observed turn and a video in the next; ``(2,)``: the reverse. Such a
    trajectory needs a vLLM that takes images (``--limit-mm-per-prompt`` with ``image`` >= the
    number of stills) and trains with ``pixel_values`` for the stills and
    ``pixel_values_videos`` for the clips.

    Raises:
        ValueError: ``n < 1``, fewer than 2 or more segments than colours, ``num_options``
            outside ``[2, number of colours]`` (``earlier_colours="non_option"``: below it), or a
            still segment outside ``[1, num_segments]``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 row, got {n}")
    if not 2 <= num_segments <= len(SATURATED_COLOURS):
        raise ValueError(f"num_segments must be between 2 and {len(SATURATED_COLOURS)}, got {num_segments}")
    if not 2 <= num_options <= len(SATURATED_COLOURS):
        raise ValueError(f"num_options must be between 2 and {len(SATURATED_COLOURS)}, got {num_options}")
    if later_clips not in ("shown", "blank"):
        raise ValueError(f"later_clips must be 'shown' or 'blank', got {later_clips!r}")
    if earlier_colours not in ("any", "non_option"):
        raise ValueError(f"earlier_colours must be 'any' or 'non_option', got {earlier_colours!r}")
    if earlier_colours == "non_option" and num_options >= len(SATURATED_COLOURS):
        raise ValueError(
            f"earlier_colours='non_option' needs num_options below {len(SATURATED_COLOURS)} (a colour "
            f"that is no option), got {num_options}"
        )
    stills = set(still_segments)
    if not stills <= set(range(1, num_segments + 1)):
        raise ValueError(
            f"still_segments must be segment numbers between 1 and {num_segments}, got {sorted(stills)}"
        )
    config = config or ClipConfig()
    out_dir = Path(media_root) / subdir
    out_dir.mkdir(parents=True, exist_ok=True)
    clips: dict[str, str] = {}
    still_frames: dict[str, str] = {}
    for colour in (*SATURATED_COLOURS, "black"):
        frame = solid_frame(colour, width=config.width, height=config.height)
        written = write_video(
            out_dir / f"{colour}{config.suffix}",
            [frame] * config.num_frames,
            fps=config.fps,
            codec=config.codec,
        )
        clips[colour] = f"{subdir}/{written.path.name}"
        if stills:
            Image.fromarray(frame).save(out_dir / f"{colour}.png")
            still_frames[colour] = f"{subdir}/{colour}.png"
    texts = sorted(SATURATED_COLOURS[:num_options])
    letters = _LETTERS[: len(texts)]
    options = dict(zip(letters, texts, strict=True))
    question = (
        f"A video is split into {num_segments} segments, shown to you one at a time. "
        "Which colour fills the last segment?"
    )
    prompt = "\n".join([question, *(f"{letter}. {text}" for letter, text in options.items())])
    rows = []
    for row in range(n):
        rng = np.random.default_rng([seed, row, _LAST_SEGMENT_STREAM])
        answer = texts[int(rng.integers(len(texts)))]
        if earlier_colours == "any":
            others = [c for c in SATURATED_COLOURS if c != answer]
        else:
            others = [c for c in SATURATED_COLOURS if c not in texts]
        earlier = [
            others[i]
            for i in rng.choice(len(others), num_segments - 1, replace=num_segments - 1 > len(others))
        ]
        colours = [*earlier, answer]
        shown_colours = [c if k == 0 or later_clips == "shown" else "black" for k, c in enumerate(colours)]
        shown = [(still_frames if k + 1 in stills else clips)[c] for k, c in enumerate(shown_colours)]
        rows.append(
            {
                "responses_create_params": segments_request(prompt, num_segments),
                "task_id": f"last-segment-s{seed}-{row:05d}",
                "segments": shown,
                "segment_colours": colours,
                "options": options,
                "answer": next(letter for letter, text in options.items() if text == answer),
            }
        )
    return rows


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
