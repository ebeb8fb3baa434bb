"""Write RGB frames to a video file with PyAV, and report exactly what was written.

Encoders in the PyAV wheels (FFmpeg 7.x/8.x builds) include ``libx264`` (H.264), ``libx265``,
``libvpx-vp9``, ``libvpx`` (VP8), ``libsvtav1``, ``mpeg4``, ``mjpeg`` and ``ffv1``. The default is
H.264 (``libx264``) because it is what real datasets mostly hold; builds without it fall back to
``mpeg4`` (always built into FFmpeg).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Final, Literal

import av
import av.error
import numpy as np
from numpy.typing import NDArray

__all__ = ["OddSize", "WrittenVideo", "default_codec", "write_video"]

OddSize = Literal["exact", "pad", "crop"]

VFR_CLOCK_HZ: Final = 90_000
"""Timestamps given in seconds are rounded to this clock (the MPEG 90 kHz clock)."""

_CRF_ENCODERS: Final = frozenset({"libx264", "libx265", "libvpx", "libvpx-vp9", "libsvtav1"})
# Options that stop an encoder from inserting extra keyframes at scene cuts. Synthetic content cuts
# hard between flat colours, so without them an explicit `gop` would not be the keyframe interval.
_NO_SCENECUT: Final[Mapping[str, Mapping[str, str]]] = {
    "libx264": {"sc_threshold": "0"},
    "libx265": {"x265-params": "scenecut=0"},
    "mpeg4": {"sc_threshold": "1000000000"},
}
_ROTATIONS: Final = (0, 90, 180, 270)
_FULL_CHROMA: Final = ("yuv444p", "yuvj444p")


@dataclass(frozen=True)
class WrittenVideo:
    """What :func:`write_video` wrote.

    Timestamps are those handed to the encoder; a container with a coarser clock (Matroska and
    WebM store milliseconds) rounds them when read back.
    """

    path: Path
    container: str
    """FFmpeg muxer name, e.g. ``"mp4"``, ``"matroska"``, ``"webm"``."""
    codec: str
    """FFmpeg encoder name, e.g. ``"libx264"``."""
    pix_fmt: str
    width: int
    """Encoded width in pixels (after ``odd_size`` padding or cropping)."""
    height: int
    """Encoded height in pixels (after ``odd_size`` padding or cropping)."""
    num_frames: int
    fps: float
    """Nominal frame rate in frames per second (the stream's declared rate; for VFR a hint only)."""
    pts_seconds: tuple[float, ...]
    """Presentation time of each frame, in seconds, in frame order."""
    duration_seconds: float
    """End of the last frame: its pts plus one nominal frame period (``1 / fps``), in seconds."""
    keyframe_indices: tuple[int, ...]
    """Indices of the frames the encoder emitted as keyframes (measured from its packets)."""
    rotation_degrees: int
    """Counter-clockwise display rotation stored in the container (0 means no display matrix).

    FFmpeg reads it back in ``(-180, 180]``: ``VideoFrame.rotation`` reports 270 as -90.
    """
    gop: int | None
    """Requested keyframe interval in frames; ``None`` means the encoder's default."""


def default_codec() -> str:
    """``"libx264"`` when this PyAV build has it, else ``"mpeg4"``."""
    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def _as_frames(frames: NDArray[np.uint8] | Sequence[NDArray[np.uint8]]) -> list[NDArray[np.uint8]]:
    items = list(frames)
    if not items:
        raise ValueError("frames is empty; a video needs at least one frame")
    first = np.asarray(items[0])
    for position, item in enumerate(items):
        array = np.asarray(item)
        if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
            raise ValueError(
                f"frame {position} must be an RGB uint8 array of shape (height, width, 3), "
                f"got {array.dtype} {array.shape}"
            )
        if array.shape != first.shape:
            raise ValueError(f"frame {position} has shape {array.shape}, frame 0 has {first.shape}")
    return [np.ascontiguousarray(item) for item in items]


def _fix_odd_size(frames: list[NDArray[np.uint8]], odd_size: OddSize) -> list[NDArray[np.uint8]]:
    height, width = frames[0].shape[:2]
    pad_h, pad_w = height % 2, width % 2
    if odd_size == "exact" or not (pad_h or pad_w):
        return frames
    if odd_size == "pad":
        return [np.pad(f, ((0, pad_h), (0, pad_w), (0, 0)), mode="edge") for f in frames]
    if odd_size == "crop":
        if height - pad_h < 1 or width - pad_w < 1:
            raise ValueError(f"cannot crop a {width}x{height} frame to even size")
        return [np.ascontiguousarray(f[: height - pad_h, : width - pad_w]) for f in frames]
    raise ValueError(f"invalid odd_size {odd_size!r}; supported values are exact, pad, crop")


def _choose_pix_fmt(codec: av.codec.Codec, width: int, height: int) -> str:
    """The encoder's preferred (first) pixel format, or a 4:4:4 one for odd sizes when it has one.

    Chroma subsampling needs even sizes in some encoders (libx264 refuses odd sizes in 4:2:0).
    """
    formats = [fmt.name for fmt in codec.video_formats or ()]
    if not formats:
        raise ValueError(f"encoder {codec.name!r} declares no pixel formats; pass pix_fmt explicitly")
    if width % 2 or height % 2:
        for name in _FULL_CHROMA:
            if name in formats:
                return name
    return formats[0]


def _timestamps(
    num_frames: int, fps: Fraction, pts_seconds: Sequence[float] | None
) -> tuple[Fraction, list[int]]:
    """Codec time base and integer pts for each frame."""
    if pts_seconds is None:
        return 1 / fps, list(range(num_frames))
    if len(pts_seconds) != num_frames:
        raise ValueError(f"pts_seconds has {len(pts_seconds)} entries for {num_frames} frames")
    ticks = [round(float(t) * VFR_CLOCK_HZ) for t in pts_seconds]
    if ticks[0] < 0:
        raise ValueError(f"pts_seconds[0] must be >= 0, got {pts_seconds[0]}")
    for position in range(1, num_frames):
        if ticks[position] <= ticks[position - 1]:
            raise ValueError(
                f"pts_seconds must increase by at least 1/{VFR_CLOCK_HZ} s; entry {position} "
                f"({pts_seconds[position]}) follows {pts_seconds[position - 1]}"
            )
    return Fraction(1, VFR_CLOCK_HZ), ticks


def _write_audio(
    output: av.container.OutputContainer, stream: av.AudioStream, samples: NDArray[np.float32], rate: int
) -> None:
    """Encode mono ``samples`` into ``stream`` of ``output`` (the muxer interleaves the streams)."""
    size = stream.codec_context.frame_size or 1024
    for start in range(0, samples.size, size):
        frame = av.AudioFrame.from_ndarray(samples[None, start : start + size], format="fltp", layout="mono")
        frame.sample_rate, frame.pts = rate, start
        for packet in stream.encode(frame):
            output.mux(packet)
    for packet in stream.encode(None):
        output.mux(packet)


def write_video(
    path: str | os.PathLike[str],
    frames: NDArray[np.uint8] | Sequence[NDArray[np.uint8]],
    *,
    fps: float | Fraction,
    pts_seconds: Sequence[float] | None = None,
    codec: str | None = None,
    container: str | None = None,
    gop: int | None = None,
    pix_fmt: str | None = None,
    crf: int | None = None,
    bit_rate: int | None = None,
    rotation_degrees: int = 0,
    odd_size: OddSize = "exact",
    options: Mapping[str, str] | None = None,
    audio: NDArray[np.floating] | None = None,
    audio_rate: int = 16000,
) -> WrittenVideo:
    """Encode RGB frames into a video file.

    Args:
        path: output file; its suffix picks the container unless ``container`` is given. A file
            left half-written by a failure is removed.
        frames: RGB ``uint8`` frames, an array ``(N, H, W, 3)`` or a sequence of ``(H, W, 3)``.
        fps: nominal frame rate in frames per second; a float becomes the nearest fraction with
            denominator <= 1001 (29.97 stays 2997/100: pass ``Fraction(30000, 1001)`` for NTSC).
            Constant-rate frame ``i`` is at ``i / fps`` seconds.
        pts_seconds: variable frame rate: one presentation time per frame, in seconds, strictly
            increasing, rounded to the 90 kHz clock. ``None`` means constant rate ``fps``.
        codec: FFmpeg encoder name (``"libx264"``, ``"mpeg4"``, ``"libvpx-vp9"``...); ``None``
            means :func:`default_codec`.
        container: FFmpeg muxer name (``"mp4"``, ``"matroska"``...); ``None`` means from the suffix.
        gop: keyframe interval in frames; scene-cut keyframes are turned off for the encoders that
            add them, so keyframes fall exactly every ``gop`` frames. ``None`` keeps encoder defaults.
        pix_fmt: encoder pixel format; ``None`` means the encoder's preferred one (``yuv420p`` for
            H.264, VP9, MPEG-4; ``yuvj420p`` for MJPEG), or ``yuv444p``/``yuvj444p`` for odd sizes
            when the encoder has it (``libx264`` refuses odd sizes in 4:2:0).
        crf: constant rate factor for the encoders that have one (lower is better quality);
            ``None`` means the encoder default.
        bit_rate: target bit rate in bits per second; ``None`` means the encoder default.
        rotation_degrees: counter-clockwise display rotation (0, 90, 180 or 270) written as a
            display-matrix side data on the stream; players and ``VideoFrame.rotation`` report it.
            The pixels are stored unrotated. 0 writes no display matrix.
        odd_size: what to do with odd widths or heights: ``"exact"`` encodes them as they are,
            ``"pad"`` repeats the last row/column, ``"crop"`` drops it.
        options: extra encoder options (FFmpeg ``AVOption`` names to string values); they override
            the ones this function sets (``crf``, and the scene-cut settings that ``gop`` adds).
        audio: a mono audio track, samples in ``[-1, 1]``, muxed next to the video as AAC (what
            audio-in-video models read back); ``None`` writes video only.
        audio_rate: sample rate of ``audio``, Hz.

    Raises:
        ValueError: invalid frames, timestamps or settings, or the encoder/muxer refused them.
    """
    arrays = _fix_odd_size(_as_frames(frames), odd_size)
    height, width = arrays[0].shape[:2]
    rate = fps if isinstance(fps, Fraction) else Fraction(fps).limit_denominator(1001)
    if rate <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    if gop is not None and gop < 1:
        raise ValueError(f"gop must be >= 1 frame, got {gop}")
    if rotation_degrees not in _ROTATIONS:
        raise ValueError(f"rotation_degrees must be one of {_ROTATIONS}, got {rotation_degrees}")
    if bit_rate is not None and bit_rate <= 0:
        raise ValueError(f"bit_rate must be positive bits per second, got {bit_rate}")
    time_base, pts = _timestamps(len(arrays), rate, pts_seconds)
    if audio is not None:
        audio = np.asarray(audio, dtype=np.float32)
        if audio.ndim != 1 or audio.size == 0:
            raise ValueError(f"audio must be a non-empty 1-D array of mono samples, got shape {audio.shape}")
        if audio_rate <= 0:
            raise ValueError(f"audio_rate must be positive, got {audio_rate}")

    name = codec or default_codec()
    try:
        encoder = av.codec.Codec(name, "w")
    except av.codec.codec.UnknownCodecError as error:
        raise ValueError(
            f"encoder {name!r} is not in this PyAV build (see av.codecs_available); "
            f"{default_codec()!r} is available"
        ) from error
    if encoder.type != "video":
        raise ValueError(f"encoder {name!r} encodes {encoder.type}, not video")
    encoder_options = dict(_NO_SCENECUT.get(encoder.name, {})) if gop is not None else {}
    if crf is not None:
        if encoder.name not in _CRF_ENCODERS:
            raise ValueError(
                f"encoder {encoder.name!r} has no crf option (encoders with one: "
                f"{', '.join(sorted(_CRF_ENCODERS))}); use bit_rate instead"
            )
        encoder_options["crf"] = str(crf)
    encoder_options.update(options or {})
    chosen_pix_fmt = pix_fmt or _choose_pix_fmt(encoder, width, height)

    out_path = Path(path)
    frame_seconds = {Fraction(tick) * time_base: index for index, tick in enumerate(pts)}
    keyframes: set[int] = set()
    try:
        output = av.open(str(out_path), "w", format=container)
    except ValueError as error:
        raise ValueError(
            f"cannot open {out_path} for writing with container {container or 'from suffix'}: "
            f"{error}; pass container= a muxer name such as 'mp4' or 'matroska'"
        ) from error
    try:
        with output:
            stream = output.add_stream(encoder.name, rate=rate, options=encoder_options)
            stream.width, stream.height, stream.pix_fmt = width, height, chosen_pix_fmt
            stream.time_base = time_base
            stream.codec_context.time_base = time_base
            if gop is not None:
                stream.gop_size = gop
            if bit_rate is not None:
                stream.bit_rate = bit_rate
            if rotation_degrees:
                stream.set_display_rotation(rotation_degrees)
            muxer = output.format.name
            # Every stream must exist before the first packet is muxed (the header is written then).
            audio_stream = None if audio is None else output.add_stream("aac", rate=audio_rate, layout="mono")

            def mux(packets: list[av.Packet]) -> None:
                for packet in packets:
                    if packet.is_keyframe and packet.pts is not None:
                        keyframes.add(frame_seconds[Fraction(packet.pts) * packet.time_base])
                    output.mux(packet)

            for array, tick in zip(arrays, pts, strict=True):
                frame = av.VideoFrame.from_ndarray(array, format="rgb24")
                frame.pts, frame.time_base = tick, time_base
                mux(stream.encode(frame))
            mux(stream.encode(None))  # flush the encoder's delayed packets
            if audio is not None and audio_stream is not None:
                _write_audio(output, audio_stream, audio, audio_rate)
    except BaseException as error:
        out_path.unlink(missing_ok=True)
        if isinstance(error, av.error.FFmpegError):
            raise ValueError(
                f"could not write {out_path} as {encoder.name}/{chosen_pix_fmt} {width}x{height} "
                f"(container {container or 'from suffix'}): {error}"
            ) from error
        raise

    pts_out = tuple(float(Fraction(tick) * time_base) for tick in pts)
    return WrittenVideo(
        path=out_path,
        container=muxer,
        codec=encoder.name,
        pix_fmt=chosen_pix_fmt,
        width=width,
        height=height,
        num_frames=len(arrays),
        fps=float(rate),
        pts_seconds=pts_out,
        duration_seconds=pts_out[-1] + float(1 / rate),
        keyframe_indices=tuple(sorted(keyframes)),
        rotation_degrees=rotation_degrees,
        gop=gop,
    )
