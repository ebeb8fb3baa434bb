"""Opening a video and the demux pass: stream metadata, frame count and packets, no decoding.

The demux pass reads every packet of the video stream once and keeps them in memory; packet
timestamps give each frame's presentation index and keyframe flags the places decoding can start
(see :mod:`vllm_video_plugin.decode`).
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import av.error
import numpy as np

from vllm_video_plugin.decode.limits import DecodeLimits, VideoSource, source_label
from vllm_video_plugin.errors import VideoDecodeError

__all__ = ["DemuxedVideo", "Packets", "VideoSourceInfo", "check_limits"]


@dataclass(frozen=True)
class VideoSourceInfo:
    """What is known about a video stream, each raw value named by where it came from.

    Header values are the container's claims (``None`` when absent); content values come from the
    demux pass over every packet. The resolved :attr:`num_frames`, :attr:`fps` and
    :attr:`duration_s` are what sampling uses.
    """

    label: str
    """The file path, or ``"<bytes sha256:...>"`` for in-memory input."""
    container: str
    """FFmpeg demuxer name, e.g. ``"mov,mp4,m4a,3gp,3g2,mj2"``."""
    codec: str
    """FFmpeg decoder name, e.g. ``"h264"``."""
    coded_width: int
    """Width of the stored frames in pixels (before rotation)."""
    coded_height: int
    """Height of the stored frames in pixels (before rotation)."""
    rotation_degrees: int
    """Counter-clockwise display rotation from the stream's display matrix, in degrees, one of
    -180, -90, 0, 90 as FFmpeg reports it (270 reads as -90; 0 when there is none); decoded frames
    are rotated by it."""
    num_frames_from_header: int | None
    """Frame count the container declares (``None`` when it declares none)."""
    num_frames_from_content: int
    """Presentable packets found by the demux pass (edit-list discards and packets the demuxer
    flags corrupt, such as the cut-off last packet of a truncated file, excluded)."""
    fps_from_header: float | None
    """Frame rate the stream header declares: its average rate (FFmpeg ``avg_frame_rate``, the value
    OpenCV's ``CAP_PROP_FPS`` reports), else the guessed base rate, in frames per second; ``None``
    when unknown."""
    average_fps_from_content: float | None
    """``(n - 1) / (last_pts - first_pts)`` over the presentable packets, in frames per second;
    ``None`` for a single frame or missing timestamps."""
    duration_from_header_s: float | None
    """Stream duration the container declares, in seconds (``None`` when absent)."""
    start_time_s: float
    """Presentation time of the first frame, in seconds (0 when the container gives none)."""

    @property
    def num_frames(self) -> int:
        """Frames in the video: the content count (the header's may over- or under-report)."""
        return self.num_frames_from_content

    @property
    def fps(self) -> float:
        """Frame rate in frames per second: the header's, else the content average, else 0
        (unknown)."""
        return self.fps_from_header or self.average_fps_from_content or 0.0

    @property
    def duration_s(self) -> float:
        """``num_frames / fps`` in seconds (0 when the rate is unknown), as vLLM's OpenCV loader
        computes it."""
        return self.num_frames / self.fps if self.fps > 0 else 0.0

    @property
    def width(self) -> int:
        """Width of the decoded (rotated) frames in pixels."""
        return self.coded_height if self.rotation_degrees % 180 else self.coded_width

    @property
    def height(self) -> int:
        """Height of the decoded (rotated) frames in pixels."""
        return self.coded_width if self.rotation_degrees % 180 else self.coded_height


@dataclass(frozen=True)
class Packets:
    """The demux pass: packets in decode order and the presentation index of each."""

    packets: list[av.Packet]
    keyframe: list[bool]
    pts: list[int | None]
    rank_of_pts: dict[int, int] | None
    """pts -> presentation index; ``None`` when timestamps are missing or repeated, in which case
    frames are identified by their output order."""
    position_of_index: list[int] | None
    """Presentation index -> position in :attr:`packets`; ``None`` like :attr:`rank_of_pts`."""
    time_base: Fraction
    count: int


class DemuxedVideo:
    """One open input: container, video stream and the demux pass (:attr:`packets`, :attr:`info`).

    Open until :meth:`close`; :class:`~vllm_video_plugin.decode.frames` decodes from it.
    """

    def __init__(self, source: VideoSource, limits: DecodeLimits, threads: int) -> None:
        self.label = source_label(source)
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.container = self._open(source)
        try:
            self._setup(threads)
        except BaseException:
            self.container.close()
            raise

    def fail(self, reason: str) -> VideoDecodeError:
        return VideoDecodeError(self.label, reason)

    def _open(self, source: VideoSource) -> av.container.InputContainer:
        if isinstance(source, (bytes, bytearray, memoryview)):
            size = len(source)
            opener: io.BytesIO | str = io.BytesIO(source)
        else:
            path = Path(source)
            try:
                size = path.stat().st_size
            except OSError as error:
                raise self.fail(f"cannot read the file: {error.strerror or error}") from error
            opener = str(path)
        if size == 0:
            raise self.fail("the input is empty (0 bytes)")
        if size > self.limits.max_input_bytes:
            raise self.fail(
                f"the input is {size} bytes, over the limit of {self.limits.max_input_bytes} bytes"
            )
        try:
            return av.open(opener, mode="r")
        except (av.error.FFmpegError, UnicodeDecodeError) as error:
            raise self.fail(f"not a readable media container ({error})") from error

    def _setup(self, threads: int) -> None:
        container = self.container
        if not container.streams.video:
            kinds = ", ".join(stream.type for stream in container.streams) or "none"
            raise self.fail(f"the input has no video stream (streams: {kinds})")
        stream = container.streams.video[0]
        self.stream = stream
        context = stream.codec_context
        if context is None:  # FFmpeg knows no codec for the stream's tag, or this build lacks it
            raise self.fail(
                f"the video stream's codec is not supported: this FFmpeg build (PyAV {av.__version__}) "
                "has no decoder for it"
            )
        if threads > 1:
            context.thread_type, context.thread_count = "FRAME", threads
        else:
            context.thread_type, context.thread_count = "NONE", 1
        pixels = context.width * context.height
        if pixels > self.limits.max_frame_pixels:
            raise self.fail(
                f"frames are {context.width}x{context.height} ({pixels} pixels), over the limit of "
                f"{self.limits.max_frame_pixels} pixels"
            )
        self.packets = self._demux()
        self.info = self._info()

    def check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            raise self.fail(f"decoding took longer than the limit of {self.limits.timeout_s} s")

    def _demux(self) -> Packets:
        stream = self.stream
        packets: list[av.Packet] = []
        keyframe: list[bool] = []
        pts: list[int | None] = []
        presentable: list[tuple[int, int]] = []  # (pts, position) of frames that will be shown
        timestamps_ok = True
        try:
            for packet in self.container.demux(stream):
                if packet.size == 0:  # the demuxer's end-of-stream marker
                    continue
                if len(packets) % 256 == 0:
                    self.check_deadline()
                if packet.is_corrupt:
                    # Damaged or cut short (a truncated file's last packet): never shown, not sent.
                    continue
                position = len(packets)
                packets.append(packet)
                keyframe.append(packet.is_keyframe)
                pts.append(packet.pts)
                if packet.is_discard:
                    continue
                if packet.pts is None:
                    timestamps_ok = False
                else:
                    presentable.append((packet.pts, position))
        except av.error.FFmpegError as error:
            if not packets:
                raise self.fail(f"cannot read video packets ({error})") from error
            # A truncated or damaged tail: keep what was read; frames beyond it do not exist.
        count = len(presentable) if timestamps_ok else sum(1 for p in packets if not p.is_discard)
        if count == 0:
            raise self.fail("the video stream has no frames")
        if count > self.limits.max_frames:
            raise self.fail(f"the video has {count} frames, over the limit of {self.limits.max_frames}")
        rank_of_pts: dict[int, int] | None = None
        position_of_index: list[int] | None = None
        if timestamps_ok:
            presentable.sort()
            rank_of_pts = {value: rank for rank, (value, _) in enumerate(presentable)}
            if len(rank_of_pts) == len(presentable):
                position_of_index = [position for _, position in presentable]
            else:  # repeated timestamps cannot identify frames
                rank_of_pts = None
        assert stream.time_base is not None
        return Packets(packets, keyframe, pts, rank_of_pts, position_of_index, stream.time_base, count)

    def _info(self) -> VideoSourceInfo:
        stream, packets = self.stream, self.packets
        time_base = packets.time_base
        ranked = sorted(packets.rank_of_pts) if packets.rank_of_pts else []
        average = None
        if len(ranked) > 1 and ranked[-1] > ranked[0]:
            average = (len(ranked) - 1) / float((ranked[-1] - ranked[0]) * time_base)
        # The container's average rate first, as FFmpeg-based OpenCV reports it (CAP_PROP_FPS), so
        # variable-frame-rate videos sample like stock vLLM; the guessed (base) rate only as a fallback.
        header_rate = stream.average_rate or stream.guessed_rate
        start = stream.start_time if stream.start_time is not None else (ranked[0] if ranked else 0)
        rotation = self._stream_rotation()
        return VideoSourceInfo(
            label=self.label,
            container=self.container.format.name,
            codec=stream.codec_context.name,
            coded_width=stream.codec_context.width,
            coded_height=stream.codec_context.height,
            rotation_degrees=rotation,
            num_frames_from_header=stream.frames or None,
            num_frames_from_content=packets.count,
            fps_from_header=float(header_rate) if header_rate else None,
            average_fps_from_content=average,
            duration_from_header_s=float(stream.duration * time_base) if stream.duration else None,
            start_time_s=float(start * time_base),
        )

    def _stream_rotation(self) -> int:
        """Rotation of the stream's display matrix; decoded frames carry the same value."""
        matrix = (self.stream.codec_context.coded_side_data or {}).get("display_matrix")
        if matrix is None:
            return 0
        values = np.frombuffer(matrix, dtype="<i4", count=9).astype(np.float64) / 65536.0
        # FFmpeg's av_display_rotation_get: the counter-clockwise angle of the matrix's rotation part.
        angle = -math.degrees(math.atan2(values[1], values[0]))
        return (round(angle / 90.0) * 90 + 180) % 360 - 180

    def close(self) -> None:
        self.container.close()


def check_limits(info: VideoSourceInfo, num_bytes: int, limits: DecodeLimits) -> None:
    """Check what is known about an already decoded video against ``limits`` (all but the time):
    for results served from a cache, which were decoded under the limits of their first caller.

    Args:
        info: the video's stream information.
        num_bytes: size of its encoded input, in bytes.

    Raises:
        VideoDecodeError: naming ``info.label`` and the limit broken.
    """
    pixels = info.coded_width * info.coded_height
    if num_bytes > limits.max_input_bytes:
        reason = f"the input is {num_bytes} bytes, over the limit of {limits.max_input_bytes} bytes"
    elif pixels > limits.max_frame_pixels:
        reason = (
            f"frames are {info.coded_width}x{info.coded_height} ({pixels} pixels), over the limit of "
            f"{limits.max_frame_pixels} pixels"
        )
    elif info.num_frames_from_content > limits.max_frames:
        reason = f"the video has {info.num_frames_from_content} frames, over the limit of {limits.max_frames}"
    else:
        return
    raise VideoDecodeError(info.label, reason)
