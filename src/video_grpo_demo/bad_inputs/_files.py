"""The files of the bad-input corpus: broken and unusual videos, frame images and manifest contents.

Plain writers without expectations; :mod:`video_grpo_demo.bad_inputs` pairs each with what every
layer owes it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Final

import av
import numpy as np
from PIL import Image

from video_grpo_demo.synthetic.frames import indexed_frames
from video_grpo_demo.synthetic.writer import write_video

GOOD_FRAMES: Final = 8
SIZE: Final = 64
FPS: Final = 8


def good_video(path: Path) -> Path:
    """Write the corpus's well-formed reference clip (H.264 MP4, 8 frames of 64x64 at 8 fps) to ``path``."""
    return write_video(path, indexed_frames(GOOD_FRAMES, width=SIZE, height=SIZE), fps=FPS, gop=4).path


def truncated(directory: Path) -> Path:
    data = good_video(directory / "truncated.src.mp4")
    raw = data.read_bytes()
    data.unlink()
    path = directory / "truncated.mp4"
    path.write_bytes(raw[: len(raw) // 2])  # the index (moov) is at the end: cut off
    return path


def corrupt_middle(directory: Path) -> Path:
    path = good_video(directory / "corrupt_middle.mp4")
    raw = bytearray(path.read_bytes())
    start, end = raw.find(b"mdat") + 4, raw.find(b"moov") - 4
    third = (end - start) // 3
    raw[start + third : end - third] = (
        np.random.default_rng(0).integers(0, 256, third, dtype=np.uint8).tobytes()
    )
    path.write_bytes(bytes(raw))
    return path


def zero_length(directory: Path) -> Path:
    path = directory / "zero_length.mp4"
    path.write_bytes(b"")
    return path


def audio_only(directory: Path) -> Path:
    path = directory / "audio_only.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(
            np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono"
        )
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return path


def zero_decodable_frames(directory: Path) -> Path:
    path = good_video(directory / "zero_decodable_frames.mp4")
    raw = bytearray(path.read_bytes())
    start, end = raw.find(b"mdat") + 4, raw.find(b"moov") - 4
    raw[start:end] = bytes(end - start)  # every packet is there, filled with zeros
    path.write_bytes(bytes(raw))
    return path


def avi(directory: Path, name: str) -> tuple[Path, bytearray]:
    path = write_video(
        directory / name, indexed_frames(GOOD_FRAMES, width=SIZE, height=SIZE), fps=FPS, codec="mpeg4"
    ).path
    return path, bytearray(path.read_bytes())


def overreported_frame_count(directory: Path) -> Path:
    path, raw = avi(directory, "overreported_frame_count.avi")
    # AVI main header (avih) dwTotalFrames and stream header (strh) dwLength claim 1000 frames.
    for tag, offset in ((b"avih", 16), (b"strh", 32)):
        at = raw.find(tag) + 8 + offset
        raw[at : at + 4] = struct.pack("<I", 1000)
    path.write_bytes(bytes(raw))
    return path


def unsupported_codec(directory: Path) -> Path:
    path, raw = avi(directory, "unsupported_codec.avi")
    for tag in (b"FMP4", b"fmp4"):  # the MPEG-4 fourcc, as a codec FFmpeg does not know
        raw = bytearray(bytes(raw).replace(tag, b"QQQZ"))
    path.write_bytes(bytes(raw))
    return path


def variable_frame_rate(directory: Path) -> Path:
    pts = [0.0, 0.1, 0.15, 0.5, 0.55, 0.9, 1.3, 1.35]
    return write_video(
        directory / "variable_frame_rate.mp4",
        indexed_frames(len(pts), width=SIZE, height=SIZE),
        fps=FPS,
        pts_seconds=pts,
    ).path


def rotation(directory: Path) -> Path:
    return write_video(
        directory / "rotation_90.mp4",
        indexed_frames(GOOD_FRAMES, width=SIZE, height=48),
        fps=FPS,
        rotation_degrees=90,
    ).path


def odd_size(directory: Path) -> Path:
    return write_video(
        directory / "odd_size.mp4", indexed_frames(GOOD_FRAMES, width=63, height=47), fps=FPS
    ).path


def tiny(directory: Path) -> Path:
    frames = np.zeros((GOOD_FRAMES, 1, 1, 3), dtype=np.uint8)
    frames[:, 0, 0] = (200, 30, 30)
    return write_video(directory / "tiny_1x1.mp4", frames, fps=FPS).path


def over_pixel_budget(directory: Path) -> Path:
    # A YUV4MPEG2 stream whose header declares 10000x10000 frames (100 million pixels, three times
    # the default budget) followed by a few bytes: refusing it must need nothing but the header.
    path = directory / "over_pixel_budget.mp4"
    path.write_bytes(b"YUV4MPEG2 W10000 H10000 F8:1 Ip A1:1 C420jpeg\nFRAME\n" + bytes(4096))
    return path


def not_a_video(directory: Path) -> Path:
    path = directory / "not_a_video.mp4"
    path.write_text("name,answer\nclip-1,A\n" * 20)
    return path


# Manifests ------------------------------------------------------------------------------------------


def frame_png(path: Path, width: int, height: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(indexed_frames(1, width=width, height=height)[0]).save(path)
    return path


def good_frames(media_root: Path, count: int = 4) -> list[dict[str, Any]]:
    return [
        {
            "path": frame_png(media_root / "frames" / f"{index}.png", SIZE, SIZE)
            .relative_to(media_root)
            .as_posix(),
            "index": index,
        }
        for index in range(count)
    ]


def dotdot(media_root: Path, outside: Path) -> list[dict[str, Any]]:
    return [*good_frames(media_root, 3), {"path": "frames/../../escape.png", "index": 3}]


def absolute_outside(media_root: Path, outside: Path) -> list[dict[str, Any]]:
    target = frame_png(outside / "outside.png", SIZE, SIZE)
    return [*good_frames(media_root, 3), {"path": str(target), "index": 3}]


def symlink_escape(media_root: Path, outside: Path) -> list[dict[str, Any]]:
    target = frame_png(outside / "linked.png", SIZE, SIZE)
    link = media_root / "frames" / "link.png"
    link.unlink(missing_ok=True)
    os.symlink(target, link)
    return [*good_frames(media_root, 3), {"path": "frames/link.png", "index": 3}]


def missing_frame(media_root: Path, outside: Path) -> list[dict[str, Any]]:
    return [*good_frames(media_root, 3), {"path": "frames/never_written.png", "index": 3}]


def mixed_shapes(media_root: Path, outside: Path) -> list[dict[str, Any]]:
    wide = frame_png(media_root / "frames" / "wide.png", 2 * SIZE, SIZE)
    return [*good_frames(media_root, 3), {"path": wide.relative_to(media_root).as_posix(), "index": 3}]


def malformed_json(media_root: Path, outside: Path) -> str:
    return '{"format": "video_grpo.frames/v1", "source_fps": 8.0, "frames": [{"path": "frames/0.png",'


def wrong_types(media_root: Path, outside: Path) -> str:
    good_frames(media_root, 1)
    return json.dumps(
        {
            "format": "video_grpo.frames/v1",
            "source_fps": "eight",
            "frames": [{"path": "frames/0.png", "index": "0"}],
        }
    )
