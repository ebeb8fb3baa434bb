"""Benchmark: video payload bytes per GRPO group with and without dedup, and preprocessing's share
of a trainer step.

A group is G rollouts of one prompt. Each rollout shows the prompt clip, then (after a tool call)
``--turn-clips`` clips drawn from a pool of ``--clip-pool`` clips, so clips recur across the group.
Trajectories are shaped as Gym output items with the placeholder runs the processor gives.

- **with dedup**: one :class:`~rl_bridge.policy_inputs.PolicyInputBuilder` for the group (one decode
  cache, one media store): every distinct clip is decoded and processed once and its tensors are
  referenced by every rollout that shows it;
- **without dedup**: each rollout processed on its own (its own decode cache and store), as a
  per-sample pipeline does: G copies of the prompt clip, a copy of a pool clip per use.

Bytes are those of the processed tensors held (``ProcessedMedia.nbytes``). Times are wall-clock on
this machine. Unless ``--skip-policy``, the tiny Qwen2.5-VL is built in Megatron-Core and the
trainer step on the group (policy logprobs, then one GRPO train step, one sample per micro-batch)
is timed, to give preprocessing's share of the trainer side of a step (rollout time excluded).

Run: ``python benchmarks/preprocess.py [--group-size 8] [--max-pixels 200704] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from gym_video_env.hookspecs import MediaSettings
from rl_bridge.media_batch import MediaStore
from rl_bridge.policy_inputs import PolicyInputBuilder, RolloutInputs
from rl_bridge.processors import load_processor
from rl_bridge.processors.qwen import QwenVLProcessor
from rl_bridge.trajectory import prompt_media
from video_grpo_demo.synthetic import indexed_frames, write_video
from video_grpo_demo.tiny_models import build_tiny_model
from vllm_video_plugin.cache import DecodeCache

T = TypeVar("T")


def _timed(function: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    result = function()
    return result, time.perf_counter() - started


def _checkpoint(max_pixels: int | None, directory: Path) -> Path:
    """The tiny Qwen2.5-VL, or a copy whose video processor allows ``max_pixels`` per frame."""
    model_dir = build_tiny_model("qwen2_5_vl")
    if max_pixels is None:
        return model_dir
    copy = directory / "checkpoint"
    shutil.copytree(model_dir, copy)
    settings = json.loads((copy / "processor_config.json").read_text())
    settings["video_processor"]["size"]["longest_edge"] = max_pixels
    (copy / "processor_config.json").write_text(json.dumps(settings))
    return copy


def _video_part(path: Path) -> dict[str, Any]:
    return {"type": "input_video", "video_url": path.as_uri()}


def _user(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": content}


def _call(prompt_ids: list[int], generation: list[int]) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "prompt_token_ids": prompt_ids,
        "generation_token_ids": generation,
        "generation_log_probs": [-1.0] * len(generation),
    }


def _records(processor: QwenVLProcessor, root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """G rollout records; placeholder counts from a throwaway store (not timed)."""
    width, height = (int(v) for v in args.size.split("x"))
    clips = [
        write_video(
            root / f"clip-{k}.mp4", indexed_frames(args.frames + 2 * k, width=width, height=height), fps=8
        ).path
        for k in range(args.clip_pool + 1)
    ]
    prompt_clip, pool = clips[0], clips[1:]
    planner = MediaStore(processor, MediaSettings(media_root=root), decode_cache=DecodeCache())

    def tokens(paths: list[Path]) -> list[int]:
        ids = [11, 12]
        for part in prompt_media([_user([_video_part(p) for p in paths])]):
            ids += [20, *[processor.video_token_id] * planner.get(part).num_placeholders, 21]
        return ids + [13]

    records = []
    for sample in range(args.group_size):
        later = [pool[(sample + k) % len(pool)] for k in range(args.turn_clips)]
        first = tokens([prompt_clip])
        generation = [30 + sample % 5, 31]
        output = [
            _call(first, generation),
            {"type": "function_call_output", "call_id": "c", "output": "[moved to the next user message]"},
            _user([_video_part(p) for p in later]),
            _call(first + generation + tokens(later), [40, 41, 42 + sample % 3]),
        ]
        records.append(
            {
                "responses_create_params": {"input": [_user([_video_part(prompt_clip)])]},
                "response": {"output": output},
            }
        )
    return records


def _policy_step(model_dir: Path, rollouts: list[RolloutInputs]) -> dict[str, float]:
    """Seconds of the policy's logprobs and one GRPO train step on the group."""
    import dataclasses

    from rl_bridge.grpo import GRPOLossConfig
    from rl_bridge.megatron.cpu_support import cpu_execution, single_process_group
    from rl_bridge.megatron.policy import MegatronPolicy, PolicyConfig
    from rl_bridge.megatron.policy_loss import GRPOPolicyLoss

    samples = [s for i, r in enumerate(rollouts) for s in r.to_policy_samples(1.0 if i % 2 else -1.0)]
    with cpu_execution(), single_process_group():
        policy, build_s = _timed(lambda: MegatronPolicy(model_dir, PolicyConfig(micro_batch_size=1)))
        old, logprobs_s = _timed(lambda: policy.logprobs(samples))
        batch = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(samples, old, strict=True)]
        _, train_s = _timed(lambda: policy.train_step(batch, GRPOPolicyLoss(GRPOLossConfig())))
    return {"policy_build_s": build_s, "policy_logprobs_s": logprobs_s, "policy_train_step_s": train_s}


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-preprocess-") as temporary:
        root = Path(temporary)
        model_dir = _checkpoint(args.max_pixels, root)
        processor = load_processor(model_dir)
        assert isinstance(processor, QwenVLProcessor)
        media_root = root / "media"
        media_root.mkdir()
        records = _records(processor, media_root, args)
        settings = MediaSettings(media_root=media_root)

        shared = PolicyInputBuilder(processor, settings, decode_cache=DecodeCache())
        deduped, dedup_s = _timed(lambda: [shared.build(r) for r in records])
        _, warm_s = _timed(lambda: [shared.build(r) for r in records])
        separate = [PolicyInputBuilder(processor, settings, decode_cache=DecodeCache()) for _ in records]
        _, plain_s = _timed(lambda: [b.build(r) for b, r in zip(separate, records, strict=True)])
        assert not any(r.masked for r in deduped), [r.mask_detail for r in deduped if r.masked]

        result: dict[str, Any] = {
            "group_size": args.group_size,
            "clips_per_rollout": 1 + args.turn_clips,
            "distinct_clips": shared.store.stats().processed,
            "frames_per_clip": args.frames,
            "clip_size": args.size,
            "max_pixels": args.max_pixels,
            "bytes_with_dedup": shared.store.stats().unique_bytes,
            "bytes_without_dedup": sum(b.store.stats().unique_bytes for b in separate),
            "preprocess_with_dedup_s": dedup_s,
            "preprocess_warm_s": warm_s,
            "preprocess_without_dedup_s": plain_s,
            "placeholder_pass_rate": shared.metrics.as_dict()["media/placeholder_pass_rate"],
        }
        result["dedup_bytes_ratio"] = result["bytes_without_dedup"] / result["bytes_with_dedup"]
        if not args.skip_policy:
            result.update(_policy_step(model_dir, deduped))
            step = dedup_s + result["policy_logprobs_s"] + result["policy_train_step_s"]
            result["preprocess_share_of_trainer_step"] = dedup_s / step
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per prompt (G)")
    parser.add_argument("--turn-clips", type=int, default=2, help="clips each rollout's second turn injects")
    parser.add_argument("--clip-pool", type=int, default=4, help="distinct clips the turns draw from")
    parser.add_argument("--frames", type=int, default=32, help="frames of the shortest clip (8 fps)")
    parser.add_argument("--size", default="224x128", help="clip WIDTHxHEIGHT in pixels")
    parser.add_argument(
        "--max-pixels",
        type=int,
        default=None,
        help="video pixel budget per frame (default: the tiny checkpoint's 12544)",
    )
    parser.add_argument("--skip-policy", action="store_true", help="do not time the Megatron step")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
