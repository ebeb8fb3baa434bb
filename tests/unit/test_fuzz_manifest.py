"""Fuzzing the cached-frame manifest parser and loader: any bytes or JSON give a ManifestError (or a
VideoSamplingError from the contract), a valid manifest, or frames read from inside the media root.

The media root holds a few one-colour PNG frames; a PNG of another colour lies outside it, reachable
through ``..``, an absolute path and a symlink. No loaded frame may ever have the outside colour.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.errors import VideoSamplingError
from vllm_video_plugin.manifest import (
    MANIFEST_FORMAT,
    FrameManifest,
    ManifestError,
    load_manifest_frames,
    parse_manifest,
)

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=250, deadline=2000, suppress_health_check=[HealthCheck.too_slow])

INSIDE = (10, 200, 30)
OUTSIDE = (250, 5, 5)
FRAMES = [f"clip/{i:03d}.png" for i in range(4)]

NUMBERS = (
    st.integers()
    | st.integers(-(10**400), 10**400)
    | st.floats()
    | st.sampled_from([0, 1, -1, 0.0, 1e-320, 1e308, 30.0, 29.97])
)
JSON = st.recursive(
    st.none() | st.booleans() | NUMBERS | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=25,
)
PATHS = st.sampled_from(
    [
        *FRAMES,
        "clip/missing.png",
        "../outside.png",
        "clip/../../outside.png",
        "escape.png",
        "clip",
        "",
        "/etc/passwd",
        "clip\\000.png",
        "clip/\x00.png",
        "./clip/000.png",
        "clip//001.png",
    ]
) | st.text(max_size=12)


@st.composite
def manifest_documents(draw: st.DrawFn, outside: str) -> dict[str, Any]:
    """Mostly well-formed manifests, with any field possibly odd."""
    frames = []
    for _ in range(draw(st.integers(0, 5))):
        frame: dict[str, Any] = {"path": draw(PATHS | st.just(outside))}
        choice = draw(st.sampled_from(["index", "timestamp_s", "both", "neither"]))
        if choice in ("index", "both"):
            frame["index"] = draw(st.integers(0, 200) | NUMBERS)
        if choice in ("timestamp_s", "both"):
            frame["timestamp_s"] = draw(st.floats(0, 20) | NUMBERS)
        if draw(st.integers(0, 9)) == 0:
            frame[draw(st.text(max_size=5))] = draw(JSON)
        frames.append(frame)
    document: dict[str, Any] = {
        "format": draw(st.just(MANIFEST_FORMAT) | st.text(max_size=5)),
        "frames": frames,
    }
    for key, values in (
        ("source_fps", st.floats(0.5, 120) | NUMBERS),
        ("total_frames", st.integers(1, 500) | NUMBERS),
        ("duration_s", st.floats(0, 60) | NUMBERS),
    ):
        if draw(st.booleans()):
            document[key] = draw(values)
    return document


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(media root, the file outside it)."""
    base = tmp_path_factory.mktemp("fuzz_manifest")
    root = base / "root"
    (root / "clip").mkdir(parents=True)
    for path in FRAMES:
        Image.new("RGB", (4, 4), INSIDE).save(root / path)
    outside = base / "outside.png"
    Image.new("RGB", (4, 4), OUTSIDE).save(outside)
    (root / "escape.png").symlink_to(outside)
    return root, outside


def _encode(document: Any) -> bytes:
    return json.dumps(document, allow_nan=True).encode()


def _check_manifest(manifest: FrameManifest) -> None:
    indices = [frame.index for frame in manifest.frames]
    assert indices == sorted(set(indices)) and indices[0] >= 0
    assert indices[-1] < manifest.total_frames
    if manifest.frame_rate_known:  # the cached frames cover the source they claim
        spacing = max((b - a for a, b in zip(indices, indices[1:], strict=False)), default=1)
        assert indices[0] < spacing and manifest.total_frames - 1 - indices[-1] < spacing
    assert math.isfinite(manifest.source_fps) and manifest.source_fps > 0
    assert math.isfinite(manifest.duration_s) and manifest.duration_s >= 0


@FUZZ
@given(data=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
@example(data=b"[" * 100_000).via("nesting deeper than the JSON parser's recursion limit")
@example(data=b"\xff\xfe{").via("not UTF-8")
def test_any_bytes_give_a_manifest_error_or_a_manifest(data: bytes) -> None:
    try:
        manifest = parse_manifest(data, source="fuzz")
    except ManifestError as error:
        assert error.source == "fuzz" and error.reason
        return
    _check_manifest(manifest)


@FUZZ
@given(document=JSON | manifest_documents(outside="/nonexistent/outside.png"))
@example(
    document={"format": MANIFEST_FORMAT, "source_fps": 10**400, "frames": [{"path": "a", "index": 0}]}
).via("an integer too large for a float")
@example(
    document={"format": MANIFEST_FORMAT, "source_fps": 1e10, "frames": [{"path": "a", "timestamp_s": 1e300}]}
).via("timestamp * rate overflows to inf")
@example(
    document={
        "format": MANIFEST_FORMAT,
        "source_fps": 30.0,
        "total_frames": 10**400,
        "frames": [{"path": "a", "index": 0}],
    }
).via("total_frames / source_fps overflows")
def test_any_json_gives_a_manifest_error_or_a_consistent_manifest(document: Any) -> None:
    try:
        manifest = parse_manifest(_encode(document), source="fuzz")
    except ManifestError as error:
        assert error.reason
        return
    _check_manifest(manifest)


@FUZZ
@given(data=st.data())
@example(data=None).via("no source_fps and a zero duration")
def test_loading_never_escapes_the_media_root(media: tuple[Path, Path], data: st.DataObject | None) -> None:
    root, outside = media
    if data is None:
        document: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "duration_s": 0,
            "frames": [{"path": FRAMES[0], "timestamp_s": 0.0}],
        }
    else:
        document = data.draw(manifest_documents(outside=str(outside)), label="manifest")
    contract = VideoSamplingContract(style="uniform", num_frames=4)
    try:
        loaded = load_manifest_frames(_encode(document), contract, media_root=root)
    except (ManifestError, VideoSamplingError) as error:
        assert str(error)
        return
    assert (
        loaded.data.dtype == np.uint8
        and loaded.data.ndim == 4
        and len(loaded.data) == len(loaded.sample.indices)
    )
    colours = {tuple(int(c) for c in frame[0, 0]) for frame in loaded.data}
    assert colours == {INSIDE}, f"read a frame from outside the media root: {document}"
    _check_manifest(loaded.manifest)
