"""One policy rank of ``recipes/qwen2_5_vl_3b_gpu.yaml`` on one GPU, with the recipe's batch shape
and micro-batching, and its forward-only reference: time and peak memory per role, to hold
against ``video-grpo plan``'s estimate.

The recipe's plan puts the policy on 4 GPUs as DP 4, one rank per GPU: each rank trains a quarter
of the step's ``prompts_per_step x group_size`` samples (64 x 8 / 4 = 128) in micro-batches of
``train.micro_batch_size`` (4). A sample is what its task makes: one 32-frame 224 x 224 clip
(16 x 16 x 16 patches, 1,024 video tokens), the prompt's text around it, and a response of
``rollout.max_output_tokens`` (512, the longest a rollout may be: the memory bound). The model is
the Qwen2.5-VL-3B shape of ``benchmarks/train_step.py`` with random weights in bf16, built the way
the loop builds it (:class:`~rl_bridge.megatron.policy.MegatronPolicy`, the recipe's
``policy_config`` fields).

Measured, in this order on one GPU:

* **policy**: build; the ``pi_old`` logprob pass over the rank's samples; ``--steps`` GRPO train
  steps (forward, backward, Adam with fp32 master weights) over them; peak memory
  (``torch.cuda.max_memory_allocated``) and the state held between steps;
* **reference**: the policy freed, the forward-only reference built (``trainable=False``: no
  gradient buffers, no optimizer) and its logprob pass; its peak memory.

Run from the project root on the GPU machine under torchrun (one process; wheels as in
benchmarks/README.md)::

    PYTHONPATH=src python -m torch.distributed.run --standalone --nproc-per-node 1 \\
        benchmarks/policy_role.py --output benchmarks/results/policy_role_h200.json
    envs/main/.venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 1 \\
        benchmarks/policy_role.py --preset tiny --samples 8          # the same code on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from refit_trainer import build_checkpoint  # noqa: E402
from train_step import (  # noqa: E402
    H200_DENSE_BF16_TFLOPS,
    PRESETS,
    BatchShape,
    make_batch,
    megatron_runtime,
    model_dtype,
    model_flops,
    policy_batch,
    processed_media,
)

GIB = 1024**3
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "qwen2_5_vl_3b_gpu.yaml"
PREFIX_TOKENS, QUESTION_TOKENS = 64, 96
"""Text around the clip: the chat template and system prompt before it, the question and six
options after it."""


def rank_shape(recipe: dict[str, Any], preset: str, samples: int | None) -> tuple[BatchShape, int, int]:
    """One rank's batch shape, its sample count and micro-batch size, from the recipe."""
    model, task, rollout, train = recipe["model"], recipe["task"], recipe["rollout"], recipe["train"]
    data_parallel = model["policy_gpus"] // (
        model["policy_tensor_parallel_size"] * model["policy_pipeline_parallel_size"]
    )
    per_rank = rollout["prompts_per_step"] * rollout["group_size"] // data_parallel
    if preset == "tiny":  # the same code path at a size any machine runs
        shape = dataclasses.replace(PRESETS["tiny"].batch, sequences=samples or 8)
        return shape, shape.sequences, min(train["micro_batch_size"], shape.sequences)
    shape = BatchShape(
        sequences=samples or per_rank,
        frames=task["num_frames"],
        height=task["height"],
        width=task["width"],
        prefix_tokens=PREFIX_TOKENS,
        question_tokens=QUESTION_TOKENS,
        response_tokens=rollout["max_output_tokens"],
        regular_vocab=151643,
    )
    return shape, shape.sequences, train["micro_batch_size"]


def gib(value: int) -> float:
    return round(value / GIB, 2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, device: torch.device) -> tuple[float, Any]:
    sync(device)
    started = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - started, result


def memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {
        "allocated_gib": gib(torch.cuda.memory_allocated(device)),
        "peak_gib": gib(torch.cuda.max_memory_allocated(device)),
    }


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def measure_policy(
    result: dict[str, Any],
    *,
    checkpoint: Path,
    config: Any,
    samples: list[Any],
    media: list[Any],
    plain: list[Any],
    num_steps: int,
    tokens: int,
    flops: float,
    peak_tflops: float,
    device: torch.device,
) -> None:
    """The policy's build, ``pi_old`` logprob pass and ``num_steps`` train steps, recorded in
    ``result``; the policy and its batches go out of scope on return."""
    from rl_bridge.grpo import GRPOLossConfig
    from rl_bridge.megatron.policy import MegatronPolicy
    from rl_bridge.megatron.policy_loss import GRPOPolicyLoss

    reset_peak(device)
    build_s, policy = timed(lambda: MegatronPolicy(checkpoint, config), device)
    result["policy_build_s"] = round(build_s, 1)
    result["policy_after_build"] = memory(device)
    logprob_s, old = timed(lambda: policy.logprobs(plain), device)
    train_batch = policy_batch(samples, media, old)
    loss = GRPOPolicyLoss(GRPOLossConfig())
    steps = []
    for step in range(num_steps):
        seconds, metrics = timed(lambda: policy.train_step(train_batch, loss), device)
        steps.append(
            {
                "step": step + 1,
                "seconds": round(seconds, 2),
                "loss": metrics.loss,
                "grad_norm": metrics.grad_norm,
            }
        )
        print(f"[policy] train step {step + 1}: {seconds:.1f} s", flush=True)
    # Steady-state steps (the first also allocates the optimizer's state).
    steady = [s["seconds"] for s in steps[1:]] or [s["seconds"] for s in steps]
    step_s = sum(steady) / len(steady)
    result["policy"] = {
        "logprobs_s": round(logprob_s, 2),
        "logprobs_tokens_per_s": round(tokens / logprob_s),
        "logprobs_mfu": round(flops / logprob_s / (peak_tflops * 1e12), 4),
        "train_steps": steps,
        "train_step_s": round(step_s, 2),
        "train_tokens_per_s": round(tokens / step_s),
        "train_mfu": round(3 * flops / step_s / (peak_tflops * 1e12), 4),
        "state_gib": {name: gib(value) for name, value in policy.state_bytes().items()},
        **memory(device),
    }
    print(f"[policy] {json.dumps(result['policy'])}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("qwen2.5-vl-3b", "tiny"), default="qwen2.5-vl-3b")
    parser.add_argument("--samples", type=int, help="samples of the rank (default: the recipe's share)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workdir", help="keeps the checkpoint (default: a temporary directory)")
    parser.add_argument("--peak-tflops", type=float, default=H200_DENSE_BF16_TFLOPS)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    from rl_bridge.megatron.policy import MegatronPolicy, PolicyConfig

    recipe = yaml.safe_load(RECIPE.read_text())
    shape, count, micro_batch = rank_shape(recipe, args.preset, args.samples)
    preset_config = PRESETS[args.preset].config
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="policy-role-"))
    with megatron_runtime(tensor_parallel=1, seed=0) as device:
        checkpoint = build_checkpoint(args.preset, workdir, device)
        samples = make_batch(preset_config, shape, seed=0)
        media = processed_media(samples, preset_config["video_token_id"])

        tokens = sum(s.input_ids.numel() for s in samples)
        flops = model_flops(preset_config, samples)["total"]
        config = PolicyConfig(  # as Recipe.policy_config builds it from the recipe
            dtype=model_dtype(device),
            layer_spec=recipe["model"].get("layer_spec", "auto"),
            learning_rate=recipe["train"]["learning_rate"],
            micro_batch_size=micro_batch,
            temperature=recipe["rollout"]["temperature"],
        )
        result: dict[str, Any] = {
            "recipe": str(RECIPE.name),
            "preset": args.preset,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "samples": count,
            "micro_batch_size": micro_batch,
            "tokens_per_sample": samples[0].input_ids.numel(),
            "tokens": tokens,
        }

        plain = policy_batch(samples, media)
        measure_policy(
            result,
            checkpoint=checkpoint,
            config=config,
            samples=samples,
            media=media,
            plain=plain,
            num_steps=args.steps,
            tokens=tokens,
            flops=flops,
            peak_tflops=args.peak_tflops,
            device=device,
        )
        # The policy is freed when measure_policy returns.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        reset_peak(device)
        reference_config = dataclasses.replace(config, trainable=False)
        build_s, reference = timed(lambda: MegatronPolicy(checkpoint, reference_config), device)
        after_build = memory(device)
        ref_s, _ = timed(lambda: reference.logprobs(plain), device)
        result["reference"] = {
            "build_s": round(build_s, 1),
            "after_build": after_build,
            "logprobs_s": round(ref_s, 2),
            "logprobs_tokens_per_s": round(tokens / ref_s),
            "state_gib": {name: gib(value) for name, value in reference.state_bytes().items()},
            **memory(device),
        }
        print(f"[reference] {json.dumps(result['reference'])}", flush=True)
        if torch.distributed.get_rank() == 0:
            text = json.dumps(result, indent=2)
            print(text, flush=True)
            if args.output:
                args.output.parent.mkdir(parents=True, exist_ok=True)
                args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
