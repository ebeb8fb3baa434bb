"""Load benchmark: concurrent video requests against one vLLM server, this package's loader against
vLLM's stock loaders, on the same requests.

vLLM decodes each request's video on a thread pool in its API server (``VLLM_MEDIA_LOADING_THREAD_COUNT``,
8 by default), and PyAV-based decoding under serving concurrency has been reported to deadlock
(vLLM #53973). Here each loader serves ``--requests`` chat completions (one distinct video each:
H.264 with B-frames, a moving block over a per-video colour, so no two decode alike and no cache
hit helps), all sent at once. Per loader it reports requests that succeeded, failed or hung (no
answer within ``--timeout`` seconds), the wall time of the burst, requests/s, p50/p99 request
latency, and the most threads the API server process held during the burst (sampled from ``/proc``
every 20 ms: the decode threads must stay bounded by the pool, not grow with the requests). Then
the ratios of ours to each stock loader.

Every request asks for one output token, so the time is the media path (decode, processor, the
vision tower) and the queueing. ``--model tiny`` (default) is the tiny Qwen2.5-VL (random weights);
``--model qwen2.5-vl-3b`` the Qwen2.5-VL-3B-shaped random-weight model of
``recipes/qwen2_5_vl_3b_1gpu.yaml``, built on the host from the recipe's ``model.spec`` (cached).
The device is chosen by ``torch.cuda.is_available()``: on a GPU bfloat16, CUDA graphs and
``--gpu-memory-utilization`` (default 0.5); on CPU float32 and eager mode. Every loader samples the
same ``--frames`` frames of each 8 s clip (default 16 for the tiny model, 32 for the 3B one: the
clip's first-to-last frames at ``frames / 8`` fps): ``video_grpo`` (this package, the checkpoint's
contract with that rate and count), ``qwen2_vl`` (vLLM's loader for the family, ``fps`` and
``max_frames``), ``opencv`` (vLLM's default backend, ``fps`` and ``num_frames``) and, where vLLM
registers it and ``PyNvVideoCodec`` imports, ``pynvvideocodec`` (GPU decode; skipped with the reason
otherwise). A stock loader the installed vLLM does not register is skipped the same way.

Run from the project root with the main environment (about 7 minutes on two cores)::

    envs/main/.venv/bin/python benchmarks/load.py
    envs/main/.venv/bin/python benchmarks/load.py --requests 32 --loaders video_grpo,opencv

On a GPU host (about 5 minutes with the 3B model already built)::

    PYTHONPATH=src python3 benchmarks/load.py --model qwen2.5-vl-3b --json benchmarks/results/load_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import requests
import torch

from rl_bridge.paths import cache_dir, project_root
from rl_bridge.processors import load_processor
from rl_bridge.services.vllm_server import VLLMServer, VLLMServerConfig, start_vllm_server
from video_grpo_demo.synthetic.writer import write_video
from video_grpo_demo.tiny_models import build_tiny_model

WIDTH, HEIGHT, SECONDS, FPS = 640, 360, 8, 24
MODELS = ("tiny", "qwen2.5-vl-3b")
GPU_RECIPE = "recipes/qwen2_5_vl_3b_1gpu.yaml"
DEFAULT_FRAMES = {"tiny": 16, "qwen2.5-vl-3b": 32}
DEFAULT_LOADERS = {
    "tiny": "video_grpo,qwen2_vl,opencv",
    "qwen2.5-vl-3b": "video_grpo,opencv,qwen2_vl,pynvvideocodec",
}


def stock_options(loader: str, frames: int) -> dict[str, Any]:
    """A stock loader's media-io kwargs sampling ``frames`` frames of a clip at ``frames / SECONDS`` fps."""
    fps = frames / SECONDS
    if loader == "qwen2_vl":
        return {"fps": fps, "max_frames": frames}
    return {"fps": fps, "num_frames": frames}  # opencv and the backends built on it (pynvvideocodec)


@dataclass(frozen=True)
class Result:
    loader: str
    ok: int
    failed: int
    hung: int
    wall_s: float
    requests_per_s: float
    p50_s: float
    p99_s: float
    max_threads: int
    idle_threads: int
    startup_s: float
    first_error: str
    media_io_kwargs: dict[str, Any]


@dataclass(frozen=True)
class Setup:
    """The server side shared by every loader: model, device and engine options."""

    model: Path
    on_gpu: bool
    dtype: str
    max_model_len: int
    extra_args: tuple[str, ...]
    frames: int


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


def burst(
    server: VLLMServer, clips: list[Path], timeout_s: float
) -> tuple[list[float], list[str], int, int, float]:
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


def media_block(loader: str, setup: Setup) -> dict[str, Any]:
    """The ``--media-io-kwargs`` video block of ``loader``, sampling ``setup.frames`` frames."""
    if loader == "video_grpo":
        contract = load_processor(setup.model).contract
        contract = contract.model_copy(update={"fps": setup.frames / SECONDS, "max_frames": setup.frames})
        return contract.to_media_io_kwargs()
    return {"video_backend": loader, **stock_options(loader, setup.frames)}


def unavailable(loader: str) -> str | None:
    """Why ``loader`` cannot run here (``None``: it can). Ours is registered by the plugin in the
    server; a stock one must be in the installed vLLM's registry, and ``pynvvideocodec`` needs a
    GPU and the ``PyNvVideoCodec`` package."""
    if loader == "video_grpo":
        return None
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    names = set(getattr(VIDEO_LOADER_REGISTRY, "name2class", {}) or {})
    if names and loader not in names:
        return f"vLLM {_vllm_version()} registers no video loader {loader!r} (it has {sorted(names)})"
    if loader == "pynvvideocodec":
        if not torch.cuda.is_available():
            return "pynvvideocodec decodes on a GPU and there is none"
        try:
            import PyNvVideoCodec  # noqa: F401
        except Exception as error:  # noqa: BLE001 (reported as the reason)
            return f"PyNvVideoCodec does not import ({type(error).__name__}: {error})"
    return None


def run_loader(loader: str, setup: Setup, clips: list[Path], timeout_s: float, logs: Path) -> Result:
    block = media_block(loader, setup)
    config = VLLMServerConfig(
        model=setup.model,
        dtype=setup.dtype,
        max_model_len=setup.max_model_len,
        enforce_eager=not setup.on_gpu,
        allowed_local_media_path=clips[0].parent,
        limit_mm_per_prompt={"image": 0, "video": 1},
        media_io_kwargs={"video": block},
        kv_cache_space_gib=1,
        startup_timeout_s=1200,
        extra_args=setup.extra_args,
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
        requests_per_s=len(latencies) / wall,
        p50_s=percentile(latencies, 50),
        p99_s=percentile(latencies, 99),
        max_threads=peak,
        idle_threads=idle,
        startup_s=server.startup_s,
        first_error=errors[0][:200] if errors else "",
        media_io_kwargs=block,
    )


def build_setup(model_name: str, frames: int, gpu_memory_utilization: float) -> Setup:
    """The model directory (built on first use) and the device's engine options."""
    on_gpu = torch.cuda.is_available()
    if model_name == "tiny":
        model, max_model_len = build_tiny_model("qwen2_5_vl", seed=0), 4096
    else:
        from rl_bridge.recipe import load_recipe
        from rl_bridge.tasks import checkpoint_dir

        recipe = load_recipe(project_root() / GPU_RECIPE)
        model, max_model_len = checkpoint_dir(recipe.model), recipe.model.max_model_len
    extra_args = ("--gpu-memory-utilization", str(gpu_memory_utilization)) if on_gpu else ()
    return Setup(
        model=model,
        on_gpu=on_gpu,
        dtype="bfloat16" if on_gpu else "float32",
        max_model_len=max_model_len,
        extra_args=extra_args,
        frames=frames,
    )


def _vllm_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except Exception as error:  # noqa: BLE001 (reported)
        return f"not importable: {error}"


def host_info() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": _vllm_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu_count": os.cpu_count(),
        "hostname": platform.node(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="tiny")
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests (distinct videos)")
    parser.add_argument("--frames", type=int, help="frames sampled per video (default: 16 tiny, 32 3B)")
    parser.add_argument(
        "--loaders",
        help="comma-separated (default: " + "; ".join(f"{m}: {v}" for m, v in DEFAULT_LOADERS.items()) + ")",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="GPU only")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before a request counts as hung"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    command = shlex.join([sys.executable, *sys.argv])
    frames = args.frames or DEFAULT_FRAMES[args.model]
    if frames > SECONDS * FPS:
        parser.error(f"--frames {frames}: the clips have {SECONDS * FPS} frames")
    setup = build_setup(args.model, frames, args.gpu_memory_utilization)
    clips = videos(args.requests + 2)
    logs = cache_dir("bench-load") / "logs"
    results: list[Result] = []
    skipped: dict[str, str] = {}
    for name in (args.loaders or DEFAULT_LOADERS[args.model]).split(","):
        reason = unavailable(name)
        if reason:
            print(f"skipping {name}: {reason}", flush=True)
            skipped[name] = reason
            continue
        print(f"{name}: starting vLLM ({'GPU' if setup.on_gpu else 'CPU'}, {setup.dtype})", flush=True)
        try:
            results.append(run_loader(name, setup, clips, args.timeout, logs))
        except Exception as error:  # noqa: BLE001 (one loader's failure must not lose the others)
            print(f"{name}: failed: {error}", flush=True)
            skipped[name] = f"failed: {str(error)[-1500:]}"

    device = torch.cuda.get_device_name(0) if setup.on_gpu else "CPU"
    print(
        f"{args.requests} concurrent requests, one distinct {WIDTH}x{HEIGHT} {SECONDS} s H.264 clip each, "
        f"{frames} frames sampled; {args.model} on {device}, vLLM {_vllm_version()}"
    )
    print(
        f"{'loader':<15} {'ok':>4} {'failed':>6} {'hung':>4} {'wall s':>7} {'req/s':>7} "
        f"{'p50 s':>7} {'p99 s':>7} "
        f"{'threads idle/max':>17} {'start s':>7}"
    )
    for r in results:
        print(
            f"{r.loader:<15} {r.ok:>4} {r.failed:>6} {r.hung:>4} {r.wall_s:>7.1f} {r.requests_per_s:>7.2f} "
            f"{r.p50_s:>7.2f} {r.p99_s:>7.2f} {f'{r.idle_threads}/{r.max_threads}':>17} {r.startup_s:>7.1f}"
        )
        if r.first_error:
            print(f"  first error: {r.first_error}")
    ratios: dict[str, dict[str, float]] = {}
    ours = next((r for r in results if r.loader == "video_grpo"), None)
    if ours is not None:
        for other in (r for r in results if r is not ours):
            ratios[other.loader] = {
                "wall": ours.wall_s / other.wall_s,
                "p50": ours.p50_s / other.p50_s,
                "p99": ours.p99_s / other.p99_s,
                "requests_per_s": ours.requests_per_s / other.requests_per_s,
            }
            q = ratios[other.loader]
            print(
                f"video_grpo / {other.loader}: wall {q['wall']:.2f}x, p50 {q['p50']:.2f}x, "
                f"p99 {q['p99']:.2f}x "
                f"(below 1: ours is faster); requests/s {q['requests_per_s']:.2f}x (above 1: ours is faster)"
            )
    if args.json:
        report = {
            "command": command,
            "host": host_info(),
            "configuration": {
                "model": args.model,
                "model_dir": str(setup.model),
                "device": device,
                "dtype": setup.dtype,
                "max_model_len": setup.max_model_len,
                "extra_args": list(setup.extra_args),
                "enforce_eager": not setup.on_gpu,
                "requests": args.requests,
                "frames_per_request": frames,
                "clip": {
                    "width": WIDTH,
                    "height": HEIGHT,
                    "seconds": SECONDS,
                    "fps": FPS,
                    "codec": "h264, bframes=3",
                },
            },
            "results": [r.__dict__ for r in results],
            "skipped": skipped,
            "ratios_ours_over_stock": ratios,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    complete = bool(results) and all(r.hung == 0 and r.failed == 0 for r in results)
    return 0 if complete and not any(v.startswith("failed") for v in skipped.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
