"""The PyAV decoder: exact frames (read back from their barcodes), the work it avoids, and its errors.

Every video here carries its frame index as a barcode (``video_grpo_demo.synthetic.indexed_frames``),
so each decoded frame says which source frame it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import av
import cv2
import numpy as np
import pytest

from video_grpo_demo.synthetic import WrittenVideo, indexed_frames, read_frame_index, write_video
from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.decode import (
    DEFAULT_LIMITS,
    DecodeLimits,
    VideoSource,
    VideoSourceInfo,
    decode_frames,
    source_label,
)
from vllm_video_plugin.decode import frames as frames_module
from vllm_video_plugin.decode.probe import DemuxedVideo
from vllm_video_plugin.errors import VideoDecodeError, VideoGRPOError

pytestmark = pytest.mark.unit

WIDTH, HEIGHT = 96, 64


def probe_video(source: VideoSource) -> VideoSourceInfo:
    """A video's stream metadata and frame count from the demux pass alone (nothing decoded)."""
    video = DemuxedVideo(source, DEFAULT_LIMITS, threads=1)
    video.close()
    return video.info


def barcodes(data: np.ndarray) -> list[int]:
    return [read_frame_index(frame) for frame in data]


def decode_everything(path: Path) -> list[np.ndarray]:
    """Reference: every frame in order, sequentially decoded and converted."""
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("decode")


@pytest.fixture(scope="module")
def long_gop(media: Path) -> WrittenVideo:
    """120 frames, H.264 with B-frames, keyframes at 0 and 60."""
    return write_video(
        media / "long_gop.mp4", indexed_frames(120, width=WIDTH, height=HEIGHT), fps=30, gop=60
    )


@pytest.fixture(scope="module")
def short_gop(media: Path) -> WrittenVideo:
    """48 frames, keyframe every 4."""
    return write_video(media / "short_gop.mp4", indexed_frames(48, width=WIDTH, height=HEIGHT), fps=8, gop=4)


@pytest.fixture(scope="module")
def no_b_frames(media: Path) -> WrittenVideo:
    """60 frames without B-frames in Matroska (no frame count in the header)."""
    return write_video(
        media / "no_b.mkv",
        indexed_frames(60, width=WIDTH, height=HEIGHT),
        fps=25,
        gop=30,
        options={"bf": "0"},
    )


@pytest.fixture
def count_work(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts packets sent to the decoder and frames converted to RGB during the test."""
    work = {"packets": 0, "rgb": 0}
    send, to_rgb = frames_module._FrameDecoder._send, frames_module._FrameDecoder._to_rgb

    def counting_send(self: frames_module._FrameDecoder, context: object, packet: av.Packet | None) -> list:
        work["packets"] += packet is not None
        return send(self, context, packet)  # type: ignore[arg-type]

    def counting_to_rgb(self: frames_module._FrameDecoder, frame: av.VideoFrame) -> np.ndarray:
        work["rgb"] += 1
        return to_rgb(self, frame)

    monkeypatch.setattr(frames_module._FrameDecoder, "_send", counting_send)
    monkeypatch.setattr(frames_module._FrameDecoder, "_to_rgb", counting_to_rgb)
    yield work


def test_written_videos_have_the_structure_the_tests_rely_on(
    long_gop: WrittenVideo, short_gop: WrittenVideo
) -> None:
    assert long_gop.keyframe_indices == (0, 60)
    assert short_gop.keyframe_indices == tuple(range(0, 48, 4))
    with av.open(str(long_gop.path)) as container:
        assert container.streams.video[0].codec_context.has_b_frames


@pytest.mark.parametrize(
    "wanted",
    [[0], [119], [5, 59], [59, 60, 61], [0, 30, 61, 62, 119], [61, 5, 61, 100, 0], list(range(0, 120, 7))],
    ids=str,
)
def test_long_gop_exact_frames(long_gop: WrittenVideo, wanted: list[int]) -> None:
    batch = decode_frames(long_gop.path, wanted)
    assert barcodes(batch.data) == wanted
    assert batch.indices == tuple(wanted)
    reference = decode_everything(long_gop.path)
    for row, index in enumerate(wanted):
        np.testing.assert_array_equal(batch.data[row], reference[index])
    assert batch.pts_seconds == pytest.approx([long_gop.pts_seconds[i] for i in wanted])


@pytest.mark.parametrize("video", ["short_gop", "no_b_frames"])
def test_sampled_frames_equal_sequential_decode(video: str, request: pytest.FixtureRequest) -> None:
    written: WrittenVideo = request.getfixturevalue(video)
    contract = VideoSamplingContract(style="uniform", num_frames=9)
    batch = decode_frames(written.path, contract)
    assert batch.sample is not None and batch.indices == batch.sample.indices
    assert barcodes(batch.data) == list(batch.indices)
    reference = decode_everything(written.path)
    np.testing.assert_array_equal(batch.data, np.stack([reference[i] for i in batch.indices]))


def test_jumps_over_gaps_instead_of_decoding_them(long_gop: WrittenVideo, count_work: dict[str, int]) -> None:
    batch = decode_frames(long_gop.path, [2, 62])
    assert barcodes(batch.data) == [2, 62]
    # From keyframe 0 up to frame 2's packet, then a jump to keyframe 60: far fewer than 120 packets.
    assert count_work["packets"] < 25
    assert count_work["rgb"] == 2


def test_converts_each_needed_frame_once(short_gop: WrittenVideo, count_work: dict[str, int]) -> None:
    batch = decode_frames(short_gop.path, [3, 3, 40, 3])
    assert barcodes(batch.data) == [3, 3, 40, 3]
    assert count_work["rgb"] == 2


def test_skips_unreferenced_frames(long_gop: WrittenVideo, monkeypatch: pytest.MonkeyPatch) -> None:
    produced: list[int] = []
    send = frames_module._FrameDecoder._send

    def recording_send(self: frames_module._FrameDecoder, context: object, packet: av.Packet | None) -> list:
        frames = send(self, context, packet)  # type: ignore[arg-type]
        produced.extend(frames)
        return frames

    monkeypatch.setattr(frames_module._FrameDecoder, "_send", recording_send)
    batch = decode_frames(long_gop.path, [59])
    assert barcodes(batch.data) == [59]
    # 60 packets reach frame 59; non-reference B-frames among them are dropped undecoded.
    assert len(produced) < 60


def test_bytes_and_path_give_the_same_frames(short_gop: WrittenVideo) -> None:
    contract = VideoSamplingContract(style="nemotron_rounded", num_frames=8)
    from_path = decode_frames(short_gop.path, contract)
    from_bytes = decode_frames(short_gop.path.read_bytes(), contract)
    np.testing.assert_array_equal(from_path.data, from_bytes.data)
    assert from_path.indices == from_bytes.indices
    assert from_bytes.source.label.startswith("<bytes sha256:")
    assert from_path.source.label == str(short_gop.path)


def test_frame_threading_gives_the_same_frames(long_gop: WrittenVideo) -> None:
    wanted = [1, 30, 61, 119]
    threaded = decode_frames(long_gop.path, wanted, threads=2)
    np.testing.assert_array_equal(threaded.data, decode_frames(long_gop.path, wanted).data)


def test_source_metadata(long_gop: WrittenVideo, no_b_frames: WrittenVideo) -> None:
    info = probe_video(long_gop.path)
    assert (info.num_frames_from_header, info.num_frames_from_content, info.num_frames) == (120, 120, 120)
    assert info.fps_from_header == 30.0 and info.average_fps_from_content == pytest.approx(30.0)
    assert info.duration_s == pytest.approx(4.0) and info.duration_from_header_s == pytest.approx(4.0)
    assert (info.width, info.height, info.rotation_degrees, info.codec) == (WIDTH, HEIGHT, 0, "h264")
    mkv = probe_video(no_b_frames.path)
    assert mkv.num_frames_from_header is None and mkv.num_frames == 60
    assert mkv.container.startswith("matroska")


def test_variable_frame_rate(media: Path) -> None:
    pts = [0.0, 0.1, 0.15, 0.5, 0.52, 1.0, 1.7, 1.75, 2.0, 3.0, 3.01, 3.5]
    written = write_video(
        media / "vfr.mp4",
        indexed_frames(len(pts), width=WIDTH, height=HEIGHT),
        fps=10,
        pts_seconds=pts,
        gop=5,
    )
    info = probe_video(written.path)
    assert info.num_frames == len(pts)
    wanted = [1, 2, 6, 9, 10, 11]
    batch = decode_frames(written.path, wanted)
    assert barcodes(batch.data) == wanted
    assert batch.pts_seconds == pytest.approx([pts[i] for i in wanted], abs=1e-4)


def test_container_that_over_reports_its_frame_count(media: Path) -> None:
    written = write_video(media / "full.mp4", indexed_frames(32, width=WIDTH, height=HEIGHT), fps=8, gop=8)
    # Move the index to the front, then cut the file: the header still declares 32 frames.
    faststart = media / "faststart.mp4"
    with (
        av.open(str(written.path)) as source,
        av.open(str(faststart), "w", options={"movflags": "faststart"}) as out,
    ):
        stream = out.add_stream_from_template(source.streams.video[0])
        for packet in source.demux(video=0):
            if packet.dts is not None:
                packet.stream = stream
                out.mux(packet)
    data = faststart.read_bytes()
    truncated = data[: int(len(data) * 0.6)]
    info = probe_video(truncated)
    assert info.num_frames_from_header == 32
    assert 0 < info.num_frames_from_content < 32
    batch = decode_frames(truncated, VideoSamplingContract(style="uniform", num_frames=32))
    # Sampling runs over the frames that exist, and every one of them decodes.
    assert batch.indices == tuple(range(info.num_frames))
    assert barcodes(batch.data) == list(batch.indices)


def test_one_frame_video(media: Path) -> None:
    written = write_video(media / "one.mp4", indexed_frames(1, width=WIDTH, height=HEIGHT), fps=30)
    repeated = decode_frames(written.path, VideoSamplingContract(style="nemotron_rounded", num_frames=8))
    assert repeated.indices == (0, 0) and barcodes(repeated.data) == [0, 0]
    single = decode_frames(written.path, VideoSamplingContract(style="uniform", num_frames=8))
    assert single.data.shape == (1, HEIGHT, WIDTH, 3)


@pytest.mark.parametrize("rotation", [90, 180, 270])
def test_rotation_is_applied_like_opencv(media: Path, rotation: int) -> None:
    written = write_video(
        media / f"rot{rotation}.mp4",
        indexed_frames(6, width=WIDTH, height=HEIGHT),
        fps=8,
        rotation_degrees=rotation,
    )
    batch = decode_frames(written.path, [0, 5])
    info = batch.source
    assert info.rotation_degrees == {90: 90, 180: -180, 270: -90}[rotation]
    swapped = rotation != 180
    assert batch.data.shape[1:3] == ((WIDTH, HEIGHT) if swapped else (HEIGHT, WIDTH))
    assert (info.height, info.width) == batch.data.shape[1:3]
    # Turning the frames back (clockwise by the counter-clockwise display angle) shows the barcodes.
    assert [read_frame_index(np.rot90(frame, k=-rotation // 90)) for frame in batch.data] == [0, 5]
    capture = cv2.VideoCapture(str(written.path))
    try:
        opencv = []
        for _ in range(6):
            ok, frame = capture.read()
            assert ok
            opencv.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    finally:
        capture.release()
    np.testing.assert_array_equal(batch.data, np.stack([opencv[0], opencv[5]]))


def test_odd_frame_size(media: Path) -> None:
    written = write_video(media / "odd.mp4", indexed_frames(10, width=65, height=49), fps=8)
    batch = decode_frames(written.path, [0, 4, 9])
    assert batch.data.shape == (3, 49, 65, 3)
    assert barcodes(batch.data) == [0, 4, 9]


def test_out_of_range_index(short_gop: WrittenVideo) -> None:
    with pytest.raises(
        VideoDecodeError, match=r"frame indices \[48\] are out of range: the video has 48 frames"
    ):
        decode_frames(short_gop.path, [0, 48])


@pytest.mark.parametrize(
    ("make_input", "reason"),
    [
        (lambda video: b"", "the input is empty"),
        (lambda video: b"\x00\x01garbage" * 100, "not a readable media container"),
        (lambda video: video.read_bytes()[: len(video.read_bytes()) // 2], "not a readable media container"),
    ],
    ids=["zero-length", "garbage", "truncated"],
)
def test_undecodable_bytes(short_gop: WrittenVideo, make_input: Callable[[Path], bytes], reason: str) -> None:
    data = make_input(short_gop.path)
    with pytest.raises(VideoDecodeError, match=reason) as caught:
        decode_frames(data, [0])
    assert caught.value.source == source_label(data)
    assert str(caught.value).startswith("<bytes sha256:")
    assert isinstance(caught.value, VideoGRPOError) and isinstance(caught.value, ValueError)


def test_no_video_stream(media: Path) -> None:
    path = media / "audio.wav"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), dtype=np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    with pytest.raises(
        VideoDecodeError, match=r"audio\.wav: the input has no video stream \(streams: audio\)"
    ):
        decode_frames(path, [0])


def test_missing_file(media: Path) -> None:
    with pytest.raises(VideoDecodeError, match=r"missing\.mp4: cannot read the file"):
        decode_frames(media / "missing.mp4", [0])


@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        (DecodeLimits(max_input_bytes=100), "over the limit of 100 bytes"),
        (DecodeLimits(max_frame_pixels=WIDTH * HEIGHT - 1), f"frames are {WIDTH}x{HEIGHT}"),
        (DecodeLimits(max_frames=47), "the video has 48 frames, over the limit of 47"),
        (DecodeLimits(timeout_s=0.0), "longer than the limit of 0.0 s"),
    ],
    ids=["bytes", "pixels", "frames", "timeout"],
)
def test_limits(short_gop: WrittenVideo, limits: DecodeLimits, reason: str) -> None:
    with pytest.raises(VideoDecodeError, match=reason):
        decode_frames(short_gop.path, [0, 47], limits=limits)
