"""Cached-frame manifests and bundles: schema, sampling over the source, confinement, errors."""

from __future__ import annotations

import io
import json
import os
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from video_grpo_demo.synthetic import indexed_frames, read_frame_index
from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.decode import DecodeLimits
from vllm_video_plugin.errors import VideoSamplingError
from vllm_video_plugin.manifest import (
    MANIFEST_FORMAT,
    MILLISECOND_GRID_FPS,
    ManifestError,
    load_manifest_frames,
    parse_manifest,
    sniff_media,
)
from vllm_video_plugin.sampling import sample_frames

pytestmark = pytest.mark.unit

NUM_FRAMES = 20
FPS = 10.0
UNIFORM_6 = VideoSamplingContract(style="uniform", num_frames=6)


def png(frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def frames() -> list[np.ndarray]:
    return indexed_frames(NUM_FRAMES, width=64, height=48)


@pytest.fixture
def root(tmp_path: Path, frames: list[np.ndarray]) -> Path:
    """A media root with every frame as ``clip/NNN.png``."""
    clip = tmp_path / "root" / "clip"
    clip.mkdir(parents=True)
    for index, frame in enumerate(frames):
        (clip / f"{index:03d}.png").write_bytes(png(frame))
    return tmp_path / "root"


def manifest(entries: list[dict[str, Any]], **top: Any) -> bytes:
    return json.dumps({"format": MANIFEST_FORMAT, **top, "frames": entries}).encode()


def all_frames(every: int = 1) -> list[dict[str, Any]]:
    return [{"path": f"clip/{i:03d}.png", "index": i} for i in range(0, NUM_FRAMES, every)]


def barcodes(data: np.ndarray) -> list[int]:
    return [read_frame_index(frame) for frame in data]


@pytest.mark.parametrize(
    "contract",
    [
        UNIFORM_6,
        VideoSamplingContract(style="nemotron_rounded", num_frames=5),
        VideoSamplingContract(style="qwen2_vl", fps=2.0),
        VideoSamplingContract(style="qwen3_vl", fps=3.0),
    ],
    ids=lambda contract: contract.style,
)
def test_fully_cached_manifest_samples_like_the_source_video(
    root: Path, frames: list[np.ndarray], contract: VideoSamplingContract
) -> None:
    loaded = load_manifest_frames(manifest(all_frames(), source_fps=FPS), contract, media_root=root)
    expected = sample_frames(NUM_FRAMES, FPS, NUM_FRAMES / FPS, contract)
    assert loaded.sample == expected
    assert loaded.requested_indices == expected.indices
    assert barcodes(loaded.data) == list(expected.indices)
    np.testing.assert_array_equal(loaded.data, np.stack([frames[i] for i in expected.indices]))


def test_sparse_cache_serves_the_nearest_frame_and_retimes(root: Path) -> None:
    # Every 4th frame cached, 20 frames at 10 fps; uniform 6 asks for [0, 3, 7, 11, 15, 19].
    entries = all_frames(every=4)
    loaded = load_manifest_frames(
        manifest(entries, source_fps=FPS, total_frames=NUM_FRAMES), UNIFORM_6, media_root=root
    )
    assert loaded.requested_indices == (0, 3, 7, 11, 15, 19)
    assert loaded.sample.indices == (0, 4, 8, 12, 16, 16)
    assert barcodes(loaded.data) == [0, 4, 8, 12, 16, 16]
    # Nemotron writes integer-millisecond frame durations: 100 ms per frame at 10 fps.
    assert loaded.sample.prompt_timestamps_s == (0.0, 0.4, 0.8, 1.2, 1.6, 1.6)
    assert loaded.sample.timestamps_s == (0.0, 0.4, 0.8, 1.2, 1.6, 1.6)


def test_timestamps_without_fps_use_a_millisecond_grid(root: Path) -> None:
    stamps = [0.0, 0.013, 0.9, 2.2, 3.307, 4.5]
    entries = [{"path": f"clip/{i:03d}.png", "timestamp_s": t} for i, t in enumerate(stamps)]
    loaded = load_manifest_frames(
        manifest(entries), VideoSamplingContract(style="uniform", num_frames=6), media_root=root
    )
    parsed = loaded.manifest
    assert parsed.source_fps == MILLISECOND_GRID_FPS
    assert parsed.total_frames == 4501 and parsed.duration_s == pytest.approx(4.501)
    assert loaded.sample.indices == (0, 13, 900, 2200, 3307, 4500)
    assert loaded.sample.prompt_timestamps_s == tuple(stamps)
    assert barcodes(loaded.data) == [0, 1, 2, 3, 4, 5]


def test_explicit_source_geometry_is_used(root: Path) -> None:
    # A 100-frame source of which every 5th frame is cached (the files clip/000..019 stand for
    # source frames 0, 5, ..., 95); the contract samples over all 100.
    entries = [{"path": f"clip/{i:03d}.png", "index": 5 * i} for i in range(NUM_FRAMES)]
    loaded = load_manifest_frames(
        manifest(entries, source_fps=FPS, total_frames=100, duration_s=10.0), UNIFORM_6, media_root=root
    )
    assert loaded.requested_indices == (0, 19, 39, 59, 79, 99)
    assert loaded.sample.indices == (0, 20, 40, 60, 80, 95)
    assert barcodes(loaded.data) == [0, 4, 8, 12, 16, 19]
    assert loaded.sample.total_frames == 100 and loaded.sample.duration_s == 10.0


def _bundle(document: bytes, members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        bundle.writestr("manifest.json", document)
        for name, data in members.items():
            bundle.writestr(name, data)
    return buffer.getvalue()


def test_a_bundle_claiming_frames_it_does_not_hold_is_refused(root: Path) -> None:
    """One cached frame claiming a 100000-frame source: every index a contract samples would be
    served by that frame, repeated (128 video tokens of one frame before this was refused)."""
    frame = (root / "clip" / "000.png").read_bytes()
    claim = manifest([{"path": "000.png", "index": 0}], source_fps=30.0, total_frames=100_000)
    with pytest.raises(ManifestError) as raised:
        load_manifest_frames(_bundle(claim, {"000.png": frame}), UNIFORM_6, media_root=None)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("<bytes sha256:")
    assert (
        "total_frames=100000, but its last cached frame 000.png is at source index 0 and it caches one "
        "frame: source frames 1-99999 have no cached frame near them" in message
    )
    # The same frame claiming what it is serves.
    honest = manifest([{"path": "000.png", "index": 0}], source_fps=30.0, total_frames=1)
    loaded = load_manifest_frames(_bundle(honest, {"000.png": frame}), UNIFORM_6, media_root=None)
    assert barcodes(loaded.data) == [0]


@pytest.mark.parametrize(
    ("entries", "top", "reason"),
    [
        # The first 20 frames of a 100-frame source.
        (
            all_frames(),
            {"total_frames": 100},
            r"total_frames=100, but its last cached frame clip/019\.png is at source index 19 and the "
            r"cached frames lie at most 1 apart: source frames 20-99 have no cached frame near them",
        ),
        # Every 4th frame, but the cache stops at frame 8 of 20.
        (
            all_frames(every=4)[:3],
            {"total_frames": NUM_FRAMES},
            r"last cached frame clip/008\.png is at source index 8 and the cached frames lie at most 4 "
            r"apart: source frames 9-19",
        ),
        # Frames 5-19 numbered as in the source, the start not cached.
        (
            all_frames()[5:],
            {},
            r"its first cached frame clip/005\.png is at source index 5 and the cached frames lie at most "
            r"1 apart: source frames 0-4 have no cached frame near them",
        ),
    ],
    ids=["tail", "sparse_tail", "head"],
)
def test_cached_frames_must_cover_the_source_they_claim(
    root: Path, entries: list[dict[str, Any]], top: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ManifestError, match=reason):
        load_manifest_frames(manifest(entries, source_fps=FPS, **top), UNIFORM_6, media_root=root)


@pytest.mark.parametrize(
    ("indices", "total_frames"),
    [
        ([0, 15, 30, 45], 60),  # every 15th of 60: 14 frames after the last, less than the spacing
        ([7, 22, 37], 45),  # the middle frame of every 15: 7 before the first, 7 after the last
        ([0], 1),
        ([0, 1, 2, 10], 15),  # the widest gap (8) is the spacing
    ],
)
def test_a_sparse_cache_covering_its_source_is_accepted(indices: list[int], total_frames: int) -> None:
    entries = [{"path": f"f{index}.png", "index": index} for index in indices]
    parsed = parse_manifest(manifest(entries, source_fps=FPS, total_frames=total_frames), source="m")
    assert parsed.total_frames == total_frames


def test_absolute_paths_inside_the_root_are_accepted(root: Path) -> None:
    entries = [{"path": str(root / "clip" / f"{i:03d}.png"), "index": i} for i in range(NUM_FRAMES)]
    loaded = load_manifest_frames(manifest(entries, source_fps=FPS), UNIFORM_6, media_root=root)
    assert barcodes(loaded.data) == [0, 3, 7, 11, 15, 19]


def bundle_members(root: Path, entries: list[dict[str, Any]], **top: Any) -> dict[str, bytes]:
    members = {"manifest.json": manifest(entries, **top)}
    for entry in entries:
        members[entry["path"]] = (root / entry["path"]).read_bytes()
    return members


def zip_bundle(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        for name, data in members.items():
            bundle.writestr(name, data)
    return buffer.getvalue()


def tar_bundle(members: dict[str, bytes], *, links: dict[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as bundle:
        for name, data in members.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            bundle.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            bundle.addfile(info)
    return buffer.getvalue()


@pytest.mark.parametrize("pack", [zip_bundle, tar_bundle], ids=["zip", "tar"])
def test_bundle_matches_the_directory_manifest(root: Path, pack: Any) -> None:
    data = pack(bundle_members(root, all_frames(), source_fps=FPS))
    from_bundle = load_manifest_frames(data, UNIFORM_6, media_root=None)
    from_files = load_manifest_frames(manifest(all_frames(), source_fps=FPS), UNIFORM_6, media_root=root)
    np.testing.assert_array_equal(from_bundle.data, from_files.data)
    assert from_bundle.sample == from_files.sample


def test_sniff_media(root: Path) -> None:
    members = bundle_members(root, all_frames(), source_fps=FPS)
    assert sniff_media(b'  \n{"format": 1}') == "manifest"
    assert sniff_media(zip_bundle(members)) == "zip"
    assert sniff_media(tar_bundle(members)) == "tar"
    assert sniff_media(b"\x00\x00\x00\x18ftypmp42" + bytes(600)) == "video"


# -- confinement ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("clip/../clip/000.png", "'..' is not allowed"),
        ("../outside.png", "'..' is not allowed"),
        ("ABSOLUTE_OUTSIDE", "outside the media root"),
        ("escape.png", "outside the media root"),
        ("clip/missing.png", "no such file"),
        ("clip", "not a regular file"),
    ],
    ids=["dotdot-inside", "dotdot", "absolute-outside", "symlink-escape", "missing", "directory"],
)
def test_paths_are_confined_to_the_media_root(root: Path, path: str, reason: str) -> None:
    outside = root.parent / "outside.png"
    outside.write_bytes((root / "clip" / "000.png").read_bytes())
    os.symlink(outside, root / "escape.png")
    path = str(outside) if path == "ABSOLUTE_OUTSIDE" else path
    data = manifest([{"path": path, "index": 0}], source_fps=FPS)
    with pytest.raises(ManifestError, match=reason) as raised:
        load_manifest_frames(data, UNIFORM_6, media_root=root)
    assert path in str(raised.value)  # the message names the frame file


def test_a_symlink_inside_the_root_is_followed(root: Path) -> None:
    os.symlink(root / "clip" / "005.png", root / "alias.png")
    loaded = load_manifest_frames(
        manifest([{"path": "alias.png", "index": 0}], source_fps=FPS), UNIFORM_6, media_root=root
    )
    assert barcodes(loaded.data) == [5]


def test_json_manifest_needs_a_media_root(root: Path) -> None:
    with pytest.raises(ManifestError, match="need a media root: set VIDEO_GRPO_MEDIA_ROOT"):
        load_manifest_frames(manifest(all_frames(), source_fps=FPS), UNIFORM_6, media_root=None)


def test_missing_media_root_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="media root .* does not exist"):
        load_manifest_frames(manifest(all_frames(), source_fps=FPS), UNIFORM_6, media_root=tmp_path / "nope")


@pytest.mark.parametrize(
    ("members", "links", "reason"),
    [
        ({"frame.png": b""}, None, "member manifest.json: is not in the tar bundle"),
        (None, {"clip/000.png": "/etc/passwd"}, "not a regular file"),
    ],
    ids=["no-manifest", "symlink-member"],
)
def test_tar_bundle_errors(
    root: Path, members: dict[str, bytes] | None, links: dict[str, str] | None, reason: str
) -> None:
    if members is None:
        members = bundle_members(root, all_frames(), source_fps=FPS)
        del members["clip/000.png"]
    with pytest.raises(ManifestError, match=reason):
        load_manifest_frames(tar_bundle(members, links=links), UNIFORM_6, media_root=None)


def test_bundle_paths_may_not_climb_out(root: Path) -> None:
    members = bundle_members(root, all_frames(), source_fps=FPS)
    members["manifest.json"] = manifest([{"path": "../000.png", "index": 0}], source_fps=FPS)
    with pytest.raises(ManifestError, match=r"member \.\./000\.png: '\.\.' is not allowed"):
        load_manifest_frames(zip_bundle(members), UNIFORM_6, media_root=None)


def test_zip_member_missing(root: Path) -> None:
    members = bundle_members(root, all_frames(), source_fps=FPS)
    del members["clip/003.png"]
    with pytest.raises(ManifestError, match=r"member clip/003\.png: is not in the zip bundle"):
        load_manifest_frames(zip_bundle(members), UNIFORM_6, media_root=None)


# -- frame files --------------------------------------------------------------------------------------


def test_frames_of_different_sizes_are_refused(root: Path, frames: list[np.ndarray]) -> None:
    (root / "clip" / "007.png").write_bytes(png(frames[7][:40]))
    with pytest.raises(ManifestError, match=r"frame clip/007\.png: is 64x40, frame clip/000\.png is 64x48"):
        load_manifest_frames(manifest(all_frames(), source_fps=FPS), UNIFORM_6, media_root=root)


def test_unreadable_image_is_named(root: Path) -> None:
    (root / "clip" / "003.png").write_bytes(b"not an image")
    with pytest.raises(ManifestError, match=r"frame clip/003\.png: not a readable PNG/JPEG/WEBP/BMP image"):
        load_manifest_frames(manifest(all_frames(), source_fps=FPS), UNIFORM_6, media_root=root)


def test_only_the_picked_frames_are_read(root: Path) -> None:
    # Frame 1 is damaged but never sampled by uniform 6 over 20 frames.
    (root / "clip" / "001.png").write_bytes(b"not an image")
    loaded = load_manifest_frames(manifest(all_frames(), source_fps=FPS), UNIFORM_6, media_root=root)
    assert barcodes(loaded.data) == [0, 3, 7, 11, 15, 19]


def test_limits_apply(root: Path) -> None:
    data = manifest(all_frames(), source_fps=FPS)
    with pytest.raises(ManifestError, match="over the limit of 1000 pixels"):
        load_manifest_frames(data, UNIFORM_6, media_root=root, limits=DecodeLimits(max_frame_pixels=1000))
    frame_bytes = (root / "clip" / "000.png").stat().st_size
    with pytest.raises(ManifestError, match="bytes left of the read limit"):
        load_manifest_frames(
            data,
            UNIFORM_6,
            media_root=root,
            limits=DecodeLimits(max_input_bytes=len(data) + frame_bytes // 2),
        )


def test_sampling_errors_pass_through(root: Path) -> None:
    one_frame = manifest([{"path": "clip/000.png", "index": 0}], source_fps=FPS)
    with pytest.raises(VideoSamplingError, match="temporal_patch_size"):
        load_manifest_frames(one_frame, VideoSamplingContract(style="qwen2_vl"), media_root=root)


# -- schema -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        (b"[1, 2]", "a manifest is a JSON object, got list"),
        (b"{not json", "not valid JSON"),
        ({"format": "other/v9", "frames": []}, "format is 'other/v9'"),
        ({"format": MANIFEST_FORMAT, "fps": 3, "frames": []}, r"unknown keys \['fps'\]"),
        ({"format": MANIFEST_FORMAT, "frames": []}, "frames must be a non-empty list"),
        ({"source_fps": 0, "frames": [{"path": "a", "index": 0}]}, "source_fps must be positive, got 0"),
        ({"source_fps": True, "frames": [{"path": "a", "index": 0}]}, "source_fps must be a finite number"),
        ({"source_fps": 2, "frames": [{"path": "a"}]}, r"frames\[0\] \(a\) needs exactly one of index"),
        (
            {"source_fps": 2, "frames": [{"path": "a", "index": 0, "timestamp_s": 0}]},
            "needs exactly one of index and timestamp_s",
        ),
        ({"frames": [{"path": "a", "index": 0}]}, r"frames\[0\] \(a\) gives an index, which needs"),
        (
            {"source_fps": 2, "frames": [{"path": "a", "index": -1}]},
            r"frames\[0\]\.index must be an integer >= 0",
        ),
        ({"source_fps": 2, "frames": [{"path": "a", "index": 0, "colour": 1}]}, r"unknown keys \['colour'\]"),
        ({"source_fps": 2, "frames": [{"path": "", "index": 0}]}, r"frames\[0\]\.path must be a non-empty"),
        (
            {"source_fps": 2, "frames": [{"path": "a", "index": 1}, {"path": "b", "timestamp_s": 0.5}]},
            r"frames\[1\] \(b\) and a are both at source index 1",
        ),
        (
            {"source_fps": 2, "total_frames": 3, "frames": [{"path": "a", "index": 3}]},
            "frame a is at source index 3, beyond total_frames=3",
        ),
        (b"[" * 100_000, "the JSON is nested too deeply to parse"),
        (
            {"source_fps": 10**400, "frames": [{"path": "a", "index": 0}]},
            "source_fps must be a finite number",
        ),
        (
            {"source_fps": 30, "total_frames": 10**400, "frames": [{"path": "a", "index": 0}]},
            "total_frames must be at most 2147483647",
        ),
        (
            {"source_fps": 1e10, "frames": [{"path": "a", "timestamp_s": 1e300}]},
            r"frames\[0\] \(a\) timestamp_s=1e\+300 is out of range",
        ),
        (
            {"source_fps": 1e-320, "frames": [{"path": "a", "index": 0}]},
            r"total_frames=1 / source_fps=1e-320 overflows; give duration_s",
        ),
        (
            {"duration_s": 0, "frames": [{"path": "a", "timestamp_s": 0.0}]},
            r"duration_s=0.0 gives no finite mean frame rate",
        ),
    ],
)
def test_schema_errors(document: bytes | dict[str, Any], reason: str) -> None:
    if isinstance(document, dict):
        document = json.dumps({"format": MANIFEST_FORMAT, **document}).encode()
    with pytest.raises(ManifestError, match=reason) as raised:
        parse_manifest(document, source="clip.json")
    assert str(raised.value).startswith("clip.json: ")


def test_parse_sorts_frames_and_fills_defaults() -> None:
    parsed = parse_manifest(
        manifest([{"path": "b", "index": 5}, {"path": "a", "timestamp_s": 0.25}], source_fps=8), source="m"
    )
    assert [(frame.index, frame.path) for frame in parsed.frames] == [(2, "a"), (5, "b")]
    assert (parsed.source_fps, parsed.total_frames, parsed.duration_s) == (8.0, 6, 0.75)
