"""Task rows for the training loop: ``video_mcqa`` rows built from the synthetic video tasks.

Like :func:`gym_video_env.environments.video_mcqa_rows`, with the knobs that make a tiny random
model learnable from reward within minutes (see :class:`~rl_bridge.loop.config.TaskSection`):
options in a canonical order, the instruction of the chosen answer format, and optionally only the
colour clips that show their colour in every frame.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gym_video_env.environments import mcqa_row
from gym_video_env.grading import BOXED_INSTRUCTION, LETTER_INSTRUCTION
from gym_video_env.synthetic import ClipConfig, make_task_clip
from rl_bridge.loop.config import TaskSection

__all__ = ["option_letters", "task_rows"]

_LETTERS = "ABCDEFGH"


def option_letters(task: TaskSection) -> str:
    """The letters the options of ``task`` are labelled with (``"ABCD"`` for 4 options)."""
    return _LETTERS[: task.num_options]


def task_rows(task: TaskSection, media_root: Path, n: int, *, seed: int, subdir: str) -> list[dict[str, Any]]:
    """Write clips under ``media_root/subdir`` and return ``n`` ``video_mcqa`` rows.

    Row fields besides ``responses_create_params``: ``task_id``, ``task``, ``options`` (letter ->
    text) and ``answer``. With ``task.canonical_options`` the options are sorted by their text and
    relettered, so questions with the same option set always use the same letter for an answer.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"task_rows: n must be >= 1, got {n}")
    config = ClipConfig(
        width=task.width, height=task.height, num_frames=task.num_frames, fps=task.fps, num_options=task.num_options
    )
    instruction = LETTER_INSTRUCTION if task.answer_format == "letter" else BOXED_INSTRUCTION
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
        prompt = "\n".join([record.question, *(f"{letter}. {text}" for letter, text in options.items()), instruction])
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
