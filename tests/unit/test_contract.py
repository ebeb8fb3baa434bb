"""The sampling contract: validation, canonical form, and the media-io block round trip."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from vllm_video_plugin.contract import (
    QWEN_DEFAULT_FPS,
    QWEN_MAX_FRAMES,
    QWEN_MIN_FRAMES,
    VIDEO_LOADER_NAME,
    VideoSamplingContract,
)

pytestmark = pytest.mark.unit

CONTRACTS = [
    VideoSamplingContract(style="uniform"),
    VideoSamplingContract(style="uniform", num_frames=32),
    VideoSamplingContract(style="uniform", num_frames=128, fps=2.0, temporal_patch_size=1),
    VideoSamplingContract(
        style="nemotron_rounded", num_frames=32, target_num_patches=1024, patch_size=16, spatial_merge_size=2
    ),
    VideoSamplingContract(style="nemotron_rounded", num_frames=8, aspect_policy="stretch"),
    VideoSamplingContract(style="qwen2_vl"),
    VideoSamplingContract(
        style="qwen2_vl", fps=1.5, min_frames=2, max_frames=64, min_pixels=3136, max_pixels=50176
    ),
    VideoSamplingContract(style="qwen3_vl", min_frames=1, max_frames=2),
    VideoSamplingContract(style="qwen3_vl", fps=29.97, patch_size=16, spatial_merge_size=2),
]


def test_qwen_defaults_are_filled_so_equal_sampling_means_equal_contracts() -> None:
    implicit = VideoSamplingContract(style="qwen3_vl")
    explicit = VideoSamplingContract(
        style="qwen3_vl", fps=QWEN_DEFAULT_FPS, min_frames=QWEN_MIN_FRAMES, max_frames=QWEN_MAX_FRAMES
    )
    assert implicit == explicit
    assert hash(implicit) == hash(explicit)
    assert implicit.canonical_json() == explicit.canonical_json()
    assert implicit.fingerprint() == explicit.fingerprint()


def test_contract_is_frozen() -> None:
    contract = VideoSamplingContract(style="uniform", num_frames=8)
    with pytest.raises(ValidationError, match="frozen"):
        contract.num_frames = 4  # type: ignore[misc]


def test_unknown_key_is_named() -> None:
    with pytest.raises(ValidationError, match="num_frame"):
        VideoSamplingContract.model_validate({"style": "uniform", "num_frame": 8})
    with pytest.raises(ValueError, match="frame_rate"):
        VideoSamplingContract.from_media_io_kwargs({"style": "uniform", "num_frames": 8, "frame_rate": 2})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"style": "qwen2_vl", "num_frames": 16}, "samples by fps"),
        ({"style": "qwen3_vl", "fps": 60.0}, "exceeds 30"),
        ({"style": "qwen2_vl", "max_frames": 1024}, "max_frames=1024 exceeds 768"),
        (
            {"style": "qwen3_vl", "min_frames": 10, "max_frames": 8},
            "min_frames=10 is larger than max_frames=8",
        ),
        ({"style": "qwen2_vl", "min_frames": 1}, "min_frames=1 is below temporal_patch_size=2"),
        ({"style": "qwen2_vl", "aspect_policy": "stretch"}, "always keeps the aspect ratio"),
        ({"style": "nemotron_rounded"}, "needs num_frames"),
        ({"style": "nemotron_rounded", "num_frames": 8, "fps": 2.0}, "takes no fps"),
        ({"style": "uniform", "num_frames": 8, "min_frames": 2}, "min_frames applies to the qwen2_vl"),
        ({"style": "nemotron_rounded", "num_frames": 8, "max_frames": 2}, "max_frames applies"),
        ({"style": "uniform", "min_pixels": 200, "max_pixels": 100}, "min_pixels=200 is larger"),
        ({"style": "uniform", "max_pixels": 100, "target_num_patches": 64}, "not both"),
        ({"style": "uniform", "num_frames": 0}, "greater than 0"),
        ({"style": "uniform", "fps": -2.0}, "greater than 0"),
        ({"style": "uniform", "temporal_patch_size": 0}, "greater than 0"),
        ({"style": "mp4"}, "style"),
        ({"style": "uniform", "num_frames": "8"}, "valid integer"),
    ],
)
def test_inconsistent_combinations_are_rejected(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        VideoSamplingContract.model_validate(fields)


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.canonical_json())
def test_media_io_block_round_trips(contract: VideoSamplingContract) -> None:
    block = contract.to_media_io_kwargs()
    assert block["video_backend"] == VIDEO_LOADER_NAME
    assert block["num_frames"] == (contract.num_frames if contract.num_frames is not None else -1)
    # The block travels as JSON on vLLM's command line.
    block = json.loads(json.dumps(block))
    assert VideoSamplingContract.from_media_io_kwargs(block) == contract
    # What the loader receives: VideoMediaIO pops video_backend and num_frames, and calls
    # load_bytes(data, num_frames=num_frames, **rest).
    rest = dict(block)
    rest.pop("video_backend")
    num_frames = rest.pop("num_frames")
    assert VideoSamplingContract.from_media_io_kwargs({"num_frames": num_frames, **rest}) == contract


def test_media_io_block_leaves_out_unset_fields() -> None:
    block = VideoSamplingContract(style="uniform", num_frames=16).to_media_io_kwargs()
    assert block == {
        "video_backend": VIDEO_LOADER_NAME,
        "style": "uniform",
        "num_frames": 16,
        "temporal_patch_size": 2,
        "aspect_policy": "keep",
    }


def test_vllm_unset_sentinels_mean_none() -> None:
    contract = VideoSamplingContract.from_media_io_kwargs({"style": "uniform", "num_frames": -1, "fps": -1})
    assert contract.num_frames is None and contract.fps is None


def test_other_loader_block_is_refused() -> None:
    with pytest.raises(ValueError, match="'opencv' is not this package's loader"):
        VideoSamplingContract.from_media_io_kwargs({"video_backend": "opencv", "style": "uniform"})


def test_fingerprint_depends_on_every_field() -> None:
    base = VideoSamplingContract(style="uniform", num_frames=8)
    variants = [
        base.model_copy(update={"num_frames": 9}),
        VideoSamplingContract(style="uniform", num_frames=8, fps=2.0),
        VideoSamplingContract(style="uniform", num_frames=8, temporal_patch_size=1),
        VideoSamplingContract(style="uniform", num_frames=8, max_pixels=1000),
        VideoSamplingContract(style="nemotron_rounded", num_frames=8),
    ]
    fingerprints = {base.fingerprint(), *(variant.fingerprint() for variant in variants)}
    assert len(fingerprints) == len(variants) + 1


def test_core_modules_import_without_vllm_or_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None\n"
        "sys.modules['torch'] = None\n"
        "import vllm_video_plugin.contract, vllm_video_plugin.sampling\n"
        "import vllm_video_plugin.decode, vllm_video_plugin.cache, vllm_video_plugin.errors\n"
        "from vllm_video_plugin.contract import VideoSamplingContract\n"
        "from vllm_video_plugin.sampling import sample_frames\n"
        "c = VideoSamplingContract.from_media_io_kwargs({'style': 'qwen2_vl', 'num_frames': -1})\n"
        "print(sample_frames(64, 8.0, 8.0, c).indices[:3])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(0, 4, 8)"


def test_presentation_timestamps_are_an_option_that_leaves_default_contracts_unchanged() -> None:
    nominal = VideoSamplingContract(style="qwen3_vl")
    presentation = VideoSamplingContract(style="qwen3_vl", timestamps="presentation")
    assert "timestamps" not in nominal.to_media_io_kwargs() and "timestamps" not in nominal.canonical_json()
    assert presentation.to_media_io_kwargs()["timestamps"] == "presentation"
    assert VideoSamplingContract.from_media_io_kwargs(presentation.to_media_io_kwargs()) == presentation
    assert presentation.fingerprint() != nominal.fingerprint()
    with pytest.raises(ValidationError, match="'qwen2_vl' \\(Qwen2.5-VL\\) writes none"):
        VideoSamplingContract(style="qwen2_vl", timestamps="presentation")
