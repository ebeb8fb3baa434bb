"""Decode only the frames a sample needs, with PyAV.

How :func:`decode_frames` keeps the work down:

1. One demux pass reads every packet of the video stream (no decoding) and keeps them in memory
   (about the size of the video stream) until the call returns. Packet timestamps give
   each frame's presentation index (its rank by pts among the presentable packets), which is exact
   for variable frame rate video and for containers whose header miscounts frames, and keyframe
   flags give the places decoding can start.
2. For each sampled frame, decoding starts at the last keyframe whose pts is at or before the
   frame's, and runs in decode order up to the frame's packet. When that keyframe lies beyond the
   packets already decoded, the decoder is flushed and jumps to it instead of decoding the gap (a
   seek, without asking the demuxer again: the packets are in memory).
3. Packets of frames nobody asked for are sent with ``skip_frame="NONREF"``, so the codec drops
   frames that no other frame references (B-frames in H.264/HEVC) without decoding them.
4. Only sampled frames are converted to RGB (``VideoFrame.to_ndarray``); each decoded frame is
   converted at most once, even when a style repeats it.

Frame indices are presentation order as decoded (what OpenCV counts and what vLLM's
``frames_indices`` mean). Sampling runs over the frames the demux pass found; vLLM's OpenCV loader
samples over the header's count instead. They agree on well-formed files; where a header
over-reports, OpenCV returns fewer frames than it sampled, while this decoder samples over the
frames that exist (the header's count is kept in :class:`VideoSourceInfo`). Colour conversion is
FFmpeg's swscale to ``rgb24``, as in vLLM's OpenCV loader (identical bytes on the H.264 4:2:0
files tested). Rotation metadata (a display matrix) is applied like OpenCV's default
``CAP_PROP_ORIENTATION_AUTO``, which vLLM's stock loader leaves on: a 90-degree video comes out
rotated, height and width swapped.

Threading: one decoding thread by default, the fastest on small machines (timings in
``docs/ARCHITECTURE.md``); frame threading also delays output after every jump. ``threads > 1``
turns on frame threading.

The package: :mod:`.limits` (input types and :class:`DecodeLimits`), :mod:`.probe` (opening a
video and the demux pass), :mod:`.frames` (decoding, :func:`decode_frames`).
"""

from vllm_video_plugin.decode.frames import FrameBatch, decode_frames
from vllm_video_plugin.decode.limits import DEFAULT_LIMITS, DecodeLimits, VideoSource, source_label
from vllm_video_plugin.decode.probe import VideoSourceInfo, check_limits

__all__ = [
    "DEFAULT_LIMITS",
    "DecodeLimits",
    "FrameBatch",
    "VideoSource",
    "VideoSourceInfo",
    "check_limits",
    "decode_frames",
    "source_label",
]
