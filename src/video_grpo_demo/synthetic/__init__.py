"""Synthetic videos with known content, for tests and the demo task.

- :mod:`~video_grpo_demo.synthetic.frames`: palette colours, large shapes and a frame-index barcode,
  plus classifiers that read them back from lossy-decoded frames.
- :mod:`~video_grpo_demo.synthetic.writer`: :func:`write_video` encodes frames with PyAV and returns a
  :class:`WrittenVideo` describing what was written (timestamps, keyframes, rotation).
- :mod:`~video_grpo_demo.synthetic.tasks`: seeded multiple-choice clips with verifiable answers.
"""

from video_grpo_demo.synthetic.frames import (
    BARCODE_DIGITS,
    PALETTE,
    SATURATED_COLOURS,
    SHAPES,
    BarcodeError,
    ColourName,
    Frame,
    ShapeName,
    classify_colour,
    classify_shape,
    draw_frame_index,
    indexed_frames,
    read_frame_index,
    shape_frame,
    shape_mask,
    solid_frame,
)
from video_grpo_demo.synthetic.tasks import (
    TASKS,
    ClipConfig,
    TaskName,
    TaskRecord,
    generate_task_clips,
    make_task_clip,
    read_records_jsonl,
    write_records_jsonl,
)
from video_grpo_demo.synthetic.writer import OddSize, WrittenVideo, default_codec, write_video

__all__ = [
    "BARCODE_DIGITS",
    "PALETTE",
    "SATURATED_COLOURS",
    "SHAPES",
    "TASKS",
    "BarcodeError",
    "ClipConfig",
    "ColourName",
    "Frame",
    "OddSize",
    "ShapeName",
    "TaskName",
    "TaskRecord",
    "WrittenVideo",
    "classify_colour",
    "classify_shape",
    "default_codec",
    "draw_frame_index",
    "generate_task_clips",
    "indexed_frames",
    "make_task_clip",
    "read_frame_index",
    "read_records_jsonl",
    "shape_frame",
    "shape_mask",
    "solid_frame",
    "write_records_jsonl",
    "write_video",
]
