"""Write a long video made of coloured segments and ``video_clip_tool`` rows asking about them.

    python make_rows.py MEDIA_ROOT ROWS [-n N]

Each row's video (``long/long-K.mp4`` under MEDIA_ROOT) shows one solid colour per 2-second
segment; the question asks which colour is shown in one segment and declares the tool ``cut_clip``
so the model can look at that span. The prompt shows no video: the model only sees what it cuts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from gym_video_env.grading import BOXED_INSTRUCTION
from video_grpo_demo.synthetic import PALETTE, SATURATED_COLOURS, write_video

SEGMENT_S = 2.0
FPS = 4
SIZE = 56

CUT_CLIP_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "cut_clip",
    "description": "Cut the span [start_s, end_s) out of the video and watch it.",
    "parameters": {
        "type": "object",
        "properties": {
            "start_s": {"type": "number", "description": "start, seconds"},
            "end_s": {"type": "number", "description": "end (exclusive), seconds"},
        },
        "required": ["start_s", "end_s"],
        "additionalProperties": False,
    },
    "strict": True,
}


def long_video(path: Path, colours: list[str]) -> None:
    """One solid-colour segment of ``SEGMENT_S`` seconds per colour, at ``FPS`` frames/s."""
    per_segment = int(SEGMENT_S * FPS)
    frames = [
        np.full((SIZE, SIZE, 3), PALETTE[colour], dtype=np.uint8)
        for colour in colours
        for _ in range(per_segment)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_video(path, frames, fps=FPS)


def make_rows(media_root: Path, n: int, *, segments: int = 4, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows, each with its own long video of ``segments`` colours under ``media_root``."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(n):
        colours = [str(c) for c in rng.choice(SATURATED_COLOURS, size=segments, replace=False)]
        long_video(media_root / "long" / f"long-{k}.mp4", colours)
        asked = int(rng.integers(segments))
        options = {letter: colour for letter, colour in zip("ABCD", colours, strict=True)}
        answer = next(letter for letter, colour in options.items() if colour == colours[asked])
        start, end = asked * SEGMENT_S, (asked + 1) * SEGMENT_S
        question = "\n".join(
            [
                f"The video is {segments * SEGMENT_S:g} seconds long. Which colour fills it from "
                f"second {start:g} to second {end:g}? Use the cut_clip tool to watch that part.",
                *(f"{letter}. {colour}" for letter, colour in options.items()),
                BOXED_INSTRUCTION,
            ]
        )
        rows.append(
            {
                "responses_create_params": {
                    "input": [{"role": "user", "content": [{"type": "input_text", "text": question}]}],
                    "tools": [CUT_CLIP_TOOL],
                },
                "video": f"long/long-{k}.mp4",
                "options": options,
                "answer": answer,
                "task_id": f"video_clip_tool-{k}",
                "segment_colours": colours,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("media_root", type=Path)
    parser.add_argument("rows", type=Path)
    parser.add_argument("-n", type=int, default=4)
    args = parser.parse_args()
    rows = make_rows(args.media_root.resolve(), args.n)
    args.rows.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {len(rows)} rows to {args.rows}, videos under {args.media_root / 'long'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
