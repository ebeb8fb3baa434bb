"""Logprob and training-step throughput of the Megatron policy against HF transformers, on the
same model and the same batch.

The model is Qwen2.5-VL-3B-shaped (the released checkpoint's dimensions, :data:`QWEN25_VL_3B`) with
random weights, built from its config directly on the device in bf16 and saved once as an HF
checkpoint; both sides load the same weights. The batch is ``--preset``'s: by default two sequences
of 3,650 tokens, each a 32-frame 392x392 video (3,136 video tokens) between text, with a 256-token
response that is trained on.

Measured, per side and configuration (mean over ``--steps`` after ``--warmup`` steps):

* **logprobs**: a forward pass without gradients that returns the response tokens' log-probabilities
  (the GRPO "old logprobs" pass);
* **train step**: forward, backward and an Adam update with gradient clipping at 1.0, GRPO loss
  (:func:`rl_bridge.grpo.grpo_loss`, token mean) on the response tokens, advantages +1 and -1.

Sides:

* ``hf``: transformers' ``Qwen2_5_VLForConditionalGeneration`` (``attn_implementation="sdpa"``),
  bf16 parameters, ``torch.optim.AdamW`` (fused on CUDA), logprobs as usually written
  (``log_softmax(logits.float())`` over the full vocabulary at every position, then gather);
  ``hf+segment_batched``: the same with the vision attention of
  :mod:`rl_bridge.megatron.vision_attention` (shows what that change alone is worth).
* ``megatron...``: the project's :class:`rl_bridge.megatron.policy.MegatronPolicy` (Megatron-Bridge
  ``AutoBridge`` -> megatron-core GPT language model with the local layer spec and SDPA core
  attention (no Transformer Engine) + HF vision tower, megatron-core's schedule, DDP and
  optimizer with fp32 master weights), chunked target-only logprobs
  (:func:`rl_bridge.megatron.logprobs.token_logprobs`) on bf16 logits. Configurations, one sample
  per micro-batch: HF vision attention (the first measured setup), then segment-batched vision
  attention; in a separate process full activation recomputation with micro-batches of 1 and 2
  samples (2 do not fit in an H200's memory without it).

Throughput counts every token of the batch (prompt, video placeholders and response) per second.
MFU is model FLOPs per second over the chip's dense bf16 peak (``--peak-tflops``, 989 for an H200),
with model FLOPs counted from the config (:func:`model_flops`): 2 FLOPs per multiply-accumulate of
every weight matrix applied to every token (text: attention projections, MLP, LM head at all
positions; vision: patch embedding, blocks, merger, at every patch), plus attention scores and
values (text: causal, ``2 * S^2 * d`` per layer and sequence; vision: ``4 * sum(segment^2) * d``
per block over its actual windows or frames); a train step is 3x the forward FLOPs (backward = 2x),
recomputation is not counted. Peak memory is ``torch.cuda.max_memory_allocated`` over the measured
steps (weights, gradients and optimizer state included).

Usage (the full run needs a GPU with about 120 GB; ``--preset tiny`` runs anywhere, also on CPU)::

    python benchmarks/train_step.py --output benchmarks/results/train_step_h200.json
    python benchmarks/train_step.py --tensor-parallel 1 2   # Megatron on one GPU and with TP=2 on two
    python benchmarks/train_step.py --preset tiny --steps 1

Each side runs in its own subprocess (``--phase``) so that peak memory is per side: HF on one GPU,
Megatron under torchrun with one process per GPU for each ``--tensor-parallel`` size
(:func:`rl_bridge.megatron.distributed.model_parallel_group`). With several GPUs, throughput is the
total, MFU is per GPU (model FLOP/s over the peak of all of them) and peak memory is the largest GPU's,
each rank's being kept in the JSON. The parent prints the table and writes the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

GIB = 1024**3
H200_DENSE_BF16_TFLOPS = 989.0

QWEN25_VL_3B: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": 151643,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 128000,
    "max_window_layers": 70,
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "use_cache": False,
    "vocab_size": 151936,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 2048,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}
"""``config.json`` of Qwen2.5-VL-3B-Instruct (dimensions, special tokens), as released."""

# A few-MB model of the same architecture for smoke runs (CPU included): two windowed and one
# full-attention vision block, windows of three sizes, head size 128 so the M-RoPE sections fit.
TINY: dict[str, Any] = {
    **QWEN25_VL_3B,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "vision_start_token_id": 507,
    "vision_end_token_id": 508,
    "vision_token_id": 509,
    "image_token_id": 510,
    "video_token_id": 511,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 4096,
    "vocab_size": 512,
    "vision_config": {
        **QWEN25_VL_3B["vision_config"],
        "depth": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": 256,
        "fullatt_block_indexes": [1],
    },
}


QWEN3_VL_4B: dict[str, Any] = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_vl_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2560,
        "initializer_range": 0.02,
        "intermediate_size": 9728,
        "max_position_embeddings": 262144,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000,
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
        },
        "tie_word_embeddings": True,
        "use_cache": False,
        "vocab_size": 151936,
    },
    "vision_config": {
        "model_type": "qwen3_vl",
        "deepstack_visual_indexes": [5, 11, 17],
        "depth": 24,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2560,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}
"""Qwen3-VL-4B-Instruct's dimensions as released (36 layers of 2560, 32/8 heads of 128, a 24-block
1024-wide vision tower with DeepStack at blocks 5, 11, 17), 4.44 B parameters."""

QWEN3_TINY: dict[str, Any] = {
    **QWEN3_VL_4B,
    "image_token_id": 510,
    "video_token_id": 511,
    "vision_start_token_id": 507,
    "vision_end_token_id": 508,
    "text_config": {
        **QWEN3_VL_4B["text_config"],
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "vocab_size": 512,
    },
    "vision_config": {
        **QWEN3_VL_4B["vision_config"],
        "deepstack_visual_indexes": [0],
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "num_position_embeddings": 64,
        "out_hidden_size": 256,
    },
}


def _text(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: top level (Qwen2.5-VL as released) or ``text_config`` (Qwen3-VL)."""
    return {**config, **config.get("text_config", {})}


def _qwen3(config: dict[str, Any]) -> bool:
    return config["model_type"] == "qwen3_vl"


@dataclass(frozen=True)
class BatchShape:
    """The benchmark batch: ``sequences`` samples of text, one video, text, and the response."""

    sequences: int
    frames: int
    height: int
    """Video frame height in pixels (a multiple of patch size x merge size)."""
    width: int
    prefix_tokens: int
    """Text tokens before the video (system prompt, chat markup)."""
    question_tokens: int
    """Text tokens after the video."""
    response_tokens: int
    """Generated tokens: the trained positions."""
    regular_vocab: int
    """Text tokens are drawn from ids ``[0, regular_vocab)`` (below the special tokens)."""


@dataclass(frozen=True)
class Preset:
    config: dict[str, Any]
    batch: BatchShape


PRESETS: dict[str, Preset] = {
    "qwen2.5-vl-3b": Preset(
        QWEN25_VL_3B,
        BatchShape(
            sequences=2,
            frames=32,
            height=392,
            width=392,
            prefix_tokens=128,
            question_tokens=128,
            response_tokens=256,
            regular_vocab=151643,
        ),
    ),
    "qwen3-vl-4b": Preset(
        QWEN3_VL_4B,
        BatchShape(
            sequences=2,
            frames=32,
            height=448,
            width=448,
            prefix_tokens=128,
            question_tokens=128,
            response_tokens=256,
            regular_vocab=151643,
        ),
    ),
    "qwen3-tiny": Preset(
        QWEN3_TINY,
        BatchShape(
            sequences=2,
            frames=4,
            height=128,
            width=128,
            prefix_tokens=16,
            question_tokens=8,
            response_tokens=16,
            regular_vocab=500,
        ),
    ),
    "tiny": Preset(
        TINY,
        BatchShape(
            sequences=2,
            frames=4,
            height=168,
            width=168,
            prefix_tokens=16,
            question_tokens=8,
            response_tokens=16,
            regular_vocab=500,
        ),
    ),
}


# -- the batch ------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One sequence of the batch, on the CPU (as a rollout would deliver it)."""

    input_ids: torch.Tensor
    """``[T]`` int64."""
    target_mask: torch.Tensor
    """``[T]`` bool: the response."""
    advantage: float
    pixel_values_videos: torch.Tensor
    """``[patches, 3 * temporal_patch * patch * patch]`` fp32, as the HF processor returns."""
    video_grid_thw: torch.Tensor
    """``[1, 3]``."""
    second_per_grid_ts: torch.Tensor | None
    """``[1]`` seconds per temporal patch (Qwen2.5-VL; Qwen3-VL writes timestamps into the text)."""


def video_grid(config: dict[str, Any], shape: BatchShape) -> tuple[int, int, int]:
    """``(t, h, w)`` patch grid of one video of ``shape``."""
    vision = config["vision_config"]
    patch, merge, temporal = vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]
    if shape.height % (patch * merge) or shape.width % (patch * merge) or shape.frames % temporal:
        raise ValueError(
            f"video {shape.frames}x{shape.height}x{shape.width}: height and width must be multiples of "
            f"{patch * merge} and frames of {temporal}"
        )
    return shape.frames // temporal, shape.height // patch, shape.width // patch


def make_batch(config: dict[str, Any], shape: BatchShape, *, seed: int = 0) -> list[Sample]:
    """Deterministic random samples: text, ``<vision_start>``, video placeholders, ``<vision_end>``,
    text, response. Qwen3-VL: one ``<t seconds><vision_start>...<vision_end>`` block per temporal
    patch instead (the timestamp as :data:`TIMESTAMP_TOKENS` text tokens), as its processor writes."""
    generator = torch.Generator().manual_seed(seed)
    vision = config["vision_config"]
    t, h, w = video_grid(config, shape)
    video_tokens = t * h * w // vision["spatial_merge_size"] ** 2
    patch_dim = _channels(vision) * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    # The processor samples 2 frames per second here, so one temporal patch (2 frames) is 1 s.
    seconds_per_grid = vision["temporal_patch_size"] / 2.0
    samples = []
    for index in range(shape.sequences):

        def text(n: int) -> torch.Tensor:
            return torch.randint(0, shape.regular_vocab, (n,), generator=generator)

        blocks = (
            [text(TIMESTAMP_TOKENS), *_video_block(config, video_tokens // t)] * t
            if _qwen3(config)
            else _video_block(config, video_tokens)
        )
        ids = torch.cat(
            [text(shape.prefix_tokens), *blocks, text(shape.question_tokens), text(shape.response_tokens)]
        )
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[-shape.response_tokens :] = True
        samples.append(
            Sample(
                input_ids=ids,
                target_mask=mask,
                advantage=1.0 if index % 2 == 0 else -1.0,
                pixel_values_videos=torch.randn(t * h * w, patch_dim, generator=generator),
                video_grid_thw=torch.tensor([[t, h, w]]),
                second_per_grid_ts=None if _qwen3(config) else torch.tensor([seconds_per_grid]),
            )
        )
    return samples


TIMESTAMP_TOKENS = 6
"""Text tokens of a Qwen3-VL frame timestamp such as ``<12.5 seconds>``."""


def _video_block(config: dict[str, Any], tokens: int) -> list[torch.Tensor]:
    return [
        torch.tensor([config["vision_start_token_id"]]),
        torch.full((tokens,), config["video_token_id"]),
        torch.tensor([config["vision_end_token_id"]]),
    ]


# -- model FLOPs ----------------------------------------------------------------------------------


def _window_lengths(config: dict[str, Any], grid: tuple[int, int, int]) -> tuple[list[int], list[int]]:
    """Segment lengths (patches) of the vision tower's windowed and full-attention blocks for one video."""
    vision = config["vision_config"]
    t, h, w = grid
    merge = vision["spatial_merge_size"]
    window = vision["window_size"] // vision["patch_size"] // merge  # merged units per window side
    rows, cols = h // merge, w // merge
    per_frame = [
        min(window, rows - r) * min(window, cols - c) * merge * merge
        for r in range(0, rows, window)
        for c in range(0, cols, window)
    ]
    return per_frame * t, [h * w] * t


def model_flops(config: dict[str, Any], samples: list[Sample]) -> dict[str, float]:
    """Forward-pass model FLOPs of ``samples`` by component (see the module docstring)."""
    text = _text(config)
    text_hidden = text["hidden_size"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    head_dim = text.get("head_dim") or text_hidden // heads
    layer_weights = (
        text_hidden * (heads + 2 * kv_heads) * head_dim  # q, k, v
        + heads * head_dim * text_hidden  # o
        + 3 * text_hidden * text["intermediate_size"]  # gate, up, down
    )
    text_weights = text["num_hidden_layers"] * layer_weights + text_hidden * text["vocab_size"]

    vision = config["vision_config"]
    hidden = vision["hidden_size"]
    patch_dim = _channels(vision) * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    qwen3 = _qwen3(config)
    # Qwen3-VL: plain GELU MLP (2 matrices), attention over whole frames in every block, and one
    # merger more per DeepStack index; Qwen2.5-VL: gated MLP (3), windows but in the full blocks.
    block_weights = 4 * hidden * hidden + (2 if qwen3 else 3) * hidden * vision["intermediate_size"]
    merged = hidden * vision["spatial_merge_size"] ** 2
    mergers = 1 + len(vision.get("deepstack_visual_indexes", ())) if qwen3 else 1
    merger_weights = mergers * (merged * merged + merged * vision["out_hidden_size"])
    full_blocks = vision["depth"] if qwen3 else len(vision["fullatt_block_indexes"])
    window_blocks = vision["depth"] - full_blocks

    out = {"text_dense": 0.0, "text_attention": 0.0, "vision_dense": 0.0, "vision_attention": 0.0}
    for sample in samples:
        length = sample.input_ids.numel()
        out["text_dense"] += 2.0 * text_weights * length
        out["text_attention"] += 2.0 * text["num_hidden_layers"] * length**2 * heads * head_dim
        for grid in sample.video_grid_thw.tolist():
            patches = grid[0] * grid[1] * grid[2]
            out["vision_dense"] += 2.0 * (
                patches * (patch_dim * hidden + vision["depth"] * block_weights)
                + patches // vision["spatial_merge_size"] ** 2 * merger_weights
            )
            windows, frames = (
                ([], [grid[1] * grid[2]] * grid[0]) if qwen3 else _window_lengths(config, tuple(grid))
            )
            out["vision_attention"] += (
                4.0
                * hidden
                * (window_blocks * sum(n * n for n in windows) + full_blocks * sum(n * n for n in frames))
            )
    out["total"] = sum(out.values())
    return out


def _channels(vision: dict[str, Any]) -> int:
    return vision.get("in_channels", vision.get("in_chans", 3))


# -- timing ---------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], Any], *, device: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    """Seconds per call of ``fn`` (mean, min, each) and peak allocated GiB over the measured calls.

    Under torch.distributed with several ranks (``fn`` collective), each rank times its own calls
    and the figures are the slowest rank's (``step_s``, ``steps_s``) and the largest peak
    (``peak_gib``), with every rank's in ``step_s_per_rank`` and ``peak_gib_per_rank``.
    """
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    result = {"step_s": sum(times) / len(times), "min_step_s": min(times), "steps_s": times, "peak_gib": peak}
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return result
    per_rank: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(per_rank, result)
    slowest = max(per_rank, key=lambda r: r["step_s"])
    return {
        **slowest,
        "peak_gib": None if peak is None else max(r["peak_gib"] for r in per_rank),
        "step_s_per_rank": [r["step_s"] for r in per_rank],
        "peak_gib_per_rank": [r["peak_gib"] for r in per_rank],
    }


def measure_run(
    name: str,
    side: str,
    settings: dict[str, Any],
    logprobs: Callable[[], Any],
    train_step: Callable[[], Any],
    *,
    device: torch.device,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Measure one configuration's logprobs and train step; a phase that runs out of memory is
    recorded as ``{"error": ...}`` and the next one still runs."""
    run: dict[str, Any] = {"name": name, "side": side, "settings": settings}
    for phase, fn in (("logprobs", logprobs), ("train", train_step)):
        _free_memory(device)
        try:
            run[phase] = measure(fn, device=device, warmup=args.warmup, steps=args.steps)
        except torch.OutOfMemoryError as error:
            run[phase] = {"error": f"out of memory: {str(error).splitlines()[0]}"}
        summary = (
            run[phase].get("error") or f"{run[phase]['step_s']:.3f} s, peak {run[phase]['peak_gib']} GiB"
        )
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"[{side}] {name} {phase}: {summary}", flush=True)
    return run


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- HF side --------------------------------------------------------------------------------------


def full_vocab_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` ``log p(input_ids[t] | :t)`` (0 at t = 0), as usually written: an fp32
    log-softmax over all positions."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return F.pad(picked, (1, 0))


def model_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs; fp32 on the CPU, where megatron-core's mixed-precision optimizer cannot run."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def run_hf(args: argparse.Namespace, preset: Preset, device: torch.device) -> dict[str, Any]:
    """Build the random model, save it as the shared checkpoint, and measure transformers' training."""
    import transformers

    from rl_bridge.grpo import GRPOLossConfig, grpo_loss
    from rl_bridge.megatron.vision_attention import use_segment_batched_vision_attention

    torch.manual_seed(args.seed)
    qwen3 = _qwen3(preset.config)
    prefix = "Qwen3VL" if qwen3 else "Qwen2_5_VL"
    config = getattr(transformers, f"{prefix}Config")(**preset.config)
    started = time.perf_counter()
    with torch.device(device):
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")._from_config(
            config, dtype=model_dtype(device), attn_implementation="sdpa"
        )
    build_s = time.perf_counter() - started
    checkpoint = Path(args.workdir) / "checkpoint"
    started = time.perf_counter()
    model.save_pretrained(checkpoint)
    save_s = time.perf_counter() - started
    print(
        f"[hf] built {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters in {build_s:.1f} s, "
        f"saved in {save_s:.1f} s; attention: text {model.config.text_config._attn_implementation}, "
        f"vision {model.config.vision_config._attn_implementation}",
        flush=True,
    )

    samples = make_batch(preset.config, preset.batch, seed=args.seed)
    input_ids = torch.stack([s.input_ids for s in samples])
    mask = torch.stack([s.target_mask for s in samples]).to(device)
    advantages = torch.tensor([s.advantage for s in samples], device=device)
    mm_token_type_ids = torch.zeros_like(input_ids, dtype=torch.int)
    mm_token_type_ids[input_ids == preset.config["video_token_id"]] = 2
    cpu_inputs = {
        "input_ids": input_ids,
        "pixel_values_videos": torch.cat([s.pixel_values_videos for s in samples]),
        "video_grid_thw": torch.cat([s.video_grid_thw for s in samples]),
        "mm_token_type_ids": mm_token_type_ids,
    }
    if not qwen3:
        cpu_inputs["second_per_grid_ts"] = torch.cat([s.second_per_grid_ts for s in samples])
    loss_config = GRPOLossConfig()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")

    def forward_logprobs() -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {name: t.to(device) for name, t in cpu_inputs.items()}
        logits = model(**inputs, use_cache=False).logits
        return full_vocab_logprobs(logits, inputs["input_ids"]) * mask, inputs["input_ids"]

    def logprobs() -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            return forward_logprobs()[0]

    old_logprobs = logprobs()
    torch.save(
        [row[m].float().cpu() for row, m in zip(old_logprobs, mask, strict=True)],
        Path(args.workdir) / "hf_logprobs.pt",
    )

    def train_step() -> None:
        model.train()
        optimizer.zero_grad(set_to_none=True)
        current, _ = forward_logprobs()
        loss, _ = grpo_loss(
            current, advantages, mask, loss_config, old_logprobs=old_logprobs, normalizer=int(mask.sum())
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    runs = []
    # Qwen3-VL's vision tower attends per frame (one length per video): nothing to batch there.
    variants = [("hf", None)] + (
        [] if qwen3 else [("hf+segment_batched", use_segment_batched_vision_attention)]
    )
    for name, prepare in variants:
        if prepare is not None:
            prepare(model)
        settings = {
            "attn_implementation": "sdpa",
            "vision_attention": "segment_batched" if prepare else "hf",
            "logprobs": "fp32 log_softmax over the full vocabulary, all positions",
            "optimizer": f"torch AdamW on {str(model_dtype(device)).removeprefix('torch.')} parameters",
        }
        runs.append(measure_run(name, "hf", settings, logprobs, train_step, device=device, args=args))
    return {"runs": runs, "build_s": build_s, "save_s": save_s}


# -- Megatron side --------------------------------------------------------------------------------


def processed_media(samples: list[Sample], video_token_id: int) -> list[Any]:
    """Each sample's video as the policy takes it (``rl_bridge.processors.base.ProcessedMedia``):
    one placeholder run per video (Qwen2.5-VL) or per temporal patch (Qwen3-VL)."""
    from rl_bridge.processors.base import ProcessedMedia

    out = []
    for s in samples:
        tensors = {"pixel_values_videos": s.pixel_values_videos, "video_grid_thw": s.video_grid_thw}
        tokens = int((s.input_ids == video_token_id).sum())
        runs = (tokens,)
        if s.second_per_grid_ts is not None:
            tensors["second_per_grid_ts"] = s.second_per_grid_ts
        else:
            frames = int(s.video_grid_thw[0, 0])
            runs = (tokens // frames,) * frames
        out.append(
            ProcessedMedia(
                kind="video", tensors=tensors, placeholder_token_id=video_token_id, placeholder_runs=runs
            )
        )
    return out


def policy_batch(samples: list[Sample], media: list[Any], old: list[torch.Tensor] | None = None) -> list[Any]:
    """The samples as ``rl_bridge.megatron.batch.PolicySample``, with ``old`` logprobs if given."""
    from rl_bridge.megatron.batch import PolicySample

    return [
        PolicySample(
            input_ids=s.input_ids,
            target_mask=s.target_mask,
            advantage=s.advantage,
            old_logprobs=None if old is None else old[i],
            media=(media[i],),
        )
        for i, s in enumerate(samples)
    ]


@contextlib.contextmanager
def megatron_runtime(tensor_parallel: int, seed: int) -> Iterator[torch.device]:
    """This torchrun worker's process group and Megatron parallel state; yields its device."""
    from rl_bridge.megatron.cpu_support import cpu_execution
    from rl_bridge.megatron.distributed import model_parallel_group

    with cpu_execution(), model_parallel_group(tensor_parallel=tensor_parallel, seed=seed) as layout:
        yield layout.device


def run_megatron(args: argparse.Namespace, preset: Preset, device: torch.device) -> dict[str, Any]:
    """Measure :class:`MegatronPolicy` on the shared checkpoint in the configurations of ``args.recompute``.

    Runs on every rank of a torchrun job of ``args.tensor_parallel`` processes (one model replica);
    the result is complete on every rank.
    """
    from rl_bridge.grpo import GRPOLossConfig
    from rl_bridge.megatron.multi_tensor import using_foreach_multi_tensor
    from rl_bridge.megatron.policy import MegatronPolicy, PolicyConfig
    from rl_bridge.megatron.policy_loss import GRPOPolicyLoss
    from rl_bridge.megatron.vision_attention import use_segment_batched_vision_attention

    full_recompute = args.recompute == "full"
    config = PolicyConfig(
        dtype=model_dtype(device),
        learning_rate=args.lr,
        clip_grad=1.0,
        recompute=args.recompute,
        vision_attention="segment_batched" if full_recompute else "hf",
        fused_kernels=False,  # measured as a variant of its own, below
    )
    started = time.perf_counter()
    policy = MegatronPolicy(Path(args.workdir) / "checkpoint", config)
    build_s = time.perf_counter() - started
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        print(
            f"[megatron] TP={args.tensor_parallel}: built and loaded the checkpoint in {build_s:.1f} s",
            flush=True,
        )

    samples = make_batch(preset.config, preset.batch, seed=args.seed)

    media = processed_media(samples, preset.config["video_token_id"])
    plain = policy_batch(samples, media)
    old = policy.logprobs(plain, micro_batch_size=1)
    check = None
    reference_path = Path(args.workdir) / "hf_logprobs.pt"
    if reference_path.is_file():
        reference = torch.load(reference_path)
        deltas = torch.cat(
            [(o[s.target_mask] - r).abs() for o, s, r in zip(old, samples, reference, strict=True)]
        )
        check = {"mean_abs_delta": float(deltas.mean()), "max_abs_delta": float(deltas.max())}
        if rank0:
            print(f"[megatron] response logprobs vs HF (same weights, {config.dtype}): {check}", flush=True)
    train_batch = policy_batch(samples, media, old)
    loss = GRPOPolicyLoss(GRPOLossConfig())

    # Two samples per micro-batch do not fit in 140 GB without recomputation (measured on an H200).
    qwen3 = _qwen3(preset.config)
    if qwen3:  # its megatron-core vision tower: no HF attention to swap
        variants = [
            ("megatron", None, 1),
            ("megatron+fused", lambda _model: fused.update(policy.fuse_kernels()), 1),
        ]
        if full_recompute:
            variants = [("megatron+full_recompute", None, 1), ("megatron+full_recompute+mbs2", None, 2)]
    elif full_recompute:
        variants = [
            ("megatron+segment_batched+full_recompute", None, 1),
            ("megatron+segment_batched+full_recompute+mbs2", None, 2),
        ]
    else:
        variants = [
            ("megatron", None, 1),
            ("megatron+segment_batched", use_segment_batched_vision_attention, 1),
            ("megatron+segment_batched+fused", lambda _model: fused.update(policy.fuse_kernels()), 1),
            # Both samples in one packed micro-batch: half the kernel launches (the fused step is bound
            # by the host's launch rate, not the GPU), at twice the activation memory. Measured first
            # as it was before the optimizer's foreach ops and the GEMM-fused gradient accumulation,
            # then with each of them.
            (
                "megatron+segment_batched+fused+mbs2+mcore_fallbacks",
                lambda _model: _gpu_step_changes(policy, foreach=False, wgrad=False),
                2,
            ),
            (
                "megatron+segment_batched+fused+mbs2+unfused_wgrad",
                lambda _model: _gpu_step_changes(policy, foreach=True, wgrad=False),
                2,
            ),
            (
                "megatron+segment_batched+fused+mbs2",
                lambda _model: _gpu_step_changes(policy, foreach=True, wgrad=True),
                2,
            ),
        ]
    if args.variants and not full_recompute:
        unknown = set(args.variants) - {name for name, _, _ in variants}
        if unknown:
            raise SystemExit(f"--variants: no Megatron configuration named {sorted(unknown)}")
        # A configuration's preparation (attention swap, fusion) applies to the policy for good:
        # the ones before the first selected still run their preparation, not their measurement.
        last = max(i for i, (name, _, _) in enumerate(variants) if name in args.variants)
        variants = [(n, p, m, n in args.variants) for n, p, m in variants[: last + 1]]
    else:
        variants = [(n, p, m, True) for n, p, m in variants]
    fused: dict[str, int] = {}
    runs = []
    for name, prepare, micro_batch_size, measured in variants:
        if prepare is not None:
            prepare(policy.model[0])
        if not measured:
            continue
        settings = {
            "fused_kernels": dict(fused) if "+fused" in name else {},
            "tensor_parallel": args.tensor_parallel,
            "layer_spec": "local_sdpa",
            "vision_attention": (
                "megatron-core, per frame" if qwen3 else "hf" if name == "megatron" else "segment_batched"
            ),
            "micro_batch_size": micro_batch_size,
            "recompute": args.recompute,
            "logprobs": "chunked, target positions only, logits in the model dtype",
            "optimizer": "megatron-core Adam, fp32 master weights and gradients",
            "optimizer_ops": "torch foreach" if using_foreach_multi_tensor() else "megatron-core local loops",
            "wgrad_accumulation_layers": _fused_wgrad_layers(policy),
        }
        if args.tensor_parallel > 1:
            name = f"{name}+tp{args.tensor_parallel}"
        runs.append(
            measure_run(
                name,
                "megatron",
                settings,
                lambda mbs=micro_batch_size: policy.logprobs(plain, micro_batch_size=mbs),
                lambda mbs=micro_batch_size: policy.train_step(train_batch, loss, micro_batch_size=mbs),
                device=device,
                args=args,
            )
        )

    fused_check = None
    if fused:
        # The fused kernels on the same weights as the unfused pass above (before any update).
        fused_config = dataclasses.replace(config, fused_kernels=True, trainable=False)
        fresh = MegatronPolicy(Path(args.workdir) / "checkpoint", fused_config)
        if not qwen3:
            use_segment_batched_vision_attention(fresh.model[0])
        unfused = [o[s.target_mask] for o, s in zip(old, samples, strict=True)]
        fused_logprobs = fresh.logprobs(plain, micro_batch_size=1)
        again = [o[s.target_mask] for o, s in zip(fused_logprobs, samples, strict=True)]
        deltas = torch.cat([(a - b).abs() for a, b in zip(again, unfused, strict=True)])
        fused_check = {"mean_abs_delta": float(deltas.mean()), "max_abs_delta": float(deltas.max())}
        if rank0:
            print(f"[megatron] fused vs unfused response logprobs (same weights): {fused_check}", flush=True)
        del fresh
        _free_memory(device)

    profile = None
    measured = [r for r in runs if "error" not in r["train"]]
    if args.profile and measured and not full_recompute:
        fastest = min(measured, key=lambda r: r["train"]["step_s"])
        mbs = fastest["settings"]["micro_batch_size"]
        _free_memory(device)
        try:
            profile = f"{fastest['name']}, one train step\n" + _profile(
                lambda: policy.train_step(train_batch, loss, micro_batch_size=mbs), device
            )
        except (RuntimeError, ValueError) as error:  # the measurements stand without the profile
            profile = f"profiling failed: {error}"
    return {
        "runs": runs,
        "build_s": build_s,
        "logprob_check": check,
        "fused_logprob_check": fused_check,
        "profile": profile,
    }


def _gpu_step_changes(policy: Any, *, foreach: bool, wgrad: bool) -> None:
    """Turn the policy's two GPU train-step changes on or off: the optimizer's multi-tensor ops through
    torch's foreach kernels, and the language model's weight gradients accumulated by their GEMMs."""
    from rl_bridge.megatron.fusion import fuse_weight_gradient_accumulation
    from rl_bridge.megatron.multi_tensor import use_foreach_multi_tensor

    use_foreach_multi_tensor(foreach)
    fuse_weight_gradient_accumulation(policy.model[0], wgrad)


def _fused_wgrad_layers(policy: Any) -> int:
    """How many of the policy's linear layers accumulate their weight gradients in the GEMM."""
    return sum(bool(getattr(m, "gradient_accumulation_fusion", False)) for m in policy.model[0].modules())


def _profile(fn: Callable[[], Any], device: torch.device) -> str:
    """The 30 operators with the most device (else CPU) time in one call of ``fn``, as a table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=70)


# -- report ---------------------------------------------------------------------------------------


def run_gpus(run: dict[str, Any]) -> int:
    """GPUs (processes) one configuration ran on: its tensor-parallel size, 1 for HF."""
    return int(run["settings"].get("tensor_parallel", 1))


def add_rates(run: dict[str, Any], tokens: int, flops: dict[str, float], peak_tflops: float) -> None:
    """Tokens/s and MFU of each measured phase of ``run``, in total and per GPU.

    ``mfu`` is the achieved model FLOP/s over the peak of all the run's GPUs, i.e. the mean MFU per
    GPU; ``model_tflops_per_s`` and ``tokens_per_s`` are totals over the GPUs.
    """
    gpus = run_gpus(run)
    for phase, multiplier in (("logprobs", 1.0), ("train", 3.0)):
        if "error" in run[phase]:
            continue
        step = run[phase]["step_s"]
        run[phase]["gpus"] = gpus
        run[phase]["tokens_per_s"] = tokens / step
        run[phase]["tokens_per_s_per_gpu"] = tokens / step / gpus
        run[phase]["model_tflops_per_s"] = multiplier * flops["total"] / step / 1e12
        run[phase]["model_tflops_per_s_per_gpu"] = run[phase]["model_tflops_per_s"] / gpus
        run[phase]["mfu"] = run[phase]["model_tflops_per_s"] / (peak_tflops * gpus)


def table(runs: list[dict[str, Any]]) -> str:
    """One line per configuration; tok/s is the total, MFU per GPU, peak GiB the largest GPU's."""
    header = (
        f"{'configuration':<46} {'GPUs':>4} {'logprobs s':>10} {'tok/s':>8} {'MFU':>6} {'peak GiB':>8}   "
        f"{'train s':>8} {'tok/s':>8} {'MFU':>6} {'peak GiB':>8}"
    )
    lines = [header, "-" * len(header)]
    for run in runs:
        cells = []
        for phase in ("logprobs", "train"):
            r = run[phase]
            if "error" in r:
                cells.append(f"{r['error'][:40]:>{35 if phase == 'logprobs' else 33}}")
                continue
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
            width = 10 if phase == "logprobs" else 8
            cells.append(f"{r['step_s']:>{width}.3f} {r['tokens_per_s']:>8.0f} {r['mfu']:>6.1%} {peak:>8}")
        lines.append(f"{run['name']:<46} {run_gpus(run):>4} {cells[0]}   {cells[1]}")
    return "\n".join(lines)


def _run_phase(
    phase: str, args: argparse.Namespace, extra: list[str], *, tensor_parallel: int = 1
) -> dict[str, Any]:
    """Run one side in its own process(es) and return its result.

    The Megatron side runs under torchrun with ``tensor_parallel`` processes (one per GPU).
    """
    if phase == "megatron":
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={tensor_parallel}",
        ]
        extra = [*extra, "--tensor-parallel", str(tensor_parallel)]
    else:
        launcher = [sys.executable]
    out = Path(args.workdir) / f"{'-'.join([phase, *(a.lstrip('-') for a in extra)])}.json"
    command = [
        *launcher,
        os.path.abspath(__file__),
        "--phase",
        phase,
        "--preset",
        args.preset,
        "--workdir",
        args.workdir,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--seed",
        str(args.seed),
        "--lr",
        str(args.lr),
        "--phase-output",
        str(out),
        *(["--profile"] if args.profile else []),
        *(["--variants", *args.variants] if args.variants else []),
        *extra,
    ]
    print(f"== {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def _usable(run: dict[str, Any]) -> bool:
    return "error" not in run["train"] and "error" not in run["logprobs"]


def tensor_parallel_scaling(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Throughput and peak memory at TP = N > 1 over TP = 1, for each Megatron configuration measured at both.

    Keys are ``"<TP=1 configuration name> tp<N>"``; ``*_speedup`` is the ratio of total tokens/s,
    ``*_efficiency`` that speedup divided by N (1.0 = linear scaling), ``train_peak_memory`` the
    ratio of the largest GPU's peak.
    """
    single = {r["name"]: r for r in runs if r["side"] == "megatron" and run_gpus(r) == 1 and _usable(r)}
    out = {}
    for run in runs:
        tp = run_gpus(run)
        base = single.get(run["name"].removesuffix(f"+tp{tp}"))
        if run["side"] != "megatron" or tp == 1 or base is None or not _usable(run):
            continue
        entry = {}
        for phase in ("logprobs", "train"):
            speedup = run[phase]["tokens_per_s"] / base[phase]["tokens_per_s"]
            entry[f"{phase}_speedup"] = speedup
            entry[f"{phase}_efficiency"] = speedup / tp
        if base["train"]["peak_gib"]:
            entry["train_peak_memory"] = run["train"]["peak_gib"] / base["train"]["peak_gib"]
        out[f"{base['name']} tp{tp}"] = entry
    return out


def orchestrate(args: argparse.Namespace, preset: Preset) -> dict[str, Any]:
    started = time.perf_counter()
    hf = _run_phase("hf", args, [])
    megatron = {tp: _run_phase("megatron", args, [], tensor_parallel=tp) for tp in args.tensor_parallel_sizes}
    recompute = {}
    for tp in args.tensor_parallel_sizes:
        if not torch.cuda.is_available():
            print("skipping the full-recompute run: it needs CUDA", flush=True)
            break
        if args.recompute_budget_s <= time.perf_counter() - started:
            print(f"skipping the full-recompute run: {args.recompute_budget_s} s budget spent", flush=True)
            break
        recompute[tp] = _run_phase("megatron", args, ["--recompute", "full"], tensor_parallel=tp)

    samples = make_batch(preset.config, preset.batch, seed=args.seed)
    tokens = sum(s.input_ids.numel() for s in samples)
    flops = model_flops(preset.config, samples)
    runs = (
        hf["runs"]
        + [r for m in megatron.values() for r in m["runs"]]
        + [r for m in recompute.values() for r in m["runs"]]
    )
    for run in runs:
        add_rates(run, tokens, flops, args.peak_tflops)
    baseline = runs[0]
    if not _usable(baseline) or not any(_usable(r) for m in megatron.values() for r in m["runs"]):
        raise RuntimeError("the HF baseline or every Megatron configuration failed; see the log")
    # HF runs on one GPU: ours is the fastest single-GPU Megatron configuration the policy ships
    # (not the "before" configurations that switch its GPU train-step changes off).
    single_gpu = [
        r
        for r in megatron.get(1, {"runs": []})["runs"]
        if _usable(r) and not r["name"].endswith(("+mcore_fallbacks", "+unfused_wgrad"))
    ]
    ours = min(single_gpu, key=lambda r: r["train"]["step_s"]) if single_gpu else None
    ratios = None
    if ours is not None:
        ratios = {
            "logprobs_tokens_per_s": ours["logprobs"]["tokens_per_s"] / baseline["logprobs"]["tokens_per_s"],
            "train_tokens_per_s": ours["train"]["tokens_per_s"] / baseline["train"]["tokens_per_s"],
        }
        if baseline["train"]["peak_gib"]:
            ratios["train_peak_memory"] = ours["train"]["peak_gib"] / baseline["train"]["peak_gib"]
            ratios["logprobs_peak_memory"] = ours["logprobs"]["peak_gib"] / baseline["logprobs"]["peak_gib"]
    same_attention = next((r for r in runs if r["name"] == "hf+segment_batched" and _usable(r)), None)
    ratios_same_attention = None
    if ours is not None and same_attention is not None:
        ratios_same_attention = {
            phase: ours[phase]["tokens_per_s"] / same_attention[phase]["tokens_per_s"]
            for phase in ("logprobs", "train")
        }
    scaling = tensor_parallel_scaling(runs)
    first = megatron[args.tensor_parallel_sizes[0]]

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result = {
        "preset": args.preset,
        "device": device,
        "gpus_on_host": torch.cuda.device_count(),
        "dtype": str(model_dtype(torch.device("cuda" if torch.cuda.is_available() else "cpu"))),
        "versions": _versions(),
        "batch": {
            **asdict(preset.batch),
            "video_grid_thw": list(video_grid(preset.config, preset.batch)),
            "tokens_per_step": tokens,
            "video_tokens_per_sequence": int((samples[0].input_ids == preset.config["video_token_id"]).sum()),
            "vision_patches_per_step": sum(s.pixel_values_videos.size(0) for s in samples),
        },
        "model_flops_forward": flops,
        "mfu_formula": (
            "MFU = k * model_flops_forward.total / step_s / (peak * GPUs); "
            "k = 1 (logprobs) or 3 (train step); "
            "model FLOPs = 2 * (weight matrix elements) per token or patch, text LM head included, "
            "+ attention 2*S^2*d per text layer (causal) and 4*sum(segment^2)*d per vision block"
        ),
        "peak_tflops": args.peak_tflops,
        "steps": args.steps,
        "warmup": args.warmup,
        "tensor_parallel_sizes": args.tensor_parallel_sizes,
        "runs": runs,
        "baseline": baseline["name"],
        "ours": None if ours is None else ours["name"],
        "ratios_ours_over_baseline": ratios,
        "ratios_ours_over_hf_same_attention": ratios_same_attention,
        "tensor_parallel_scaling": scaling,
        "logprob_check_vs_hf": {f"tp{tp}": m["logprob_check"] for tp, m in megatron.items()},
        "logprob_check_fused_vs_unfused": {
            f"tp{tp}": m.get("fused_logprob_check") for tp, m in megatron.items()
        },
        "build_s": {
            "hf": hf["build_s"],
            "hf_save": hf["save_s"],
            **{f"megatron_tp{tp}": m["build_s"] for tp, m in megatron.items()},
        },
        "profile_megatron_train_step": first["profile"],
    }
    print()
    print(table(runs))
    print()
    if ours is not None and ratios is not None:
        print(
            f"ours = {ours['name']} vs {baseline['name']}: logprobs {ratios['logprobs_tokens_per_s']:.2f}x "
            f"tokens/s, train step {ratios['train_tokens_per_s']:.2f}x tokens/s"
            + (
                f", train peak memory {ratios['train_peak_memory']:.2f}x"
                if "train_peak_memory" in ratios
                else ""
            )
        )
    if ratios_same_attention is not None:
        print(
            f"ours = {ours['name']} vs hf+segment_batched: "
            f"logprobs {ratios_same_attention['logprobs']:.2f}x, "
            f"train step {ratios_same_attention['train']:.2f}x tokens/s"
        )
    for name, entry in scaling.items():
        print(
            f"{name}: train {entry['train_speedup']:.2f}x tokens/s "
            f"({entry['train_efficiency']:.0%} of linear), logprobs {entry['logprobs_speedup']:.2f}x"
            + (
                f", train peak per GPU {entry['train_peak_memory']:.2f}x"
                if "train_peak_memory" in entry
                else ""
            )
        )
    if first["profile"]:
        print("\nMegatron train step, top operators by device time:\n" + first["profile"])
    return result


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "megatron-core", "megatron-bridge"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-vl-3b")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-6, help="Adam learning rate of both sides")
    parser.add_argument(
        "--peak-tflops", type=float, default=H200_DENSE_BF16_TFLOPS, help="dense bf16 peak of the chip"
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile one Megatron train step (top operators)"
    )
    parser.add_argument(
        "--recompute-budget-s",
        type=float,
        default=math.inf,
        help="run the full-recompute configuration only if the other runs took less than this",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        nargs="+",
        default=[1],
        metavar="N",
        help="tensor-parallel sizes to measure the Megatron side at, each under torchrun with N processes "
        "(one per GPU); e.g. '1 2' for one GPU and two. HF always runs on one GPU",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        metavar="NAME",
        help="measure only these Megatron configurations (e.g. megatron+segment_batched+fused); default: all",
    )
    parser.add_argument("--workdir", help="checkpoint and per-phase results; default: a temporary directory")
    parser.add_argument("--phase", choices=("hf", "megatron"), help=argparse.SUPPRESS)
    parser.add_argument("--phase-output", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--recompute", choices=("none", "full"), default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    args.tensor_parallel_sizes = list(dict.fromkeys(args.tensor_parallel))
    if min(args.tensor_parallel_sizes) < 1:
        parser.error("--tensor-parallel sizes must be >= 1")
    if torch.cuda.is_available() and max(args.tensor_parallel_sizes) > torch.cuda.device_count():
        parser.error(
            f"--tensor-parallel {max(args.tensor_parallel_sizes)} needs as many GPUs; "
            f"this host has {torch.cuda.device_count()}"
        )
    preset = PRESETS[args.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    if args.phase is not None:
        logging.basicConfig(level=logging.WARNING)
        if args.phase == "hf":
            result = run_hf(args, preset, device)
        else:
            if len(args.tensor_parallel_sizes) != 1:
                parser.error("--phase megatron takes one --tensor-parallel size")
            args.tensor_parallel = args.tensor_parallel_sizes[0]
            with megatron_runtime(args.tensor_parallel, args.seed) as rank_device:
                result = run_megatron(args, preset, rank_device)
                if torch.distributed.get_rank() != 0:
                    return
        args.phase_output.write_text(json.dumps(result))
        return

    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            args.workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="train-step-bench-"))
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        result = orchestrate(args, preset)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
