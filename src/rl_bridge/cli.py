"""The ``video-grpo`` console script.

Subcommands import their heavy dependencies (torch, vLLM, Megatron) lazily, so ``--help`` and
the light subcommands stay fast and work in any environment that has the package installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["main"]


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from rl_bridge.tiny_models import build_tiny_model

    path = build_tiny_model(args.family, out_dir=args.out, seed=args.seed)
    print(path)
    return 0


def _cmd_make_clips(args: argparse.Namespace) -> int:
    from gym_video_env.synthetic import generate_task_clips

    records = generate_task_clips(args.out, args.n, args.task, args.seed)
    for record in records:
        print(json.dumps(record.to_dict()))
    return 0


def _cmd_serve_vllm(args: argparse.Namespace) -> int:
    from rl_bridge.services.vllm_server import VLLMServerConfig, start_vllm_server

    config = VLLMServerConfig(model=str(args.model), port=args.port, dtype=args.dtype)
    server = start_vllm_server(config, log_dir=args.log_dir)
    print(
        f"vLLM serving {server.model} at {server.base_url} (log: {server.process.log_path}); Ctrl-C stops it"
    )
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from rl_bridge.loop.config import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if recipe.mode == "async":
        from rl_bridge.loop.async_grpo import run_async

        summary = run_async(recipe, resume=args.resume)
    elif args.resume:
        print("video-grpo train: --resume needs an async recipe (mode: async)", file=sys.stderr)
        return 2
    else:
        from rl_bridge.loop.sync import run_sync

        summary = run_sync(recipe)
    print(json.dumps(summary, indent=2))
    return 0


def _cmd_gym_dataset(args: argparse.Namespace) -> int:
    from gym_video_env.datasets import main as datasets_main

    return datasets_main(args.rest)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from rl_bridge.doctor import run_checks

    return 0 if run_checks(verbose=args.verbose) else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="video-grpo",
        description="Video GRPO on stock vLLM, NeMo Gym and Megatron-Bridge.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    p = add(
        "train",
        _cmd_train,
        "Train with GRPO, sync or async as the recipe's mode says (default: the tiny CPU sync "
        "recipe, everything started locally).",
    )
    p.add_argument(
        "-r", "--recipe", type=Path, default=None, help="recipe YAML (default: the built-in tiny CPU recipe)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="async recipes: continue the run in the recipe's run_dir from its latest checkpoint",
    )
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.steps=5")

    p = add("tiny-model", _cmd_tiny_model, "Build (or reuse from cache) a tiny random-weight VLM checkpoint.")
    p.add_argument("family", choices=["qwen2_5_vl", "qwen3_vl", "nemotron_vl"])
    p.add_argument("--out", type=Path, default=None, help="directory (default: the project cache)")
    p.add_argument("--seed", type=int, default=0)

    p = add("make-clips", _cmd_make_clips, "Write synthetic video clips with verifiable answers.")
    p.add_argument("out", type=Path)
    p.add_argument("--task", default="colour", choices=["colour", "count", "order"])
    p.add_argument("-n", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)

    p = add(
        "serve-vllm", _cmd_serve_vllm, "Serve a model with vLLM (CPU build) and this plugin, on loopback."
    )
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--log-dir", type=Path, default=Path("runs/serve-vllm"))

    p = add(
        "gym-dataset",
        _cmd_gym_dataset,
        "Gym video datasets: convert (Video-R1 / NExT-QA / generic JSONL), validate, generate.",
    )
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of `python -m gym_video_env.datasets`")

    p = add("doctor", _cmd_doctor, "Check the environments: versions, plugin discovery, Gym interpreter.")
    p.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
