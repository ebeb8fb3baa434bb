"""The demo's ``video-grpo`` subcommands, added through the ``video_grpo.commands`` entry points.

- ``tiny-model FAMILY``: build (or reuse from the cache) a tiny random-weight checkpoint;
- ``make-clips OUT``: synthetic clips with verifiable answers, printed as generic-format records.

Imports nothing heavy at module level: ``video-grpo --help`` loads this module in every
environment (the Gym one included).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["add_make_clips", "add_tiny_model"]

_Add = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]


def _tiny_model(args: argparse.Namespace) -> int:
    from video_grpo_demo.tiny_models import build_tiny_model

    path = build_tiny_model(args.family, out_dir=args.out, seed=args.seed)
    print(path)
    return 0


def add_tiny_model(add: _Add) -> None:
    """The ``tiny-model`` subcommand (needs the trainer's packages)."""
    p = add("tiny-model", _tiny_model, "Build (or reuse from cache) a tiny random-weight VLM checkpoint.")
    p.add_argument("family", choices=["qwen2_5_vl", "qwen3_vl", "nemotron_vl"])
    p.add_argument("--out", type=Path, default=None, help="directory (default: the project cache)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(needs_trainer=True)


def _make_clips(args: argparse.Namespace) -> int:
    from video_grpo_demo.synthetic import generate_task_clips

    out = args.out.resolve()
    media_root = (args.media_root or args.out).resolve()
    if not out.is_relative_to(media_root):
        print(
            f"video-grpo make-clips: {args.out} is not inside --media-root {args.media_root}", file=sys.stderr
        )
        return 2
    records = generate_task_clips(out, args.n, args.task, args.seed)
    prefix = out.relative_to(media_root)
    for record in records:
        # The generic dataset format (`gym-dataset convert --format generic`): the clip relative to
        # the media root, the question as `prompt`; the task's fields are kept.
        row = record.to_dict()
        row["video"] = (prefix / record.video).as_posix()
        row["prompt"] = row.pop("question")
        print(json.dumps(row))
    return 0


def add_make_clips(add: _Add) -> None:
    """The ``make-clips`` subcommand."""
    p = add(
        "make-clips",
        _make_clips,
        "Write synthetic video clips with verifiable answers into OUT and print one JSON record per clip "
        "in the generic dataset format (video, prompt, options, answer, id, and the task's fields), "
        "ready for `video-grpo gym-dataset convert --format generic RECORDS ROWS --media-root ROOT`.",
    )
    p.add_argument("out", type=Path, help="directory for the clips (created if missing)")
    p.add_argument(
        "--media-root",
        type=Path,
        default=None,
        help="directory OUT is inside; the records' video paths are relative to it (default: OUT)",
    )
    p.add_argument("--task", default="colour", choices=["colour", "count", "order"])
    p.add_argument("-n", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
