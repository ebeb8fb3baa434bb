"""Synthetic videos: what write_video reports is what PyAV decodes, and task answers are verifiable."""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction
from itertools import groupby
from pathlib import Path

import av
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.media import SAMPLE_FPS, SAMPLE_GOP, SAMPLE_NUM_FRAMES, SAMPLE_SIZE
from video_grpo_demo.synthetic import (
    PALETTE,
    SATURATED_COLOURS,
    SHAPES,
    TASKS,
    BarcodeError,
    ClipConfig,
    TaskRecord,
    classify_colour,
    classify_shape,
    default_codec,
    draw_frame_index,
    generate_task_clips,
    indexed_frames,
    make_task_clip,
    read_frame_index,
    read_records_jsonl,
    shape_frame,
    shape_mask,
    solid_frame,
    write_records_jsonl,
    write_video,
)

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Decoded:
    frames: list[np.ndarray]
    """RGB frames in presentation order."""
    times: list[float]
    """Presentation time of each frame, in seconds."""
    keyframes: list[int]
    """Indices of frames the decoder flags as keyframes."""
    rotation: int
    average_rate: Fraction | None


def decode(path: Path) -> Decoded:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        decoded = list(container.decode(stream))
        rate = stream.average_rate
    return Decoded(
        frames=[frame.to_ndarray(format="rgb24") for frame in decoded],
        times=[float(frame.time) for frame in decoded],
        keyframes=[i for i, frame in enumerate(decoded) if frame.key_frame],
        rotation=decoded[0].rotation,
        average_rate=rate,
    )


# --- frame content -------------------------------------------------------------------------------


def test_default_codec_is_h264_in_this_environment() -> None:
    assert default_codec() == "libx264"


@settings(max_examples=40, deadline=None)
@given(
    index=st.integers(0, 8**4 - 1),
    width=st.integers(40, 160),
    height=st.integers(8, 120),
    fill=st.sampled_from(list(PALETTE)),
)
def test_barcode_round_trips_on_raw_frames(index: int, width: int, height: int, fill: str) -> None:
    frame = draw_frame_index(solid_frame(fill, width=width, height=height), index)  # type: ignore[arg-type]
    assert read_frame_index(frame) == index


def test_barcode_rejects_damage_and_bad_input() -> None:
    frame = draw_frame_index(solid_frame("red", width=112, height=112), 1234)
    damaged = frame.copy()
    damaged[:14, :22] = PALETTE["white"] if tuple(frame[5, 5]) != PALETTE["white"] else PALETTE["black"]
    with pytest.raises(BarcodeError, match="check digit"):
        read_frame_index(damaged)
    grey = np.full_like(frame, 128)
    with pytest.raises(BarcodeError, match="unreadable"):
        read_frame_index(grey)
    with pytest.raises(ValueError, match="does not fit"):
        draw_frame_index(frame, 8**4)
    with pytest.raises(ValueError, match="needs at least"):
        draw_frame_index(solid_frame("red", width=30, height=30), 0)


def test_indexed_frames_fill_colour_survives_the_barcode() -> None:
    frames = indexed_frames(8, width=64, height=48)
    assert [classify_colour(f) for f in frames] == [SATURATED_COLOURS[i % 6] for i in range(8)]
    assert [read_frame_index(f) for f in frames] == list(range(8))


def test_classify_colour_refuses_non_palette_regions() -> None:
    assert classify_colour(np.array([240, 20, 10], dtype=np.uint8)) == "red"
    assert (
        classify_colour(
            np.array([240, 20, 10], dtype=np.uint8), candidates=["blue", "yellow"], max_distance=None
        )
        == "yellow"
    )
    with pytest.raises(ValueError, match="not flat content"):
        classify_colour(np.full((4, 4, 3), 128, dtype=np.uint8))
    with pytest.raises(ValueError, match="unknown colour"):
        solid_frame("orange", width=8, height=8)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("width", "height"), [(112, 112), (96, 64), (48, 48)])
def test_classify_shape_on_raw_frames(shape: str, width: int, height: int) -> None:
    frame = shape_frame(shape, "cyan", width=width, height=height)  # type: ignore[arg-type]
    assert classify_shape(frame) == shape
    assert classify_shape(solid_frame("black", width=width, height=height)) is None


def test_classify_shape_after_lossy_encoding(tmp_path: Path) -> None:
    frames = [shape_frame(s, c, width=48, height=48) for s in SHAPES for c in SATURATED_COLOURS]
    decoded = decode(write_video(tmp_path / "shapes.mp4", frames, fps=8).path)
    assert [classify_shape(f) for f in decoded.frames] == [s for s in SHAPES for _ in SATURATED_COLOURS]


def test_classify_shape_refuses_other_shapes() -> None:
    ring = shape_frame("circle", "green", width=64, height=64)
    ring[shape_mask("circle", width=64, height=64, scale=0.5)] = PALETTE["black"]
    with pytest.raises(ValueError, match="matches no known shape"):
        classify_shape(ring)


# --- write_video round trips ---------------------------------------------------------------------


def test_sample_video_fixture(sample_video: Path, sample_video_written) -> None:
    assert sample_video.suffix == ".mp4" and sample_video.is_file()
    decoded = decode(sample_video)
    assert len(decoded.frames) == SAMPLE_NUM_FRAMES
    assert decoded.frames[0].shape == (SAMPLE_SIZE, SAMPLE_SIZE, 3)
    assert decoded.average_rate == SAMPLE_FPS
    assert [read_frame_index(f) for f in decoded.frames] == list(range(SAMPLE_NUM_FRAMES))
    assert decoded.keyframes == list(range(0, SAMPLE_NUM_FRAMES, SAMPLE_GOP))
    assert sample_video_written.codec == default_codec()
    assert sample_video_written.duration_seconds == SAMPLE_NUM_FRAMES / SAMPLE_FPS


def test_make_video_factory(make_video) -> None:
    first = make_video(num_frames=5, width=64, height=48, codec="mpeg4")
    second = make_video(frames=[solid_frame("blue", width=40, height=40)] * 3, name="blue", suffix=".mkv")
    assert first != second and second.name == "blue.mkv"
    decoded = decode(first)
    assert decoded.frames[0].shape == (48, 64, 3)
    assert [read_frame_index(f) for f in decoded.frames] == list(range(5))
    assert [classify_colour(f) for f in decode(second).frames] == ["blue"] * 3


@pytest.mark.parametrize(
    ("codec", "suffix", "container"),
    [
        ("libx264", ".mp4", "mp4"),
        ("mpeg4", ".mp4", "mp4"),
        ("libvpx-vp9", ".webm", "webm"),
        ("ffv1", ".mkv", "matroska"),
        ("mjpeg", ".avi", "avi"),
    ],
)
def test_round_trip_per_codec(tmp_path: Path, codec: str, suffix: str, container: str) -> None:
    frames = indexed_frames(10, width=96, height=64)
    written = write_video(tmp_path / f"v{suffix}", frames, fps=10, codec=codec)
    assert (written.codec, written.container, written.num_frames) == (codec, container, 10)
    assert written.pts_seconds == pytest.approx([i / 10 for i in range(10)])
    decoded = decode(written.path)
    assert len(decoded.frames) == 10
    assert decoded.frames[0].shape == (64, 96, 3)
    assert decoded.times == pytest.approx(written.pts_seconds, abs=1e-3)
    assert [read_frame_index(f) for f in decoded.frames] == list(range(10))
    assert [classify_colour(f) for f in decoded.frames] == [SATURATED_COLOURS[i % 6] for i in range(10)]


@pytest.mark.parametrize(
    ("fps", "rate"), [(Fraction(30000, 1001), Fraction(30000, 1001)), (12.5, Fraction(25, 2))]
)
def test_fractional_fps(tmp_path: Path, fps: float | Fraction, rate: Fraction) -> None:
    written = write_video(tmp_path / "rate.mp4", indexed_frames(4, width=64, height=64), fps=fps)
    assert written.fps == pytest.approx(float(rate))
    decoded = decode(written.path)
    assert decoded.average_rate == rate
    assert decoded.times == pytest.approx([float(i / rate) for i in range(4)], abs=1e-6)


@pytest.mark.parametrize(("suffix", "tolerance"), [(".mp4", 1e-6), (".mkv", 5e-4)])
def test_variable_frame_rate_timestamps(tmp_path: Path, suffix: str, tolerance: float) -> None:
    pts = [0.0, 0.1, 0.3, 0.333, 0.9, 0.95, 2.0]
    written = write_video(
        tmp_path / f"vfr{suffix}", indexed_frames(7, width=64, height=64), fps=8, pts_seconds=pts
    )
    assert written.pts_seconds == pytest.approx(pts)
    assert written.duration_seconds == pytest.approx(2.125)
    decoded = decode(written.path)
    assert decoded.times == pytest.approx(pts, abs=tolerance)
    assert [read_frame_index(f) for f in decoded.frames] == list(range(7))


@pytest.mark.parametrize("codec", ["libx264", "libx265", "mpeg4"])
@pytest.mark.parametrize("gop", [1, 3, 5])
def test_keyframe_interval_matches_gop(tmp_path: Path, codec: str, gop: int) -> None:
    # Hard colour cuts on every frame would make encoders add scene-cut keyframes without the fix.
    written = write_video(
        tmp_path / "gop.mp4", indexed_frames(12, width=64, height=64), fps=8, codec=codec, gop=gop
    )
    expected = list(range(0, 12, gop))
    assert list(written.keyframe_indices) == expected
    with av.open(str(written.path)) as container:
        packets = [p for p in container.demux(video=0) if p.pts is not None]
        time_base = container.streams.video[0].time_base
    demuxed = sorted(round(float(p.pts * time_base) * 8) for p in packets if p.is_keyframe)
    assert demuxed == expected
    assert decode(written.path).keyframes == expected


@pytest.mark.parametrize("rotation", [90, 180, 270])
def test_rotation_metadata_is_readable(tmp_path: Path, rotation: int) -> None:
    written = write_video(
        tmp_path / "rot.mp4", indexed_frames(3, width=96, height=64), fps=8, rotation_degrees=rotation
    )
    decoded = decode(written.path)
    assert decoded.rotation % 360 == rotation  # FFmpeg reports angles in (-180, 180]
    # Pixels are stored unrotated; the display matrix only tells players how to show them.
    assert decoded.frames[0].shape == (64, 96, 3)
    assert [read_frame_index(f) for f in decoded.frames] == [0, 1, 2]


def test_no_rotation_writes_no_display_matrix(sample_video: Path) -> None:
    assert decode(sample_video).rotation == 0


@pytest.mark.parametrize(
    ("codec", "odd_size", "expected_size", "pix_fmt"),
    [
        ("libx264", "exact", (113, 111), "yuv444p"),
        ("libx264", "pad", (114, 112), "yuv420p"),
        ("libx264", "crop", (112, 110), "yuv420p"),
        ("mpeg4", "exact", (113, 111), "yuv420p"),
    ],
)
def test_odd_sizes(
    tmp_path: Path, codec: str, odd_size: str, expected_size: tuple[int, int], pix_fmt: str
) -> None:
    written = write_video(
        tmp_path / "odd.mp4", indexed_frames(4, width=113, height=111), fps=8, codec=codec, odd_size=odd_size
    )  # type: ignore[arg-type]
    assert ((written.width, written.height), written.pix_fmt) == (expected_size, pix_fmt)
    decoded = decode(written.path)
    assert decoded.frames[0].shape == (expected_size[1], expected_size[0], 3)
    assert [read_frame_index(f) for f in decoded.frames] == [0, 1, 2, 3]


def test_odd_size_in_420_h264_fails_with_a_clear_error(tmp_path: Path) -> None:
    target = tmp_path / "odd420.mp4"
    with pytest.raises(ValueError, match=r"libx264/yuv420p 113x111"):
        write_video(target, indexed_frames(2, width=113, height=111), fps=8, pix_fmt="yuv420p")
    assert not target.exists()


def test_single_frame_video(tmp_path: Path) -> None:
    written = write_video(tmp_path / "one.mp4", [shape_frame("circle", "yellow", width=64, height=64)], fps=4)
    assert (written.num_frames, written.keyframe_indices, written.duration_seconds) == (1, (0,), 0.25)
    decoded = decode(written.path)
    assert len(decoded.frames) == 1
    assert classify_shape(decoded.frames[0]) == "circle"


def test_quality_settings_change_the_encoding(tmp_path: Path) -> None:
    frames = [shape_frame(SHAPES[i % 3], SATURATED_COLOURS[i % 6], width=96, height=96) for i in range(8)]
    fine = write_video(tmp_path / "fine.mp4", frames, fps=8, crf=5).path.stat().st_size
    coarse = write_video(tmp_path / "coarse.mp4", frames, fps=8, crf=45).path.stat().st_size
    assert fine > coarse
    low = write_video(tmp_path / "low.mp4", frames, fps=8, codec="mpeg4", bit_rate=50_000)
    high = write_video(tmp_path / "high.mp4", frames, fps=8, codec="mpeg4", bit_rate=2_000_000)
    assert high.path.stat().st_size > low.path.stat().st_size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frames": []}, "at least one frame"),
        ({"frames": [np.zeros((8, 8, 3), np.uint8), np.zeros((8, 10, 3), np.uint8)]}, "frame 1 has shape"),
        ({"frames": [np.zeros((8, 8), np.uint8)]}, r"shape \(height, width, 3\)"),
        ({"frames": [np.zeros((8, 8, 3), np.float32)]}, "RGB uint8"),
        ({"pts_seconds": [0.0, 0.1, 0.1]}, "must increase"),
        ({"pts_seconds": [0.0, 0.1]}, "2 entries for 3 frames"),
        ({"codec": "no-such-encoder"}, "not in this PyAV build"),
        ({"codec": "aac"}, "not video"),
        ({"codec": "mpeg4", "crf": 20}, "has no crf option"),
        ({"rotation_degrees": 45}, "rotation_degrees must be one of"),
        ({"gop": 0}, "gop must be >= 1"),
        ({"fps": 0}, "fps must be positive"),
        ({"name": "video.unknownext"}, "cannot open"),
    ],
)
def test_write_video_rejects_bad_input(tmp_path: Path, kwargs: dict, message: str) -> None:
    frames = kwargs.pop("frames", [np.zeros((8, 8, 3), np.uint8)] * 3)
    target = tmp_path / kwargs.pop("name", "bad.mp4")
    with pytest.raises(ValueError, match=message):
        write_video(target, frames, **{"fps": 8, **kwargs})
    assert not target.exists()


# --- tasks ---------------------------------------------------------------------------------------


def runs(labels: list) -> list:
    """Collapse consecutive repeats: ``[a, a, b, a] -> [a, b, a]``."""
    return [label for label, _ in groupby(labels)]


def check_answer_from_video(record: TaskRecord, directory: Path) -> None:
    """Recompute the answer from the decoded clip alone and compare it with the record."""
    frames = decode(directory / record.video).frames
    assert len(frames) == record.metadata["num_frames"]
    if record.task in ("colour", "count"):
        colours = [classify_colour(f) for f in frames]
        assert colours == record.metadata["frame_colours"]
        if record.task == "colour":
            assert {c for c in colours if c != "black"} == {record.answer_text}
        else:
            flashes = [c for c in runs(colours) if c == record.metadata["colour"]]
            assert len(flashes) == int(record.answer_text)
    else:
        shapes = [classify_shape(f) for f in frames]
        assert shapes == record.metadata["frame_shapes"]
        assert ", ".join(s for s in runs(shapes) if s is not None) == record.answer_text


@pytest.mark.parametrize("task", TASKS)
def test_task_answers_are_verifiable_from_decoded_frames(tmp_path: Path, task: str) -> None:
    records = generate_task_clips(tmp_path, 6, task, seed=7)  # type: ignore[arg-type]
    assert [r.video for r in records] == [f"{task}-s7-{i:05d}.mp4" for i in range(6)]
    for record in records:
        assert list(record.options) == ["A", "B", "C", "D"]
        assert len(set(record.options.values())) == 4
        assert record.prompt.splitlines()[0] == record.question
        check_answer_from_video(record, tmp_path)


def test_colour_task_has_both_variants_and_count_task_distractors(tmp_path: Path) -> None:
    colour = generate_task_clips(tmp_path, 12, "colour", seed=1)
    assert {r.metadata["tail_only"] for r in colour} == {True, False}
    count = generate_task_clips(tmp_path, 12, "count", seed=1)
    assert any(r.metadata["distractor_colours"] for r in count)


def test_small_configs_still_fit(tmp_path: Path) -> None:
    config = ClipConfig(width=48, height=32, num_frames=5, num_options=6, fps=4)
    for task in TASKS:
        for index in range(4):
            record = make_task_clip(task, tmp_path, seed=3, index=index, config=config)
            assert len(record.options) == 6
            check_answer_from_video(record, tmp_path)


def test_generation_is_deterministic(tmp_path: Path) -> None:
    first = generate_task_clips(tmp_path / "a", 3, "order", seed=11)
    second = generate_task_clips(tmp_path / "b", 3, "order", seed=11)
    assert first == second
    for record in first:
        assert (tmp_path / "a" / record.video).read_bytes() == (tmp_path / "b" / record.video).read_bytes()
    # Clip i does not depend on how many clips were asked for, and other seeds give other clips.
    assert make_task_clip("order", tmp_path / "c", seed=11, index=2) == first[2]
    other = generate_task_clips(tmp_path / "d", 3, "order", seed=12)
    assert [r.metadata for r in other] != [r.metadata for r in first]


def test_records_round_trip_through_jsonl(tmp_path: Path) -> None:
    records = generate_task_clips(tmp_path, 2, "count", seed=0)
    path = write_records_jsonl(records, tmp_path / "rows.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [r.to_dict() for r in records]
    assert read_records_jsonl(path) == records


def test_record_and_config_validation(tmp_path: Path) -> None:
    row = generate_task_clips(tmp_path, 1, "colour", seed=0)[0].to_dict()
    with pytest.raises(ValueError, match="not one of the options"):
        TaskRecord.model_validate({**row, "answer": "Z"})
    with pytest.raises(ValueError, match="lettered"):
        TaskRecord.model_validate({**row, "options": {"B": "red", "A": "blue"}, "answer": "A"})
    with pytest.raises(ValueError, match="unknown task"):
        make_task_clip("colours", tmp_path, seed=0, index=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_frames must be >= 5"):
        ClipConfig(num_frames=4)
    with pytest.raises(ValueError, match="num_options"):
        ClipConfig(num_options=7)
