"""The demo's tasks: rows of the three environments from synthetic clips, and bad media mixed in.

The ``video_grpo.tasks`` entry points ``mcqa``, ``segments`` and ``agentic`` load
:func:`write_task_rows`, which :func:`rl_bridge.tasks.prepare_task` calls through
:func:`rl_bridge.registry.task_rows`:

- ``mcqa``: ``video_mcqa`` rows built from the synthetic video tasks, like
  :func:`video_grpo_demo.rows.video_mcqa_rows`, with the knobs that make a tiny random model
  learnable from reward within minutes (see :class:`~rl_bridge.recipe.TaskSection`): options
  in a canonical order, the instruction of the chosen answer format, and optionally only the
  colour clips that show their colour in every frame. Optionally a fraction of the training rows
  carry bad media (:func:`with_bad_media`), which the run must mask and count;
- ``segments``: multi-turn ``video_segments`` rows (:func:`video_grpo_demo.rows.video_segments_rows`
  or :func:`~video_grpo_demo.rows.video_last_segment_rows`), each clip returned by the environment
  after a model turn;
- ``agentic``: ``video_segments`` rows whose question names one segment
  (:func:`video_grpo_demo.rows.video_segment_question_rows`): the model must call
  ``watch_segment`` for it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Final

from gym_video_env.environments import mcqa_row
from gym_video_env.grading import BOXED_INSTRUCTION, LETTER_INSTRUCTION
from rl_bridge.recipe import TaskSection
from video_grpo_demo.rows import video_last_segment_rows, video_segment_question_rows, video_segments_rows
from video_grpo_demo.synthetic import ClipConfig, make_task_clip

__all__ = ["MEDIA_FAULT_KEY", "task_rows", "with_bad_media", "write_task_rows"]

_LETTERS: Final = "ABCDEFGH"

MEDIA_FAULT_KEY: Final = "media_fault"
"""Row field of a row whose clip was replaced by bad media: the bad-input case id
(:mod:`video_grpo_demo.bad_inputs`), e.g. ``"truncated"`` or ``"missing_file"``."""
_MISSING_FILE: Final = "missing_file"
# The cases bad rows take first, so that a few bad rows already mix the common kinds of damage.
_FAULT_ORDER: Final = ("truncated", "not_a_video", _MISSING_FILE, "zero_length", "corrupt_middle")


def _clip_config(task: TaskSection) -> ClipConfig:
    return ClipConfig(
        width=task.width,
        height=task.height,
        num_frames=task.num_frames,
        fps=task.fps,
        num_options=task.num_options,
    )


def _instruction(task: TaskSection) -> str:
    return LETTER_INSTRUCTION if task.answer_format == "letter" else BOXED_INSTRUCTION


def task_rows(
    task: TaskSection, media_root: Path, n: int, *, seed: int, subdir: str, held_out: bool = False
) -> list[dict[str, Any]]:
    """Write clips under ``media_root/subdir`` and return ``n`` rows of ``task.environment``.

    ``mcqa`` rows (:func:`gym_video_env.environments.mcqa_row`) carry ``task_id``, ``task``,
    ``options`` (letter -> text) and ``answer``; with ``task.canonical_options`` the options are
    sorted by their text and relettered, so questions with the same option set always use the
    same letter for an answer. ``segments`` rows
    (:func:`video_grpo_demo.rows.video_segments_rows`) carry ``task_id``, ``segments``,
    ``options`` and ``answer``; they keep the ``watch_segment`` tool with ``tool_choice: "none"``
    (the loop's vLLM runs without a tool-call parser), so each clip arrives through the
    environment's ``/next_segment`` observation after a model turn. ``agentic`` rows
    (:func:`video_grpo_demo.rows.video_segment_question_rows`): the question names one
    segment; ``held_out`` rows never show its clip in the prompt and always have segments of
    distinct colours (``task.shown_segment_fraction`` and ``task.same_colour_fraction`` apply to
    training rows only).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"task_rows: n must be >= 1, got {n}")
    if task.environment == "segments":
        return _segments_rows(task, media_root, n, seed=seed, subdir=subdir)
    if task.environment == "agentic":
        return video_segment_question_rows(
            media_root,
            n,
            seed=seed,
            num_segments=task.num_segments,
            num_options=task.num_options,
            config=_clip_config(task),
            instruction=_instruction(task),
            shown_fraction=0.0 if held_out else task.shown_segment_fraction,
            same_colour_fraction=0.0 if held_out else task.same_colour_fraction,
            subdir=subdir,
        )
    return _mcqa_rows(task, media_root, n, seed=seed, subdir=subdir)


def _mcqa_rows(
    task: TaskSection, media_root: Path, n: int, *, seed: int, subdir: str
) -> list[dict[str, Any]]:
    config = _clip_config(task)
    rows: list[dict[str, Any]] = []
    index = 0
    while len(rows) < n:
        record = make_task_clip(task.name, media_root / subdir, seed=seed, index=index, config=config)
        index += 1
        if task.name == "colour" and task.whole_clip_only and record.metadata["tail_only"]:
            (media_root / subdir / record.video).unlink()
            continue
        texts = list(record.options.values())
        if task.canonical_options:
            texts = sorted(texts)
        options = dict(zip(_LETTERS, texts, strict=False))
        answer = next(letter for letter, text in options.items() if text == record.answer_text)
        prompt = "\n".join(
            [record.question, *(f"{letter}. {text}" for letter, text in options.items()), _instruction(task)]
        )
        rows.append(
            mcqa_row(
                video_url=f"{subdir}/{record.video}",
                prompt=prompt,
                task_id=record.id,
                task=record.task,
                options=options,
                answer=answer,
            )
        )
    return rows


def _segments_rows(
    task: TaskSection, media_root: Path, n: int, *, seed: int, subdir: str
) -> list[dict[str, Any]]:
    if task.segments_question == "last":
        rows = video_last_segment_rows(
            media_root,
            n,
            seed=seed,
            num_segments=task.num_segments,
            num_options=task.num_options,
            config=_clip_config(task),
            later_clips=task.later_clips,
            earlier_colours=task.earlier_colours,
            still_segments=task.still_segments,
            subdir=subdir,
        )
    else:
        rows = video_segments_rows(
            media_root,
            n,
            seed=seed,
            num_segments=task.num_segments,
            num_options=task.num_options,
            config=_clip_config(task),
            canonical_options=task.canonical_options,
            whole_clips=task.whole_clip_only,
            subdir=subdir,
        )
    instruction = _instruction(task)
    for row in rows:
        params = row["responses_create_params"]
        params["tool_choice"] = "none"
        if instruction != BOXED_INSTRUCTION:
            (text_part,) = params["input"][0]["content"]
            question = text_part["text"].removesuffix(BOXED_INSTRUCTION)
            if question == text_part["text"]:
                raise ValueError(
                    f"segments row {row['task_id']}: the prompt does not end with the boxed instruction"
                )
            text_part["text"] = question + instruction
    return rows


def with_bad_media(
    rows: list[dict[str, Any]], fraction: float, media_root: Path, *, seed: int, subdir: str = "bad"
) -> list[dict[str, Any]]:
    """``rows`` with ``round(fraction * len(rows))`` of them, chosen with ``seed``, pointing at bad media.

    The choice draws from ``random.Random(f"{seed}/bad_rows")``, a stream of its own: the loops
    order the rows with ``random.Random(recipe.seed)`` (sync) or ``f"{seed}/{pass}"`` (async), and
    with a shared integer seed the first pass of the sync order would visit exactly the chosen rows
    first (``Random.sample`` and ``shuffle`` then ``pop`` draw the same indices).

    The bad files are the corpus of :func:`video_grpo_demo.bad_inputs.write_bad_inputs`
    (written under ``media_root/subdir``) whose video every layer refuses (truncated, zero-length,
    audio-only, no decodable frame, over the pixel budget, unknown codec, not a video), plus a
    reference to a file that does not exist; the chosen rows take them in turn (truncated, not a
    video, missing, zero-length and corrupt first). A bad row keeps its question, options and
    answer; its ``task_id`` gets the case as suffix and :data:`MEDIA_FAULT_KEY` names the case.

    Raises:
        ValueError: ``fraction`` is not in ``[0, 1)``, or a chosen row has no ``input_video`` part.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"with_bad_media: fraction must be in [0, 1), got {fraction}")
    count = round(fraction * len(rows))
    if count == 0:
        return list(rows)
    from video_grpo_demo.bad_inputs import write_bad_inputs

    root = media_root / subdir
    corpus = write_bad_inputs(root, media_root.parent / f"{media_root.name}-{subdir}-outside")
    faults = [
        (case.id, case.path.relative_to(media_root).as_posix())
        for case in corpus
        if case.path is not None
        and case.path.parent == root / "videos"
        and case.expected.get("gym_server") == "error"
        and case.expected.get("trainer") == "error"
    ]
    faults.append((_MISSING_FILE, f"{subdir}/videos/{_MISSING_FILE}.mp4"))
    rank = {case: position for position, case in enumerate(_FAULT_ORDER)}
    faults.sort(key=lambda fault: rank.get(fault[0], len(rank)))
    chosen = sorted(random.Random(f"{seed}/bad_rows").sample(range(len(rows)), count))
    out = list(rows)
    for turn, index in enumerate(chosen):
        case, reference = faults[turn % len(faults)]
        out[index] = _replace_video(rows[index], reference, case)
    return out


def _replace_video(row: dict[str, Any], reference: str, case: str) -> dict[str, Any]:
    """A copy of ``row`` whose ``input_video`` parts point at ``reference``, marked with ``case``."""
    replaced = 0
    messages = []
    for message in row["responses_create_params"]["input"]:
        content = []
        for part in message["content"]:
            if part.get("type") == "input_video":
                part = {"type": "input_video", "video_url": reference}
                replaced += 1
            content.append(part)
        messages.append({**message, "content": content})
    if not replaced:
        raise ValueError(f"row {row.get('task_id')!r} has no input_video part to replace")
    return {
        **row,
        "responses_create_params": {**row["responses_create_params"], "input": messages},
        "task_id": f"{row['task_id']}-{case}",
        MEDIA_FAULT_KEY: case,
    }


def write_task_rows(task: TaskSection, media_root: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training rows (clips under ``media_root/train``, with ``task.bad_row_fraction`` of them
    pointing at bad media) and the held-out rows (``media_root/val``, seed ``task.seed + 1``)."""
    train_rows = task_rows(task, media_root, task.train_rows, seed=task.seed, subdir="train")
    if task.bad_row_fraction:
        train_rows = with_bad_media(train_rows, task.bad_row_fraction, media_root, seed=task.seed)
    val_rows = task_rows(task, media_root, task.val_rows, seed=task.seed + 1, subdir="val", held_out=True)
    return train_rows, val_rows
