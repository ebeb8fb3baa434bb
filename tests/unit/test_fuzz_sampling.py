"""Fuzzing the sampling styles: any frame count, rate, duration and contract gives a usable sample
or a VideoSamplingError, and the indices agree with independent references.

References: exact rational arithmetic for the linspace-based styles (where float rounding cannot
decide the answer, any neighbouring integer is accepted) and the real ``torch.arange`` for
``qwen2_vl`` (whose float32 kernel :func:`vllm_video_plugin.sampling._torch_float32_arange`
reproduces). Bit-exact parity with vLLM and transformers is in
``tests/integration/test_sampling_parity.py``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllm_video_plugin.contract import QWEN_MAX_FPS, QWEN_MAX_FRAMES, VideoSamplingContract
from vllm_video_plugin.errors import VideoSamplingError
from vllm_video_plugin.sampling import (
    nemotron_rounded_indices,
    qwen2_vl_indices,
    qwen3_vl_indices,
    sample_frames,
    uniform_indices,
)

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=400, deadline=2000)

# Rates and durations as a hostile container may report them, not only plausible ones.
ANY_RATE = st.floats(min_value=0.0, exclude_min=True, allow_infinity=False, allow_nan=False)
ANY_DURATION = st.floats(min_value=0.0, allow_infinity=False, allow_nan=False)
TOTAL = st.integers(1, 200_000)
PLAUSIBLE_RATE = st.floats(0.5, 240.0)

UNIFORM = st.builds(
    lambda n, fps: VideoSamplingContract(style="uniform", num_frames=n, fps=fps),
    st.none() | st.integers(1, 1024),
    st.none() | ANY_RATE,
)
NEMOTRON = st.builds(
    lambda n, tps: VideoSamplingContract(style="nemotron_rounded", num_frames=n, temporal_patch_size=tps),
    st.integers(1, 1024),
    st.integers(1, 4),
)


@st.composite
def qwen_contracts(draw: st.DrawFn, style: str) -> VideoSamplingContract:
    tps = draw(st.integers(1, 4))
    low = tps if style == "qwen2_vl" else 1
    min_frames = draw(st.integers(low, 64))
    max_frames = draw(st.integers(min_frames, QWEN_MAX_FRAMES))
    fps = draw(st.floats(min_value=0.0, max_value=QWEN_MAX_FPS, exclude_min=True))
    return VideoSamplingContract(
        style=style, fps=fps, min_frames=min_frames, max_frames=max_frames, temporal_patch_size=tps
    )


CONTRACTS = st.one_of(UNIFORM, NEMOTRON, qwen_contracts("qwen2_vl"), qwen_contracts("qwen3_vl"))


def _near_integer(value: Fraction, tolerance: float = 1e-6) -> bool:
    return abs(value - round(value)) < tolerance


def _near_half(value: Fraction, tolerance: float = 1e-6) -> bool:
    return abs((value - math.floor(value)) - Fraction(1, 2)) < tolerance


def _linspace_exact(total: int, count: int) -> list[Fraction]:
    """``linspace(0, total - 1, count)`` in exact arithmetic."""
    if count == 1:
        return [Fraction(0)]
    return [Fraction(k * (total - 1), count - 1) for k in range(count)]


def _assert_truncated(actual: list[int], exact: list[Fraction]) -> None:
    for got, value in zip(actual, exact, strict=True):
        assert got == math.floor(value) or (_near_integer(value) and abs(got - value) <= 1), (got, value)


def _assert_rounded(actual: list[int], exact: list[Fraction]) -> None:
    for got, value in zip(actual, exact, strict=True):
        expected = round(value)  # half to even, as numpy and Python round
        assert got == expected or (
            _near_half(value) and abs(got - value) <= Fraction(1, 2) + Fraction(1, 10**6)
        )


# -- any input: a valid sample or VideoSamplingError ----------------------------------------------


@FUZZ
@given(total=TOTAL, source_fps=ANY_RATE | st.just(0.0), duration=ANY_DURATION, contract=CONTRACTS)
# A frame rate so small that one frame lasts longer than a float can say (1000 / fps = inf).
@example(
    total=1, source_fps=5e-324, duration=0.0, contract=VideoSamplingContract(style="uniform", num_frames=1)
)
# duration * fps overflows to inf before the floor.
@example(total=2, source_fps=1.0, duration=1e300, contract=VideoSamplingContract(style="uniform", fps=1e300))
# total / duration overflows to an infinite rate, then 0 * inf = nan.
@example(
    total=2,
    source_fps=1.0,
    duration=5e-324,
    contract=VideoSamplingContract(style="nemotron_rounded", num_frames=2),
)
# total / source_fps overflows before the clamp to [min_frames, max_frames].
@example(total=2, source_fps=5e-324, duration=1.0, contract=VideoSamplingContract(style="qwen3_vl"))
# 1000 / fps is finite, but a frame index times it overflows (and qwen3's timestamps are infinite).
@example(
    total=3, source_fps=6.447186387917766e-306, duration=0.0, contract=VideoSamplingContract(style="uniform")
)
@example(
    total=581,
    source_fps=6.447186387917766e-306,
    duration=0.0,
    contract=VideoSamplingContract(
        style="qwen3_vl", fps=1.0, min_frames=1, max_frames=2, temporal_patch_size=1
    ),
)
def test_any_video_gives_a_usable_sample_or_a_sampling_error(
    total: int, source_fps: float, duration: float, contract: VideoSamplingContract
) -> None:
    try:
        sample = sample_frames(total, source_fps, duration, contract)
    except VideoSamplingError as error:
        assert str(error)
        return
    picked = list(sample.indices)
    assert picked, "a sample has at least one frame"
    assert picked == sorted(picked)
    assert all(0 <= index < total for index in picked)
    assert len(sample.timestamps_s) == len(picked)
    assert all(math.isfinite(t) and t >= 0 for t in (*sample.timestamps_s, *sample.prompt_timestamps_s))
    assert sample.total_frames == total and math.isfinite(sample.source_fps) and sample.source_fps > 0
    tps = contract.temporal_patch_size
    if contract.style == "uniform":
        assert len(picked) <= min(total, contract.num_frames or total)
        assert len(set(picked)) == len(picked)
        assert len(sample.prompt_timestamps_s) == len(picked)
    elif contract.style == "nemotron_rounded":
        assert contract.num_frames is not None
        assert len(picked) % tps == 0 and len(picked) <= max(tps, min(total, contract.num_frames))
    elif contract.style == "qwen2_vl":
        assert contract.max_frames is not None and contract.min_frames is not None
        assert total >= tps
        # torch.arange(0, total, total / n) may yield n + 1 values (clamped to the last frame), as
        # in vLLM and transformers; n itself is whole patches within [min_frames, max_frames].
        assert len(picked) <= min(contract.max_frames, total) + 1
        assert sample.seconds_per_temporal_patch is not None and sample.seconds_per_temporal_patch > 0
    else:
        assert contract.max_frames is not None and contract.min_frames is not None
        assert min(contract.min_frames, total) <= len(picked) <= min(contract.max_frames, total)
        assert len(sample.prompt_timestamps_s) == -(-len(picked) // tps)


@FUZZ
@given(total=TOTAL, source_fps=ANY_RATE, duration=ANY_DURATION)
@example(total=1, source_fps=5e-324, duration=1.0)
def test_invalid_rates_and_durations_are_named_in_the_error(
    total: int, source_fps: float, duration: float
) -> None:
    bad_rate = -source_fps
    with pytest.raises(VideoSamplingError, match="frame rate"):
        sample_frames(total, bad_rate, duration, VideoSamplingContract(style="uniform", num_frames=4))
    with pytest.raises(VideoSamplingError, match="duration"):
        sample_frames(
            total, source_fps, -duration - 1.0, VideoSamplingContract(style="uniform", num_frames=4)
        )
    with pytest.raises(VideoSamplingError, match="at least one"):
        sample_frames(0, source_fps, duration, VideoSamplingContract(style="qwen3_vl"))


# -- plausible input: agreement with references ---------------------------------------------------


@FUZZ
@given(
    total=TOTAL,
    source_fps=PLAUSIBLE_RATE,
    num_frames=st.none() | st.integers(1, 1024),
    fps=st.none() | st.floats(0.01, 120.0),
)
def test_uniform_matches_exact_linspace(
    total: int, source_fps: float, num_frames: int | None, fps: float | None
) -> None:
    duration = total / source_fps
    picked = uniform_indices(total, duration, num_frames=num_frames, fps=fps)
    count = min(total, num_frames or total)
    if fps is not None:
        count = min(count, math.floor(duration * fps))
    count = max(1, count)
    assert len(picked) == count
    if count == total:
        assert picked == list(range(total))
    else:
        _assert_truncated(picked, _linspace_exact(total, count))


@FUZZ
@given(total=TOTAL, source_fps=PLAUSIBLE_RATE, num_frames=st.integers(1, 1024), tps=st.integers(1, 4))
def test_nemotron_rounded_matches_exact_rounding(
    total: int, source_fps: float, num_frames: int, tps: int
) -> None:
    picked = nemotron_rounded_indices(
        total, total / source_fps, num_frames=num_frames, temporal_patch_size=tps
    )
    count = min(num_frames, total)
    if count % tps:
        count = max(tps, count - count % tps)
    assert len(picked) == count
    if total == 1 or count == 1:
        assert picked == [0] * count
    else:
        _assert_rounded(picked, _linspace_exact(total, count))


@FUZZ
@given(
    total=st.integers(1, 20_000),
    source_fps=PLAUSIBLE_RATE,
    fps=st.floats(0.01, QWEN_MAX_FPS),
    tps=st.integers(1, 4),
    min_extra=st.integers(0, 16),
    max_frames=st.integers(1, QWEN_MAX_FRAMES),
)
def test_qwen2_vl_matches_torch_arange(
    total: int, source_fps: float, fps: float, tps: int, min_extra: int, max_frames: int
) -> None:
    min_frames = tps + min_extra
    max_frames = max(max_frames, min_frames)
    try:
        picked = qwen2_vl_indices(
            total, source_fps, fps=fps, min_frames=min_frames, max_frames=max_frames, temporal_patch_size=tps
        )
    except VideoSamplingError:
        assert total < tps
        return
    # transformers' Qwen2VLVideoProcessor.sample_frames, step by step.
    capped_max = math.floor(min(max_frames, total) / tps) * tps
    count = min(max(total / source_fps * fps, min_frames), capped_max, total)
    count = math.floor(count / tps) * tps
    reference = torch.arange(0, total, total / count).int().clamp(max=total - 1)
    assert picked == reference.tolist()


@FUZZ
@given(
    total=TOTAL,
    source_fps=PLAUSIBLE_RATE | st.just(0.0),
    fps=st.floats(0.01, QWEN_MAX_FPS),
    min_frames=st.integers(1, 64),
    max_frames=st.integers(1, QWEN_MAX_FRAMES),
)
def test_qwen3_vl_matches_exact_rounding(
    total: int, source_fps: float, fps: float, min_frames: int, max_frames: int
) -> None:
    max_frames = max(max_frames, min_frames)
    picked = qwen3_vl_indices(total, source_fps, fps=fps, min_frames=min_frames, max_frames=max_frames)
    rate = source_fps if source_fps > 0 else 24.0
    count = min(max(int(total / rate * fps), min_frames), max_frames, total)
    assert len(picked) == count
    _assert_rounded(picked, _linspace_exact(total, count))
