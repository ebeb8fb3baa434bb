"""Grading multiple-choice answers written as ``\\boxed{X}``, and reading them out of Gym responses.

Pure functions on plain JSON (Responses-API output items as dicts); no NeMo Gym import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "BOXED_INSTRUCTION",
    "LETTER_INSTRUCTION",
    "AnswerFormat",
    "Grade",
    "extract_boxed",
    "final_assistant_text",
    "grade_choice",
]

BOXED_INSTRUCTION = "Answer with the letter of the correct option inside \\boxed{}, for example \\boxed{A}."
"""The answer format every video environment asks for."""

LETTER_INSTRUCTION = "Answer with the letter of the correct option."
"""The instruction for ``answer_format="letter"`` (e.g. generation restricted to the option letters)."""

AnswerFormat = Literal["boxed", "letter"]
"""Where the answer is read: the last ``\\boxed{X}`` (``"boxed"``), or the whole text being a bare
option letter (``"letter"``, e.g. when sampling is restricted to the letter tokens)."""

_BOXED = "\\boxed{"
# A bare option letter, optionally wrapped as (B), B., B) or \text{B}, with nothing else.
_LETTER = re.compile(r"^\s*(?:\\text\{\s*)?\(?([A-Za-z])\)?\.?\s*\}?\s*$")


@dataclass(frozen=True)
class Grade:
    """The outcome of grading one answer."""

    reward: float
    """1.0 for the correct letter, else 0.0."""
    extracted: str | None
    """The letter read from the last ``\\boxed{...}`` (upper case), or ``None`` when there was none
    or its content was not one of the option letters."""


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or ``None``."""
    start = text.rfind(_BOXED)
    if start == -1:
        return None
    depth = 1
    for position in range(start + len(_BOXED), len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOXED) : position]
    return None


def grade_choice(
    text: str, answer: str, options: Iterable[str], *, answer_format: AnswerFormat = "boxed"
) -> Grade:
    """Grade ``text`` against the correct letter ``answer``; ``options`` are the valid letters.

    ``answer_format`` says where the letter is read (see :data:`AnswerFormat`).
    """
    letters = {letter.upper() for letter in options}
    if answer.upper() not in letters:
        raise ValueError(f"answer {answer!r} is not one of the option letters {sorted(letters)}")
    if answer_format not in ("boxed", "letter"):
        raise ValueError(f"answer_format must be 'boxed' or 'letter', got {answer_format!r}")
    source = extract_boxed(text) if answer_format == "boxed" else text
    match = _LETTER.match(source) if source is not None else None
    extracted = match.group(1).upper() if match else None
    if extracted not in letters:
        extracted = None
    return Grade(reward=1.0 if extracted == answer.upper() else 0.0, extracted=extracted)


def final_assistant_text(output: Iterable[Mapping[str, Any]]) -> str:
    """Text of the last assistant message among Responses output items (``""`` when there is none)."""
    for item in reversed(list(output)):
        if item.get("type") == "message" and item.get("role") == "assistant":
            content = item.get("content")
            if isinstance(content, str):
                return content
            return "".join(part.get("text", "") for part in content or [] if isinstance(part, Mapping))
    return ""
