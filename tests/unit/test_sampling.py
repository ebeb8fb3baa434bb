"""Sampling styles against hand-worked cases, plus invariants over many videos.

The expected indices below are worked out by hand from each style's rules (see the docstrings in
``vllm_video_plugin.sampling``); bit-exact parity with vLLM's and transformers' own code is in
``tests/integration/test_sampling_parity.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.errors import VideoSamplingError
from vllm_video_plugin.sampling import (
    PRESENTATION_INDEX_FPS,
    QWEN3_UNKNOWN_FPS,
    nemotron_prompt_timestamps,
    presentation_timed,
    qwen2_vl_indices,
    qwen3_prompt_timestamps,
    sample_frames,
)

pytestmark = pytest.mark.unit

NTSC = 29.97


def uniform(num_frames: int | None = None, fps: float | None = None) -> VideoSamplingContract:
    return VideoSamplingContract(style="uniform", num_frames=num_frames, fps=fps)


def nemotron(num_frames: int, temporal_patch_size: int = 2) -> VideoSamplingContract:
    return VideoSamplingContract(
        style="nemotron_rounded", num_frames=num_frames, temporal_patch_size=temporal_patch_size
    )


def qwen2(fps: float = 2.0, **fields: int) -> VideoSamplingContract:
    return VideoSamplingContract(style="qwen2_vl", fps=fps, **fields)


def qwen3(fps: float = 2.0, **fields: int) -> VideoSamplingContract:
    return VideoSamplingContract(style="qwen3_vl", fps=fps, **fields)


def indices(total: int, source_fps: float, contract: VideoSamplingContract) -> list[int]:
    return list(sample_frames(total, source_fps, total / source_fps, contract).indices)


# -- uniform (stock vLLM opencv / nemotron_vl) --------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "source_fps", "contract", "expected"),
    [
        (1, 30.0, uniform(8), [0]),  # 1-frame video
        (2, 30.0, uniform(8), [0, 1]),  # 2 frames, more requested: every frame
        (10, 30.0, uniform(4), [0, 3, 6, 9]),  # linspace(0, 9, 4) = 0, 3, 6, 9
        (11, 30.0, uniform(4), [0, 3, 6, 10]),  # 0, 3.33, 6.67, 10 truncated
        (5, 30.0, uniform(32), [0, 1, 2, 3, 4]),  # count above the total
        (7, 30.0, uniform(), list(range(7))),  # no count, no fps: every frame
        (300, NTSC, uniform(4), [0, 99, 199, 299]),  # 99.67 and 199.33 truncated
        (3, 30.0, uniform(8, fps=2.0), [0]),  # floor(0.1 s * 2) = 0, at least one frame
        # 300 frames at 30 fps = 10 s; fps 2 caps 32 to 20; step 299 / 19 = 15.74, truncated.
        (
            300,
            30.0,
            uniform(32, fps=2.0),
            [0, 15, 31, 47, 62, 78, 94, 110, 125, 141, 157, 173, 188, 204, 220, 236, 251, 267, 283, 299],
        ),
    ],
)
def test_uniform(total: int, source_fps: float, contract: VideoSamplingContract, expected: list[int]) -> None:
    assert indices(total, source_fps, contract) == expected


def test_uniform_timestamps_and_nemotron_prompt_text_at_29_97_fps() -> None:
    sample = sample_frames(300, NTSC, 300 / NTSC, uniform(4))
    assert sample.timestamps_s == pytest.approx((0.0, 99 / NTSC, 199 / NTSC, 299 / NTSC))
    # int(1000 / 29.97) = 33 ms per frame.
    assert sample.prompt_timestamps_s == (0.0, 3.267, 6.567, 9.867)
    assert sample.seconds_per_temporal_patch is None
    assert sample.source_fps == NTSC and sample.total_frames == 300


def test_nemotron_prompt_timestamps_use_whole_milliseconds() -> None:
    assert nemotron_prompt_timestamps([30], NTSC) == (0.99,)  # not 30 / 29.97 = 1.001
    assert nemotron_prompt_timestamps([0, 9, 18], 8.0) == (0.0, 1.125, 2.25)  # 125 ms
    assert nemotron_prompt_timestamps([1], 7.0) == (0.142,)  # int(142.86) ms


# -- nemotron_rounded (NeMo RL) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "source_fps", "contract", "expected"),
    [
        (20, 2.0, nemotron(4), [0, 6, 13, 19]),  # 6.33 -> 6, 12.67 -> 13 (stock uniform: 12)
        (1, 30.0, nemotron(8), [0, 0]),  # 1 frame repeated to fill a 2-frame tubelet
        (1, 30.0, nemotron(8, temporal_patch_size=4), [0, 0, 0, 0]),
        (2, 30.0, nemotron(8), [0, 1]),
        (3, 30.0, nemotron(8), [0, 2]),  # 3 rounds down to 2
        (100, 25.0, nemotron(5), [0, 33, 66, 99]),  # odd request rounds down to 4
        (101, 25.0, nemotron(3, temporal_patch_size=1), [0, 50, 100]),
        (7, 7.0, nemotron(32), [0, 1, 2, 4, 5, 6]),  # 7 rounds to 6; round(k * 6 / 5)
        (300, NTSC, nemotron(4), [0, 100, 199, 299]),  # 99.67 rounds to 100
    ],
)
def test_nemotron_rounded(
    total: int, source_fps: float, contract: VideoSamplingContract, expected: list[int]
) -> None:
    assert indices(total, source_fps, contract) == expected


def test_nemotron_rounded_prompt_text() -> None:
    sample = sample_frames(300, NTSC, 300 / NTSC, nemotron(4))
    assert sample.prompt_timestamps_s == (0.0, 3.3, 6.567, 9.867)
    one_frame = sample_frames(1, 30.0, 1 / 30, nemotron(8))
    assert one_frame.indices == (0, 0) and one_frame.prompt_timestamps_s == (0.0, 0.0)


# -- qwen2_vl (Qwen2-VL, Qwen2.5-VL) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "source_fps", "contract", "expected"),
    [
        (64, 8.0, qwen2(), list(range(0, 64, 4))),  # 64 / 8 * 2 = 16 frames, step 4
        (45, 15.0, qwen2(), [0, 7, 15, 22, 30, 37]),  # 6 frames, step 7.5 truncated
        (3, 30.0, qwen2(), [0, 1]),  # min_frames 4, capped to 2 (3 floored to a tubelet multiple)
        (2, 30.0, qwen2(), [0, 1]),
        (10, 10.0, qwen2(fps=30.0), list(range(10))),  # 30 requested above the 10 there are
        (300, NTSC, qwen2(), list(range(0, 300, 15))),  # 20.02 floored to 20, step 15
        (64, 8.0, qwen2(min_frames=40), [int(i * 1.6) for i in range(40)]),
        (64, 8.0, qwen2(max_frames=5), [0, 16, 32, 48]),  # max 5 floored to 4
        (64, 8.0, qwen2(fps=0.1, min_frames=2), [0, 32]),  # 0.8 frames, raised to min_frames
        (64, 8.0, qwen2(temporal_patch_size=3), [int(i * 64 / 15) for i in range(15)]),  # 16 -> 15
    ],
)
def test_qwen2_vl(
    total: int, source_fps: float, contract: VideoSamplingContract, expected: list[int]
) -> None:
    assert indices(total, source_fps, contract) == expected


def test_qwen2_vl_reproduces_torch_float32_arange() -> None:
    # 30 frames, 22 sampled: step 30 / 22. Index 11 is 15 exactly in real arithmetic; float64 gives
    # 14.999999999999998 (-> 14) but torch's float32 vector lanes give 15.0, and vLLM/HF keep 15.
    sampled = qwen2_vl_indices(30, 30.0, fps=22.0, min_frames=4, max_frames=768, temporal_patch_size=2)
    assert len(sampled) == 22 and sampled[11] == 15
    # 17 frames, 14 sampled: ceil(17 / (17 / 14)) = 15 values; the 15th (17.0) is clamped to 16.
    sampled = qwen2_vl_indices(17, 17.0, fps=14.0, min_frames=4, max_frames=768, temporal_patch_size=2)
    assert sampled == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16]


def test_qwen2_vl_seconds_per_temporal_patch() -> None:
    # 16 of 64 frames at 8 fps: sampled at 2 fps, so a 2-frame patch spans 1 s.
    assert sample_frames(64, 8.0, 8.0, qwen2()).seconds_per_temporal_patch == 1.0
    # 6 of 45 frames at 15 fps: 2 fps; 3 of ... T=2 -> 2 / (6 / 45 * 15) = 1.0
    assert sample_frames(45, 15.0, 3.0, qwen2()).seconds_per_temporal_patch == pytest.approx(1.0)
    assert sample_frames(64, 8.0, 8.0, qwen2()).prompt_timestamps_s == ()


@pytest.mark.parametrize("total", [0, 1])
def test_qwen2_vl_refuses_videos_shorter_than_a_tubelet(total: int) -> None:
    with pytest.raises(VideoSamplingError, match="frames"):
        indices(total, 30.0, qwen2())


def test_qwen2_vl_needs_the_source_rate() -> None:
    with pytest.raises(VideoSamplingError, match="frame rate"):
        sample_frames(64, 0.0, 0.0, qwen2())


# -- qwen3_vl -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "source_fps", "contract", "expected"),
    [
        (64, 8.0, qwen3(), [0, 4, 8, 13, 17, 21, 25, 29, 34, 38, 42, 46, 50, 55, 59, 63]),  # step 4.2
        (1, 30.0, qwen3(), [0]),
        (2, 30.0, qwen3(), [0, 1]),
        (3, 30.0, qwen3(), [0, 1, 2]),  # min_frames 4 capped by the total
        (5, 30.0, qwen3(fps=30.0), [0, 1, 2, 3, 4]),
        (
            300,
            NTSC,
            qwen3(),
            [0, 16, 31, 47, 63, 79, 94, 110, 126, 142, 157, 173, 189, 205, 220, 236, 252, 268, 283, 299],
        ),
        (64, 8.0, qwen3(min_frames=1, max_frames=3), [0, 32, 63]),  # 31.5 rounds half to even
    ],
)
def test_qwen3_vl(
    total: int, source_fps: float, contract: VideoSamplingContract, expected: list[int]
) -> None:
    assert indices(total, source_fps, contract) == expected


def test_qwen3_vl_prompt_timestamps_average_each_temporal_patch() -> None:
    sample = sample_frames(64, 8.0, 8.0, qwen3())
    assert sample.prompt_timestamps_s[:3] == (0.25, 1.3125, 2.375)  # (0 + 4) / 16, (8 + 13) / 16, ...
    assert len(sample.prompt_timestamps_s) == 8
    # An odd count repeats the last frame: 0, 1, 2, 2 at 30 fps.
    assert sample_frames(3, 30.0, 0.1, qwen3()).prompt_timestamps_s == (1 / 60, 2 / 30)
    assert qwen3_prompt_timestamps([0], 30.0, 2) == (0.0,)


def test_qwen3_vl_assumes_24_fps_when_the_rate_is_unknown() -> None:
    sample = sample_frames(48, 0.0, 0.0, qwen3())  # 48 / 24 * 2 = 4 frames
    assert sample.indices == (0, 16, 31, 47)
    assert sample.source_fps == QWEN3_UNKNOWN_FPS
    assert sample.prompt_timestamps_s == ((0 + 16 / 24) / 2, (31 / 24 + 47 / 24) / 2)


# -- errors and invariants --------------------------------------------------------------------------


@pytest.mark.parametrize("contract", [uniform(4), nemotron(4), qwen3()])
def test_empty_video_is_refused(contract: VideoSamplingContract) -> None:
    with pytest.raises(VideoSamplingError, match="0 frames"):
        sample_frames(0, 30.0, 0.0, contract)


@pytest.mark.parametrize("contract", [uniform(4), nemotron(4)])
def test_nemotron_styles_need_the_source_rate(contract: VideoSamplingContract) -> None:
    with pytest.raises(VideoSamplingError, match="frame rate"):
        sample_frames(10, 0.0, 0.0, contract)


def test_negative_duration_is_refused() -> None:
    with pytest.raises(VideoSamplingError, match="duration"):
        sample_frames(10, 30.0, -1.0, uniform(4))


CONTRACTS = st.one_of(
    st.builds(uniform, st.none() | st.integers(1, 100), st.none() | st.floats(0.1, 60)),
    st.builds(nemotron, st.integers(1, 100), st.integers(1, 4)),
    st.builds(
        lambda fps, lo, extra, tps: qwen2(
            fps, min_frames=lo + tps, max_frames=lo + tps + extra, temporal_patch_size=tps
        ),
        st.floats(0.1, 30),
        st.integers(1, 16),
        st.integers(0, 200),
        st.integers(1, 4),
    ),
    st.builds(
        lambda fps, lo, extra: qwen3(fps, min_frames=lo, max_frames=lo + extra),
        st.floats(0.1, 30),
        st.integers(1, 16),
        st.integers(0, 200),
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(1, 3000),
    source_fps=st.sampled_from([8.0, 23.976, 25.0, NTSC, 30.0, 60.0, 0.5]),
    contract=CONTRACTS,
)
def test_sampling_invariants(total: int, source_fps: float, contract: VideoSamplingContract) -> None:
    try:
        sample = sample_frames(total, source_fps, total / source_fps, contract)
    except VideoSamplingError:
        assert contract.style == "qwen2_vl" and total < contract.temporal_patch_size
        return
    picked = sample.indices
    assert picked and all(0 <= index < total for index in picked)
    assert list(picked) == sorted(picked)
    assert len(sample.timestamps_s) == len(picked)
    tps = contract.temporal_patch_size
    if contract.style == "nemotron_rounded":
        assert len(picked) % tps == 0
        assert len(picked) <= max(tps, min(total, contract.num_frames or 0))
    if contract.style in ("uniform", "nemotron_rounded"):
        assert len(set(picked)) == len(picked) or total < tps
        assert len(sample.prompt_timestamps_s) == len(picked)
    if contract.style == "qwen3_vl":
        assert len(sample.prompt_timestamps_s) == -(-len(picked) // tps)


def test_presentation_timing_makes_the_processors_arithmetic_give_the_presentation_times() -> None:
    played = [0.0, 0.15, 0.52, 1.7, 3.0, 3.5, 3.9]  # a variable-frame-rate clip's sampled frames
    contract = VideoSamplingContract(style="uniform", num_frames=7)
    nominal = sample_frames(14, 14 / 3.75, 3.75, contract)
    timed = presentation_timed(nominal, played)
    assert timed.source_fps == PRESENTATION_INDEX_FPS and timed.indices == (
        0,
        150,
        520,
        1700,
        3000,
        3500,
        3900,
    )
    # Nemotron's arithmetic (whole-millisecond frame duration) is exact on the millisecond clock.
    assert nemotron_prompt_timestamps(timed.indices, timed.source_fps) == tuple(played)
    assert timed.prompt_timestamps_s == tuple(played) and timed.timestamps_s == tuple(played)
    assert timed.total_frames == 3901 and timed.duration_s == nominal.duration_s
    qwen3 = presentation_timed(
        sample_frames(14, 14 / 3.75, 3.75, VideoSamplingContract(style="qwen3_vl")), played
    )
    assert qwen3.prompt_timestamps_s == pytest.approx([0.075, 1.11, 3.25, 3.9])  # mean of each 2-frame patch
    with pytest.raises(VideoSamplingError, match="2 times for 7 sampled frames"):
        presentation_timed(nominal, played[:2])
    with pytest.raises(VideoSamplingError, match="writes no times"):
        presentation_timed(sample_frames(14, 3.7, 3.75, VideoSamplingContract(style="qwen2_vl")), played)
