"""Decode benchmark: the ``video_grpo`` loader against vLLM's stock loaders on the same requests.

Each row is one request: a stock loader (``opencv``, ``nemotron_vl``, ``qwen2_vl``, ``qwen3_vl``)
with its media-io options, and the sampling contract that samples the same frames through this
package's loader. Per row it reports seconds per request for the stock loader, for ours cold
(empty decode cache: a real decode) and for ours warm (a decode-cache hit, as for the 2nd..G-th
request of a GRPO group), their ratios, whether the frames are identical, and at the end the
geometric means of the ratios (over every row, and over the ``opencv`` rows).

Videos are generated once and cached under ``rl_bridge.paths.cache_dir("bench-videos")``: a short
clip, 720p 60 s, 1080p 10 min with a 20 s GOP (long GOP), and a variable-frame-rate clip. All are
H.264 with B-frames (x264 ``ultrafast`` plus ``bframes=3``) over a scrolling texture with a moving
block, so motion compensation and residuals are real but the bit rate is low. Generating the
1080p video takes a few minutes on two cores.

Run from the project root with the main environment::

    envs/main/.venv/bin/python benchmarks/decode.py            # everything (several minutes)
    envs/main/.venv/bin/python benchmarks/decode.py --quick    # short and VFR clips only
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
from numpy.typing import NDArray

from rl_bridge.paths import cache_dir
from vllm_video_plugin.cache import CACHE_DIR_ENV, shared_decode_cache
from vllm_video_plugin.contract import VideoSamplingContract


@dataclass(frozen=True)
class VideoSpec:
    """A generated benchmark video."""

    name: str
    width: int
    height: int
    seconds: float
    fps: int
    gop: int
    """Keyframe interval in frames."""
    vfr: bool = False
    """Irregular frame times (gaps of one or two frame periods, with jitter) instead of 1/fps."""
    only: tuple[str, ...] | None = None
    """Rows to run on this video (``None``: all), to keep the slow stock decodes bounded."""

    @property
    def path(self) -> Path:
        tag = "vfr" if self.vfr else "cfr"
        return cache_dir("bench-videos") / (
            f"{self.name}-{self.width}x{self.height}-{self.seconds:g}s-{self.fps}fps-g{self.gop}-{tag}.mp4"
        )


VIDEOS = (
    VideoSpec("short", 640, 360, 8, 30, 60),
    VideoSpec("720p-60s", 1280, 720, 60, 30, 250),
    VideoSpec("1080p-10min-long-gop", 1920, 1080, 600, 24, 480, only=("opencv", "qwen2_vl")),
    VideoSpec("vfr", 640, 360, 30, 30, 60, vfr=True),
)
QUICK_VIDEOS = ("short", "vfr")


@dataclass(frozen=True)
class Row:
    """One request: a stock loader and the contract that samples the same frames."""

    stock: str
    stock_kwargs: dict[str, Any]
    contract: VideoSamplingContract


ROWS = (
    Row("opencv", {"num_frames": 32}, VideoSamplingContract(style="uniform", num_frames=32)),
    Row("nemotron_vl", {"num_frames": 32}, VideoSamplingContract(style="uniform", num_frames=32)),
    Row("qwen2_vl", {"fps": 2, "max_frames": 64}, VideoSamplingContract(style="qwen2_vl", max_frames=64)),
    Row("qwen3_vl", {"fps": 2, "max_frames": 64}, VideoSamplingContract(style="qwen3_vl", max_frames=64)),
)


# -- video generation ---------------------------------------------------------------------------------


def _frame_times(spec: VideoSpec) -> Iterator[Fraction]:
    """Presentation times in seconds."""
    count = int(spec.seconds * spec.fps)
    if not spec.vfr:
        for index in range(count):
            yield Fraction(index, spec.fps)
        return
    rng = np.random.default_rng(0)
    now = Fraction(0)
    while now < spec.seconds:
        yield now
        # One or two frame periods, plus 0-2 ms of jitter.
        now += Fraction(int(rng.integers(1, 3)), spec.fps) + Fraction(int(rng.integers(0, 3)), 1000)


def generate(spec: VideoSpec) -> Path:
    """Write ``spec``'s video unless it is cached; return its path."""
    path = spec.path
    if path.is_file():
        return path
    partial = path.with_suffix(".partial.mp4")
    started = time.monotonic()
    print(f"generating {path.name} ...", flush=True)
    rng = np.random.default_rng(1)
    width, height = spec.width, spec.height
    texture = rng.integers(16, 236, size=(height, 2 * width), dtype=np.uint8)
    texture = ((texture.astype(np.uint16) + np.roll(texture, 1, axis=1)) // 2).astype(np.uint8)  # soften
    chroma = np.full((height // 2, width // 2), 128, np.uint8)
    time_base = Fraction(1, 90_000) if spec.vfr else Fraction(1, spec.fps)
    with av.open(str(partial), "w", format="mp4") as container:
        stream = container.add_stream(
            "libx264",
            rate=spec.fps,
            options={
                "preset": "ultrafast",
                "crf": "26",
                "g": str(spec.gop),
                "keyint_min": str(spec.gop),
                "sc_threshold": "0",
                "x264-params": "bframes=3",
            },
        )
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = time_base
        for index, seconds in enumerate(_frame_times(spec)):
            shift = index * 4 % width
            luma = np.ascontiguousarray(texture[:, shift : shift + width])
            block = index * 9 % max(1, width - height // 3)
            luma[height // 3 : 2 * height // 3, block : block + height // 3] = 235
            frame = av.VideoFrame(width, height, "yuv420p")
            frame.planes[0].update(luma)
            frame.planes[1].update(chroma)
            frame.planes[2].update(chroma)
            frame.pts = int(seconds / time_base)
            frame.time_base = time_base
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    partial.rename(path)
    print(f"  {path.stat().st_size / 1e6:.1f} MB in {time.monotonic() - started:.0f} s", flush=True)
    return path


# -- measurement --------------------------------------------------------------------------------------


@dataclass
class Result:
    video: str
    row: Row
    frames: int = 0
    stock_s: float = math.nan
    cold_s: float = math.nan
    warm_s: float = math.nan
    identical: str = ""

    @property
    def cold_ratio(self) -> float:
        return self.stock_s / self.cold_s

    @property
    def warm_ratio(self) -> float:
        return self.stock_s / self.warm_s


def _timed(call: Callable[[], tuple[NDArray[np.uint8], dict[str, Any]]]) -> tuple[float, NDArray[np.uint8]]:
    started = time.perf_counter()
    frames, _ = call()
    return time.perf_counter() - started, frames


def measure(video: str, data: bytes, row: Row, *, repeats: int, warm_repeats: int) -> Result:
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    from vllm_video_plugin.loaders import VideoGRPOLoader

    result = Result(video, row)
    stock_loader = VIDEO_LOADER_REGISTRY.load(row.stock)
    stock_times = []
    for _ in range(repeats):
        seconds, stock_frames = _timed(lambda: stock_loader.load_bytes(data, **row.stock_kwargs))
        stock_times.append(seconds)
    result.stock_s = statistics.median(stock_times)

    block = row.contract.to_media_io_kwargs()
    del block["video_backend"]
    cache = shared_decode_cache()
    cold_times = []
    for _ in range(repeats):
        cache.clear_memory()
        seconds, frames = _timed(lambda: VideoGRPOLoader.load_bytes(data, **block))
        cold_times.append(seconds)
    result.cold_s = statistics.median(cold_times)
    result.warm_s = statistics.median(
        _timed(lambda: VideoGRPOLoader.load_bytes(data, **block))[0] for _ in range(warm_repeats)
    )
    result.frames = len(frames)
    if frames.shape != stock_frames.shape:
        result.identical = f"no: {frames.shape[0]} vs {stock_frames.shape[0]} frames"
    elif np.array_equal(frames, stock_frames):
        result.identical = "yes"
    else:
        diff = np.abs(frames.astype(np.int16) - stock_frames.astype(np.int16))
        result.identical = f"max diff {diff.max()}"
    return result


def geometric_mean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(value) for value in values)) if values else math.nan


def report(results: list[Result]) -> None:
    header = (
        f"{'video':<22} {'stock loader':<12} {'frames':>6} {'stock s':>9} {'ours cold s':>11} "
        f"{'ours warm s':>11} {'cold x':>7} {'warm x':>8}  same frames"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in results:
        print(
            f"{r.video:<22} {r.row.stock:<12} {r.frames:>6} {r.stock_s:>9.3f} {r.cold_s:>11.3f} "
            f"{r.warm_s:>11.5f} {r.cold_ratio:>7.2f} {r.warm_ratio:>8.0f}  {r.identical}"
        )
    opencv = [r for r in results if r.row.stock == "opencv"]
    for label, subset in (("all rows", results), ("opencv rows", opencv)):
        print(
            f"geometric mean speed-up, {label} ({len(subset)}): "
            f"cold {geometric_mean([r.cold_ratio for r in subset]):.2f}x, "
            f"warm {geometric_mean([r.warm_ratio for r in subset]):.0f}x"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short and VFR clips only (a smoke run)")
    parser.add_argument("--videos", nargs="+", choices=[v.name for v in VIDEOS], help="videos to run")
    parser.add_argument("--warm-repeats", type=int, default=5, help="warm requests per row (median)")
    args = parser.parse_args(argv)
    os.environ.pop(CACHE_DIR_ENV, None)  # cold means decoding: no disk tier
    names = args.videos or (QUICK_VIDEOS if args.quick else [v.name for v in VIDEOS])
    results = []
    for spec in VIDEOS:
        if spec.name not in names:
            continue
        data = generate(spec).read_bytes()
        repeats = 3 if spec.seconds * spec.fps < 1000 else 1
        for row in ROWS:
            if spec.only is not None and row.stock not in spec.only:
                continue
            result = measure(spec.name, data, row, repeats=repeats, warm_repeats=args.warm_repeats)
            print(
                f"{spec.name} / {row.stock}: stock {result.stock_s:.3f} s, ours cold {result.cold_s:.3f} s, "
                f"warm {result.warm_s:.5f} s",
                flush=True,
            )
            results.append(result)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
