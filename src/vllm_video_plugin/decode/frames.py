"""Decoding the frames a sample needs from a demuxed video, and :func:`decode_frames`.

Decoding starts at the last useful keyframe, jumps over gaps instead of decoding them, drops
unreferenced frames undecoded and converts only sampled frames to RGB (see
:mod:`vllm_video_plugin.decode`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import av
import av.error
import numpy as np
from numpy.typing import NDArray

from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.decode.limits import DEFAULT_LIMITS, DecodeLimits, VideoSource
from vllm_video_plugin.decode.probe import DemuxedVideo, VideoSourceInfo
from vllm_video_plugin.errors import VideoDecodeError
from vllm_video_plugin.sampling import FrameSample, presentation_timed, sample_frames

__all__ = ["FrameBatch", "decode_frames"]


@dataclass(frozen=True, eq=False)
class FrameBatch:
    """Decoded frames and where they came from."""

    data: NDArray[np.uint8]
    """RGB frames, ``(N, height, width, 3)`` uint8, rotation applied; read-only."""
    indices: tuple[int, ...]
    """Presentation index in the source of each row of :attr:`data`."""
    pts_seconds: tuple[float, ...]
    """Presentation time of each row as stored in the container, in seconds."""
    source: VideoSourceInfo
    sample: FrameSample | None = None
    """The sampling result when frames were chosen by a contract; ``None`` for explicit indices."""

    def __post_init__(self) -> None:
        if self.data.ndim != 4 or self.data.shape[3] != 3 or self.data.dtype != np.uint8:
            raise ValueError(f"data must be uint8 (N, H, W, 3), got {self.data.dtype} {self.data.shape}")
        if not len(self.indices) == len(self.pts_seconds) == self.data.shape[0]:
            raise ValueError(
                f"{self.data.shape[0]} frames but {len(self.indices)} indices and "
                f"{len(self.pts_seconds)} timestamps"
            )
        self.data.flags.writeable = False

    @property
    def nbytes(self) -> int:
        """Size of :attr:`data` in bytes."""
        return self.data.nbytes


class _FrameDecoder:
    """Decodes frames of one demuxed video (its packets are in memory, its codec context open)."""

    def __init__(self, video: DemuxedVideo) -> None:
        self.video = video

    def fail(self, reason: str) -> VideoDecodeError:
        return self.video.fail(reason)

    def decode(self, wanted: Sequence[int]) -> tuple[dict[int, NDArray[np.uint8]], dict[int, float]]:
        """Decode the frames at presentation ``wanted`` indices (sorted, unique).

        Returns RGB arrays and pts in seconds, keyed by index.
        """
        if self.video.packets.rank_of_pts is None:
            return self._decode_in_order(wanted)
        return self._decode_by_pts(wanted)

    def _to_rgb(self, frame: av.VideoFrame) -> NDArray[np.uint8]:
        pixels = frame.width * frame.height
        if pixels > self.video.limits.max_frame_pixels:
            raise self.fail(
                f"a frame is {frame.width}x{frame.height} ({pixels} pixels), over the limit of "
                f"{self.video.limits.max_frame_pixels} pixels"
            )
        array = frame.to_ndarray(format="rgb24")
        if frame.rotation:
            array = np.rot90(array, k=frame.rotation // 90)
        return array

    def _seconds(self, frame: av.VideoFrame) -> float:
        return float(frame.pts * self.video.packets.time_base) if frame.pts is not None else math.nan

    def _decode_by_pts(self, wanted: Sequence[int]) -> tuple[dict[int, NDArray[np.uint8]], dict[int, float]]:
        packets = self.video.packets
        rank_of_pts = packets.rank_of_pts
        position_of_index = packets.position_of_index
        assert rank_of_pts is not None and position_of_index is not None
        context = self.video.stream.codec_context
        targets = set(wanted)
        target_positions = {position_of_index[index] for index in wanted}
        frames: dict[int, NDArray[np.uint8]] = {}
        seconds: dict[int, float] = {}

        def take(decoded: list[av.VideoFrame]) -> None:
            for frame in decoded:
                # Frames of edit-list discards (if a codec emits them) have no rank and are ignored.
                index = rank_of_pts.get(frame.pts) if frame.pts is not None else None
                if index in targets and index not in frames:
                    frames[index] = self._to_rgb(frame)
                    seconds[index] = self._seconds(frame)

        cursor = 0  # next packet position to send
        for index in wanted:
            if index in frames:
                continue
            position = position_of_index[index]
            if position < cursor:
                continue  # already sent; the decoder still holds the frame and releases it later
            start = self._start_position(position)
            if start > cursor:
                # A keyframe ahead serves the target: jump there instead of decoding the gap,
                # after collecting the frames the decoder still holds.
                if cursor:
                    take(self._drain(context))
                cursor = start
            for step in range(cursor, position + 1):
                self.video.check_deadline()
                context.skip_frame = "DEFAULT" if step in target_positions else "NONREF"
                take(self._send(context, packets.packets[step]))
            cursor = position + 1
        context.skip_frame = "DEFAULT"
        take(self._drain(context))
        missing = targets.difference(frames)
        if missing:
            raise self.fail(f"frames {sorted(missing)} could not be decoded (damaged or missing data)")
        return frames, seconds

    def _start_position(self, position: int) -> int:
        """Packet position to start decoding from to obtain the frame of packet ``position``: the
        last keyframe at or before it in decode order whose pts is not after the frame's (so
        leading pictures of an open GOP start from the previous keyframe)."""
        packets = self.video.packets
        target_pts = packets.pts[position]
        assert target_pts is not None
        for candidate in range(position, -1, -1):
            if packets.keyframe[candidate]:
                pts = packets.pts[candidate]
                if pts is not None and pts <= target_pts:
                    return candidate
        return 0

    def _send(self, context: av.codec.context.CodecContext, packet: av.Packet | None) -> list[av.VideoFrame]:
        try:
            return context.decode(packet)  # type: ignore[return-value]
        except av.error.FFmpegError as error:
            raise self.fail(f"the decoder rejected the data ({error})") from error

    def _drain(self, context: av.codec.context.CodecContext) -> list[av.VideoFrame]:
        """Frames the decoder still holds (reordering delay), then a reset for new input."""
        decoded = self._send(context, None)
        context.flush_buffers()
        return decoded

    def _decode_in_order(
        self, wanted: Sequence[int]
    ) -> tuple[dict[int, NDArray[np.uint8]], dict[int, float]]:
        """Without usable timestamps: decode every packet up to the last target and count frames."""
        context = self.video.stream.codec_context
        targets = set(wanted)
        last = max(wanted)
        frames: dict[int, NDArray[np.uint8]] = {}
        seconds: dict[int, float] = {}
        index = 0
        for packet in [*self.video.packets.packets, None]:
            self.video.check_deadline()
            for frame in self._send(context, packet):
                if index in targets:
                    frames[index] = self._to_rgb(frame)
                    seconds[index] = self._seconds(frame)
                index += 1
            if index > last:
                break
        missing = targets.difference(frames)
        if missing:
            raise self.fail(
                f"frames {sorted(missing)} could not be decoded (the stream ended at {index} frames)"
            )
        return frames, seconds


def decode_frames(
    source: VideoSource,
    frames: Sequence[int] | VideoSamplingContract,
    *,
    limits: DecodeLimits = DEFAULT_LIMITS,
    threads: int = 1,
) -> FrameBatch:
    """Decode the frames a sampling contract picks, or the frames at given indices.

    Args:
        source: the encoded video (bytes) or a file path.
        frames: a contract (its style is applied to the video's frame count, rate and duration, see
            :func:`vllm_video_plugin.sampling.sample_frames`), or presentation indices in any order,
            repeats allowed; rows of the result follow that order.
        limits: input, frame-size, frame-count and time limits.
        threads: decoding threads; 1 (the default, fastest on small machines) decodes on the calling
            thread, more turns on FFmpeg frame threading.

    Raises:
        VideoDecodeError: the input cannot be decoded, breaks a limit, or an index is out of range.
            The message names the source (path or ``<bytes sha256:...>``) and the reason.
        VideoSamplingError: the contract's style cannot sample this video.
    """
    video = DemuxedVideo(source, limits, threads)
    try:
        info = video.info
        sample: FrameSample | None = None
        if isinstance(frames, VideoSamplingContract):
            sample = sample_frames(info.num_frames, info.fps, info.duration_s, frames)
            order = list(sample.indices)
        else:
            order = [int(index) for index in frames]
            if not order:
                raise video.fail("no frame indices were requested")
            out_of_range = [index for index in order if not 0 <= index < info.num_frames]
            if out_of_range:
                raise video.fail(
                    f"frame indices {out_of_range} are out of range: the video has {info.num_frames} frames"
                )
        wanted = sorted(set(order))
        decoded, seconds = _FrameDecoder(video).decode(wanted)
    finally:
        video.close()
    data = _stack(decoded, wanted, order, video)
    pts = tuple(seconds[index] for index in order)
    if sample is not None and isinstance(frames, VideoSamplingContract) and frames.timestamps != "nominal":
        sample = presentation_timed(sample, [t - info.start_time_s for t in pts])
    return FrameBatch(data=data, indices=tuple(order), pts_seconds=pts, source=info, sample=sample)


def _stack(
    decoded: dict[int, NDArray[np.uint8]], wanted: list[int], order: list[int], video: DemuxedVideo
) -> NDArray[np.uint8]:
    """One ``(N, H, W, 3)`` array in ``order``, copying each decoded frame once."""
    shape = decoded[wanted[0]].shape
    unique = np.empty((len(wanted), *shape), dtype=np.uint8)
    for slot, index in enumerate(wanted):
        frame = decoded[index]
        if frame.shape != shape:
            raise video.fail(
                f"frame {index} is {frame.shape[1]}x{frame.shape[0]}, frame {wanted[0]} is "
                f"{shape[1]}x{shape[0]}; resolution changes are not supported"
            )
        unique[slot] = frame
    if order == wanted:
        return unique
    slot_of = {index: slot for slot, index in enumerate(wanted)}
    return unique[[slot_of[index] for index in order]]
