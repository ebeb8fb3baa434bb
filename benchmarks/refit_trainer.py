"""The trainer side of an in-memory refit at scale: export and bucket packing of a Megatron policy.

Where vLLM cannot run (vLLM's CUDA build does not fit on the GPU machine), this measures the part
of a refit that happens in the trainer: :class:`~rl_bridge.megatron.policy.MegatronPolicy`
streaming its HF-named weights (Megatron-Bridge's export: tensor-parallel shards gathered,
fused projections split) and packing them into buckets through one kept send buffer
(:func:`vllm_video_plugin.buckets.pack_buckets`, what
:class:`~rl_bridge.refit.engines.GlooTrainerWeightTransferEngine` does), as one refit does, without
the network (and without vLLM):

- ``export (device)``: the export consumed on the GPU (what vLLM's ``nccl`` engine sends from);
- ``export + pack (device)``: the same, packed into ``--bucket-mb`` buckets on the GPU;
- ``export (host)``: the export copied to host memory (what the gloo engine sends from);
- ``export + pack (host)``: the same, packed into host buckets: the gloo path's trainer side.

Each is the median of ``--repeats`` passes; the bytes are the model's. The model is the
Qwen2.5-VL-3B shape of ``benchmarks/train_step.py`` (random weights, bf16 on a GPU), or its tiny
preset (fp32 on CPU). Run from the project root under torchrun (one process; the policy's process
group comes from its environment)::

    PYTHONPATH=src python -m torch.distributed.run --standalone --nproc-per-node 1 \
        benchmarks/refit_trainer.py --workdir /tmp/refit3b                                  # GPU
    envs/main/.venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 1 \
        benchmarks/refit_trainer.py --preset tiny                                           # CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_step import PRESETS, megatron_runtime, model_dtype  # noqa: E402

from vllm_video_plugin.buckets import pack_buckets  # noqa: E402


def build_checkpoint(preset: str, directory: Path, device: torch.device) -> Path:
    """The preset's random-weight HF checkpoint in ``directory`` (built once)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    checkpoint = directory / "checkpoint"
    if (checkpoint / "config.json").is_file():
        return checkpoint
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(
            Qwen2_5_VLConfig(**PRESETS[preset].config), dtype=model_dtype(device)
        )
    model.save_pretrained(checkpoint)
    del model
    return checkpoint


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drain(pairs: Iterator[tuple[str, torch.Tensor]]) -> tuple[int, int]:
    tensors = nbytes = 0
    for _, tensor in pairs:
        tensors += 1
        nbytes += tensor.numel() * tensor.element_size()
    return tensors, nbytes


class Packer:
    """Packs an export into buckets through one send buffer, as the trainer engine does."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.send: torch.Tensor | None = None

    def buffer(self, device: torch.device) -> torch.Tensor:
        if self.send is None or self.send.device != device:
            self.send = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
        return self.send

    def __call__(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        buckets = nbytes = 0
        for _, layout in pack_buckets(pairs, self.bucket_bytes, self.buffer):
            buckets += 1
            nbytes += layout.nbytes
        return buckets, nbytes


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, Any]:
    seconds, result = [], None
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        result = fn()
        sync(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-vl-3b")
    parser.add_argument(
        "--workdir", default=None, help="keeps the checkpoint (default: a temporary directory)"
    )
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    from rl_bridge.megatron.policy import MegatronPolicy, PolicyConfig

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="refit-trainer-"))
    with megatron_runtime(tensor_parallel=1, seed=0) as device:
        started = time.perf_counter()
        checkpoint = build_checkpoint(args.preset, workdir, device)
        policy = MegatronPolicy(checkpoint, PolicyConfig(dtype=model_dtype(device)))
        print(f"built and loaded {args.preset} in {time.perf_counter() - started:.1f} s", flush=True)
        bucket = args.bucket_mb * 1024**2
        on_device, on_host = Packer(bucket), Packer(bucket)
        rows: dict[str, Any] = {}
        cases = {
            "export (device)": lambda: drain(policy.export_hf_weights(cpu=False)),
            "export + pack (device)": lambda: on_device(policy.export_hf_weights(cpu=False)),
            "export (host)": lambda: drain(policy.export_hf_weights(cpu=True)),
            "export + pack (host)": lambda: on_host(policy.export_hf_weights(cpu=True)),
        }
        if device.type != "cuda":
            cases = {k: v for k, v in cases.items() if "host" in k}
        for name, fn in cases.items():
            seconds, (count, nbytes) = timed(fn, device, args.repeats)
            rows[name] = {
                "seconds": seconds,
                "count": count,
                "bytes": nbytes,
                "gb_per_s": nbytes / seconds / 1e9,
            }
            print(
                f"{name:<24} {seconds:8.3f} s  {nbytes / 1e9:7.3f} GB  "
                f"{nbytes / seconds / 1e9:6.2f} GB/s  ({count})",
                flush=True,
            )
    result = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "bucket_mb": args.bucket_mb,
        "parameters": sum(p.numel() for module in policy.model for p in module.parameters()),
        "rows": rows,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
