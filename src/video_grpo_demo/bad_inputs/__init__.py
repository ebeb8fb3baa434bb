"""A corpus of bad (and merely unusual) inputs, generated on the fly, with the outcome each layer owes.

Users feed this package videos from the wild, cached-frame manifests written by other tools and
Gym rows written by other people. :func:`write_bad_inputs` writes one example of each kind of
trouble under a media root (PyAV and NumPy only, nothing checked in) and returns them as
:class:`BadInput` objects: an id, a description, the Gym ``input`` items of a row that carries
it, and the outcome every layer that sees it must give (:data:`LAYERS`):

- ``"error"``: a clear error naming the input and the reason (an HTTP 4xx at a server); in the
  trainer, the sample is masked with a reason and counted;
- ``"accepted"``: the input is handled (decoded, relocated, trained on).

The project's tests run every case through every layer and render the observations into
``docs/RELIABILITY.md``. The same corpus serves training runs that mix bad rows into a dataset:
:meth:`BadInput.row` is a Gym row.

Cases that need a configured bound use :data:`CORPUS_MAX_VIDEO_BYTES` (the byte limit the layers
under test are configured with); the over-budget video relies on the default pixel budget of
:class:`vllm_video_plugin.decode.DecodeLimits`.
"""

from __future__ import annotations

import base64
import io
import json
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, get_args

import numpy as np
from PIL import Image

from video_grpo_demo.bad_inputs import _files
from video_grpo_demo.bad_inputs._files import good_video
from video_grpo_demo.synthetic.frames import indexed_frames
from video_grpo_demo.synthetic.writer import write_video

__all__ = [
    "CORPUS_MAX_VIDEO_BYTES",
    "LAYERS",
    "BadInput",
    "Expected",
    "Layer",
    "good_video",
    "write_bad_inputs",
]

Layer = Literal["decoder", "vllm_server", "gym_request", "gym_server", "dataset", "trainer"]
"""Where an input is checked:

- ``decoder``: this package's vLLM video loader in process (``VideoGRPOLoader.load_bytes``:
  decoding, manifests, decode limits);
- ``vllm_server``: a running vLLM OpenAI server with this package's loader selected by
  ``--media-io-kwargs`` (as users run it), chat completions with the media as a URL;
- ``gym_request``: the Gym model server's request preparation (``prepare_request_media``: media
  confinement, byte limits, tool-output relocation, part types), in process;
- ``gym_server``: the running Gym ``video_vllm_model`` server in front of vLLM;
- ``dataset``: the dataset validator (``gym_video_env.datasets.validate_row``, decoding on);
- ``trainer``: the trainer's preprocessing (``rl_bridge.policy_inputs.PolicyInputBuilder``).
"""
LAYERS: Final[tuple[Layer, ...]] = get_args(Layer)

Expected = Literal["error", "accepted"]
"""``error``: refused with a message naming the input and the reason (masked and counted in the
trainer); ``accepted``: handled normally."""

CORPUS_MAX_VIDEO_BYTES: Final = 16 * 1024
"""The video byte limit the corpus assumes the layers under test are configured with, in bytes;
:func:`good_video` stays far below it and the ``data_url_over_limit`` payload above it."""

_QUESTION: Final = "What colour is the clip?"


@dataclass(frozen=True)
class BadInput:
    """One case of the corpus, written to disk."""

    id: str
    """Stable identifier, e.g. ``"truncated"``."""
    description: str
    """What is wrong (or unusual) about the input, in one sentence."""
    expected: Mapping[Layer, Expected]
    """The outcome each layer that sees the input owes; layers absent here never see it."""
    items: list[dict[str, Any]]
    """Gym ``responses_create_params.input`` items carrying the input."""
    path: Path | None = None
    """The media file (video, manifest) the case wrote, if any."""
    url: str | None = None
    """The URL of the media as a chat ``video_url`` part names it (``file://`` or ``data:``), if any."""
    note: str = ""
    """Why the expected outcome is what it is, where that is a decision rather than obvious."""
    chat_content: list[dict[str, Any]] | None = field(default=None, repr=False)
    """Chat-completions content of the user message for ``vllm_server`` (``None``: the case is
    not sent to vLLM directly)."""

    @property
    def payload(self) -> bytes | None:
        """The media bytes the vLLM loader receives (``None`` when the case has no media bytes)."""
        if self.path is not None:
            return self.path.read_bytes()
        if self.url is not None and self.url.startswith("data:"):
            return base64.b64decode(self.url.partition(",")[2])
        return None

    def row(self, *, answer: str = "A") -> dict[str, Any]:
        """A Gym row (``video_mcqa`` shape without options) whose prompt carries the input."""
        return {"responses_create_params": {"input": self.items}, "task_id": self.id, "answer": answer}


def write_bad_inputs(media_root: Path, outside: Path) -> list[BadInput]:
    """Write every case of the corpus and return them in a fixed order.

    Args:
        media_root: directory the media go into (``videos/``, ``frames/``, ``manifests/``); the
            layers under test confine local media to it.
        outside: a directory outside ``media_root`` (and outside the vLLM server's allowed local
            media path) where the escaping cases put their targets.
    """
    videos, manifests = media_root / "videos", media_root / "manifests"
    for directory in (videos, manifests, media_root / "frames", outside):
        directory.mkdir(parents=True, exist_ok=True)
    return [make(media_root, outside) for make in _CASES]


# -- the cases (their files are written by _files) --------------------------------------------------

# Media that reach the decoding layers and must be refused there.
_UNDECODABLE: Final[dict[Layer, Expected]] = {
    "decoder": "error",
    "vllm_server": "error",
    "gym_request": "accepted",  # Gym checks where media are and their size, not their content
    "gym_server": "error",
    "dataset": "error",
    "trainer": "error",
}
_DECODABLE: Final[dict[Layer, Expected]] = dict.fromkeys(LAYERS, "accepted")


def _video_case(
    case_id: str,
    description: str,
    write: Callable[[Path], Path],
    expected: Mapping[Layer, Expected],
    note: str = "",
) -> Callable[[Path, Path], BadInput]:
    def make(media_root: Path, outside: Path) -> BadInput:
        path = write(media_root / "videos")
        return _file_case(case_id, description, path, media_root, expected, note)

    return make


def _file_case(
    case_id: str,
    description: str,
    path: Path,
    media_root: Path,
    expected: Mapping[Layer, Expected],
    note: str = "",
) -> BadInput:
    reference = path.relative_to(media_root).as_posix()
    return BadInput(
        id=case_id,
        description=description,
        expected=dict(expected),
        items=[_user({"type": "input_video", "video_url": reference})],
        path=path,
        url=path.as_uri(),
        note=note,
        chat_content=_chat_video(path.as_uri()),
    )


def _user(*media: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": [*media, {"type": "input_text", "text": _QUESTION}]}


def _chat_video(url: str) -> list[dict[str, Any]]:
    return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": _QUESTION}]


# Manifests ------------------------------------------------------------------------------------------


def _manifest_case(
    case_id: str, description: str, frames: Callable[[Path, Path], list[dict[str, Any]] | str], note: str = ""
) -> Callable[[Path, Path], BadInput]:
    """A manifest case; ``frames(media_root, outside)`` gives the frame entries, or the raw text."""

    def make(media_root: Path, outside: Path) -> BadInput:
        content = frames(media_root, outside)
        if isinstance(content, str):
            text = content
        else:
            text = json.dumps({"format": "video_grpo.frames/v1", "source_fps": 8.0, "frames": content})
        path = media_root / "manifests" / f"{case_id}.json"
        path.write_text(text)
        expected: dict[Layer, Expected] = {**_UNDECODABLE}
        return _file_case(case_id, description, path, media_root, expected, note)

    return make


# Requests and rows ---------------------------------------------------------------------------------------


def _data_url_over_limit(media_root: Path, outside: Path) -> BadInput:
    noise = np.random.default_rng(1).integers(
        0, 256, (_files.GOOD_FRAMES, _files.SIZE, _files.SIZE, 3), dtype=np.uint8
    )
    path = write_video(outside / "noise.mp4", noise, fps=_files.FPS).path
    data = path.read_bytes()
    if len(data) <= CORPUS_MAX_VIDEO_BYTES:
        raise RuntimeError(f"the noise clip is {len(data)} bytes, not over {CORPUS_MAX_VIDEO_BYTES}")
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    return BadInput(
        id="data_url_over_limit",
        description=(
            f"an inline data: URL video of {len(data)} bytes, over a limit of {CORPUS_MAX_VIDEO_BYTES}"
        ),
        expected=dict.fromkeys(LAYERS, "error"),
        items=[_user({"type": "input_video", "video_url": url})],
        url=url,
        chat_content=_chat_video(url),
        note="Each layer is configured with the limit: vLLM's loader through "
        "decode_limits.max_input_bytes, Gym through MediaSettings.max_video_bytes, the validator "
        "through --max-video-bytes, the trainer through DecodeLimits.",
    )


def _missing_file(media_root: Path, outside: Path) -> BadInput:
    path = media_root / "missing" / "never_written.mp4"  # not under videos/: the bad-row runs add their own
    return BadInput(
        id="missing_file",
        description="a reference (and a file:// URL) to a video inside the media root that does not exist",
        expected={
            "vllm_server": "error",
            "gym_request": "error",
            "gym_server": "error",
            "dataset": "error",
            "trainer": "error",
        },
        items=[_user({"type": "input_video", "video_url": path.relative_to(media_root).as_posix()})],
        path=path,
        url=path.as_uri(),
        chat_content=_chat_video(path.as_uri()),
        note="A client error everywhere: vLLM's own connector lets the missing file's OSError through "
        "(HTTP 500, the path replaced by <path>); this package's media connector answers 400 naming "
        "the path relative to the allowed local media path.",
    )


def _bundle_claiming_frames(media_root: Path, outside: Path) -> BadInput:
    frame = io.BytesIO()
    Image.fromarray(indexed_frames(1, width=_files.SIZE, height=_files.SIZE)[0]).save(frame, format="PNG")
    manifest = {
        "format": "video_grpo.frames/v1",
        "source_fps": 30.0,
        "total_frames": 100_000,
        "frames": [{"path": "0.png", "index": 0}],
    }
    path = media_root / "manifests" / "claims_frames.zip"
    with zipfile.ZipFile(path, "w") as bundle:
        bundle.writestr("manifest.json", json.dumps(manifest))
        bundle.writestr("0.png", frame.getvalue())
    return _file_case(
        "bundle_claims_frames",
        "a frame bundle of one cached frame claiming total_frames=100000",
        path,
        media_root,
        _UNDECODABLE,
        note="Refused as malformed: every index a contract samples past the cached frames would be "
        "served by the same frame, repeated (it was served as 128 video tokens of one frame).",
    )


def _file_url_outside(media_root: Path, outside: Path) -> BadInput:
    path = good_video(outside / "outside.mp4")
    return BadInput(
        id="file_url_outside",
        description=(
            "a file:// URL of a real video outside the media root and vLLM's allowed local media path"
        ),
        expected={
            "vllm_server": "error",
            "gym_request": "error",
            "gym_server": "error",
            "dataset": "error",
            "trainer": "error",
        },
        items=[_user({"type": "input_video", "video_url": path.as_uri()})],
        url=path.as_uri(),
        chat_content=_chat_video(path.as_uri()),
    )


def _tool_output_media(media_root: Path, outside: Path) -> BadInput:
    clip = good_video(media_root / "videos" / "tool_clip.mp4").relative_to(media_root).as_posix()
    items = [
        _user({"type": "input_video", "video_url": clip}),
        {"type": "function_call", "call_id": "call-1", "name": "next_segment", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "call-1",
            "output": [
                {"type": "input_text", "text": "segment 2"},
                {"type": "input_video", "video_url": clip},
            ],
        },
    ]
    return BadInput(
        id="tool_output_media",
        description="a video inside a tool output (function_call_output), which stock Gym rejects",
        expected={
            "gym_request": "accepted",
            "gym_server": "accepted",
            "dataset": "accepted",
            "trainer": "accepted",
        },
        items=items,
        note="The model server relocates the video into a user message after the tool output before "
        "prompting vLLM; a trajectory recorded with the media still in the tool output (Gym's stock "
        "agents) is relocated the same way by the trainer, which then trains on it.",
    )


def _unknown_part_type(media_root: Path, outside: Path) -> BadInput:
    part = {"type": "input_hologram", "hologram_url": "holo://clip"}
    return BadInput(
        id="unknown_part_type",
        description="a content part of an unknown type (input_hologram) in the user message",
        expected={
            "vllm_server": "error",
            "gym_request": "error",
            "gym_server": "error",
            "dataset": "error",
            "trainer": "error",
        },
        items=[{"role": "user", "content": [part, {"type": "input_text", "text": _QUESTION}]}],
        chat_content=[
            {"type": "hologram_url", "hologram_url": {"url": "holo://clip"}},
            {"type": "text", "text": _QUESTION},
        ],
    )


def _text_only_row(media_root: Path, outside: Path) -> BadInput:
    return BadInput(
        id="text_only_row",
        description="a Gym row with no media at all, mixed into a batch of video rows",
        expected={layer: outcome for layer, outcome in _DECODABLE.items() if layer != "decoder"},
        items=[{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}],
        chat_content=[{"type": "text", "text": "Name a colour."}],
    )


_CASES: Final[tuple[Callable[[Path, Path], BadInput], ...]] = (
    _video_case(
        "truncated", "an MP4 cut in half: its index (moov) is missing", _files.truncated, _UNDECODABLE
    ),
    _video_case(
        "corrupt_middle",
        "random bytes overwrite the middle third of the coded frames (the container is intact)",
        _files.corrupt_middle,
        _UNDECODABLE,
        note="Damage the decoder detects is an error. Damage it cannot detect (a few flipped bits inside "
        "a slice) is concealed by FFmpeg and decodes, slightly wrong, identically on every side.",
    ),
    _video_case("zero_length", "an empty file named .mp4", _files.zero_length, _UNDECODABLE),
    _video_case(
        "audio_only", "an MP4 with an AAC audio stream and no video stream", _files.audio_only, _UNDECODABLE
    ),
    _video_case(
        "zero_decodable_frames",
        "an MP4 whose 8 frame packets are all zeros: demuxable, none decodable",
        _files.zero_decodable_frames,
        _UNDECODABLE,
    ),
    _video_case(
        "overreported_frame_count",
        "an AVI whose headers claim 1000 frames but which holds 8",
        _files.overreported_frame_count,
        _DECODABLE,
        note="The decoder counts the packets and samples over the 8 frames that exist.",
    ),
    _video_case(
        "variable_frame_rate",
        "8 frames at irregular times (gaps of 0.05 to 0.4 s)",
        _files.variable_frame_rate,
        _DECODABLE,
    ),
    _video_case(
        "rotation_90",
        "a 64x48 clip with a 90-degree display matrix",
        _files.rotation,
        _DECODABLE,
        note="Frames come out rotated (48x64), as OpenCV and vLLM's stock loader return them.",
    ),
    _video_case("odd_size", "a 63x47 clip (odd width and height, 4:4:4 H.264)", _files.odd_size, _DECODABLE),
    _video_case(
        "tiny_1x1",
        "a 1x1-pixel clip",
        _files.tiny,
        _DECODABLE,
        note="A 1x1 video is a valid video: the decoder returns 1x1 frames and the model's processor "
        "resizes them up to its minimum pixel budget (Qwen's smart_resize), as for any small image.",
    ),
    _video_case(
        "over_pixel_budget",
        "a stream whose header declares 10000x10000 frames (3x the default pixel budget) with 4 KiB of data",
        _files.over_pixel_budget,
        _UNDECODABLE,
        note="Refused from the stream header, before any packet is read.",
    ),
    _video_case(
        "unsupported_codec",
        "an AVI whose video codec fourcc (QQQZ) no decoder knows",
        _files.unsupported_codec,
        _UNDECODABLE,
    ),
    _video_case("not_a_video", "a CSV text file named .mp4", _files.not_a_video, _UNDECODABLE),
    _manifest_case("manifest_dotdot", "a frame manifest whose last frame path contains '..'", _files.dotdot),
    _manifest_case(
        "manifest_absolute_outside",
        "a frame manifest naming an absolute path outside the media root",
        _files.absolute_outside,
    ),
    _manifest_case(
        "manifest_symlink_escape",
        "a frame manifest naming a symlink inside the media root that points outside it",
        _files.symlink_escape,
    ),
    _manifest_case(
        "manifest_missing_frame",
        "a frame manifest naming a frame file that does not exist",
        _files.missing_frame,
    ),
    _manifest_case(
        "manifest_mixed_shapes", "a frame manifest whose frames are 64x64 and 128x64", _files.mixed_shapes
    ),
    _manifest_case("manifest_malformed_json", "a frame manifest cut off mid-JSON", _files.malformed_json),
    _manifest_case(
        "manifest_wrong_types", "a frame manifest with source_fps and index as strings", _files.wrong_types
    ),
    _bundle_claiming_frames,
    _data_url_over_limit,
    _missing_file,
    _file_url_outside,
    _tool_output_media,
    _unknown_part_type,
    _text_only_row,
)
