"""Policy-side processors against the real HF processors and vLLM's own Nemotron processing.

- Qwen2.5-VL and Qwen3-VL: the tensors for a video equal the checkpoint's full HF processor, both
  on the same pre-sampled frames and when the HF processor samples every decoded frame itself
  (so the frames come out the same too); placeholder runs equal the HF prompt's.
- Nemotron Nano VL: frames equal vLLM's ``NanoNemotronVLProcessor`` (imported in-process from the
  installed vLLM) bit for bit, in vLLM's dtype, for several patch budgets and aspect policies, and
  placeholder runs equal the ``<image>`` runs of vLLM's expanded prompt.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_bridge.media_batch import placeholder_runs
from rl_bridge.processors import load_processor
from rl_bridge.processors.nemotron import NemotronVLProcessor, video_frame_size
from rl_bridge.processors.qwen import QwenVLProcessor, qwen_contract
from tests.fixtures.media import MakeVideo
from vllm_video_plugin.cache import DecodeCache
from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.decode import decode_frames

pytestmark = pytest.mark.integration


def _all_frames(path: Path) -> tuple[np.ndarray, float]:
    batch = decode_frames(path, range(decode_frames(path, [0]).source.num_frames))
    return np.array(batch.data), batch.source.fps


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_video_tensors_equal_the_hf_processor(
    family: str, tiny_qwen25vl: Path, tiny_qwen3vl: Path, make_video: MakeVideo
) -> None:
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    model_dir = tiny_qwen25vl if family == "qwen2_5_vl" else tiny_qwen3vl
    processor = load_processor(model_dir)
    assert isinstance(processor, QwenVLProcessor) and processor.family == family
    assert processor.contract == qwen_contract(model_dir)
    hf = AutoProcessor.from_pretrained(model_dir)
    video = make_video(num_frames=20, width=96, height=64, fps=8)
    batch = DecodeCache().get_or_decode(video.read_bytes(), processor.contract)
    assert batch.sample is not None
    ours = processor.process_video(batch.data, batch.sample)

    # The same frames through the full HF processor.
    metadata = VideoMetadata(
        total_num_frames=batch.sample.total_frames,
        fps=batch.sample.source_fps,
        frames_indices=list(batch.indices),
    )
    same_frames = hf(
        text=[hf.video_token],
        videos=[np.array(batch.data)],
        video_metadata=[metadata],
        do_sample_frames=False,
        return_tensors="pt",
    )
    # Every decoded frame, sampled by the HF processor itself (as vLLM's loader samples).
    frames, fps = _all_frames(video)
    all_metadata = VideoMetadata(
        total_num_frames=len(frames), fps=fps, frames_indices=list(range(len(frames)))
    )
    self_sampled = hf(
        text=[hf.video_token],
        videos=[frames],
        video_metadata=[all_metadata],
        do_sample_frames=True,
        return_tensors="pt",
    )
    for reference in (same_frames, self_sampled):
        assert torch.equal(ours.tensors["pixel_values_videos"], reference["pixel_values_videos"])
        assert torch.equal(ours.tensors["video_grid_thw"], reference["video_grid_thw"])
        if family == "qwen2_5_vl":
            expected = torch.as_tensor(reference["second_per_grid_ts"], dtype=torch.float32)
            assert torch.equal(ours.tensors["second_per_grid_ts"], expected)
        else:
            assert "second_per_grid_ts" not in ours.tensors
        runs = placeholder_runs(reference["input_ids"][0].tolist(), processor.placeholder_token_ids)
        assert runs == [(processor.video_token_id, n) for n in ours.placeholder_runs]
    assert len(ours.placeholder_runs) == (
        1 if family == "qwen2_5_vl" else int(ours.tensors["video_grid_thw"][0, 0])
    )


def test_qwen_image_tensors_equal_the_hf_processor(tiny_qwen25vl: Path) -> None:
    from transformers import AutoProcessor

    processor = load_processor(tiny_qwen25vl)
    hf = AutoProcessor.from_pretrained(tiny_qwen25vl)
    image = np.random.default_rng(0).integers(0, 256, (45, 70, 3), dtype=np.uint8)
    ours = processor.process_image(image, source="test image")
    reference = hf(text=[hf.image_token], images=[image], return_tensors="pt")
    assert torch.equal(ours.tensors["pixel_values"], reference["pixel_values"])
    assert torch.equal(ours.tensors["image_grid_thw"], reference["image_grid_thw"])
    assert placeholder_runs(reference["input_ids"][0].tolist(), processor.placeholder_token_ids) == [
        (processor.image_token_id, ours.num_placeholders)
    ]


def test_a_contract_that_contradicts_the_checkpoint_is_refused(tiny_qwen25vl: Path) -> None:
    wrong = qwen_contract(tiny_qwen25vl).model_copy(update={"temporal_patch_size": 4})
    with pytest.raises(ValueError, match="temporal_patch_size: contract temporal_patch_size=4"):
        QwenVLProcessor(tiny_qwen25vl, wrong)


# -- Nemotron -----------------------------------------------------------------------------------------


def _nemotron_contract(keep_aspect: bool) -> VideoSamplingContract:
    """An odd frame count (the last tubelet holds one frame); the checkpoint's aspect policy."""
    return VideoSamplingContract(
        style="uniform", num_frames=5, aspect_policy="keep" if keep_aspect else "stretch"
    )


def _nemotron_checkpoint(base: Path, directory: Path, vision: dict[str, Any]) -> Path:
    """A copy of the tiny Nemotron checkpoint's files with ``vision`` merged into its vision config."""
    directory.mkdir()
    for path in base.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    config = json.loads((base / "config.json").read_text())
    config["vision_config"].update(vision)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _vllm_nemotron(model_dir: Path) -> Any:
    from transformers import AutoConfig, AutoTokenizer
    from vllm.transformers_utils.processors.nano_nemotron_vl import NanoNemotronVLProcessor

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    return NanoNemotronVLProcessor(config, tokenizer, max_model_len=4096, video_token="<video>")


@pytest.mark.parametrize(
    "vision",
    [
        {},  # no patch budget: force_image_size squared
        {"video_target_num_patches": 96, "video_maintain_aspect_ratio": True},
        {"video_target_num_patches": 70, "video_maintain_aspect_ratio": False},
    ],
    ids=["force_image_size", "budget_keep_aspect", "budget_square"],
)
def test_nemotron_frames_equal_vllm_bit_for_bit(
    vision: dict[str, Any], tiny_nemotron_vl: Path, make_video: MakeVideo, tmp_path: Path
) -> None:
    model_dir = _nemotron_checkpoint(tiny_nemotron_vl, tmp_path / "ckpt", vision)
    contract = _nemotron_contract(vision.get("video_maintain_aspect_ratio", False))
    processor = load_processor(model_dir, contract)
    assert isinstance(processor, NemotronVLProcessor)
    video = make_video(num_frames=12, width=160, height=90, fps=8)
    batch = DecodeCache().get_or_decode(video.read_bytes(), contract)
    assert batch.sample is not None
    ours = processor.process_video(batch.data, batch.sample)

    vllm_processor = _vllm_nemotron(model_dir)
    metadata = {"fps": batch.sample.source_fps, "frames_indices": list(batch.indices)}
    reference = vllm_processor(
        text=["<video>"], videos=[(np.asarray(batch.data), metadata)], return_tensors="pt"
    )
    pixels = reference["pixel_values_flat_video"]
    assert ours.tensors["pixel_values"].dtype == pixels.dtype == vllm_processor.dtype
    assert ours.tensors["pixel_values"].shape == pixels.shape
    assert torch.equal(ours.tensors["pixel_values"], pixels)  # bit for bit
    count, _, height, width = pixels.shape
    assert ours.tensors["imgs_sizes"].tolist() == [[height, width]] * count
    assert ours.tensors["num_frames"].tolist() == [count] == [len(batch.indices)]
    runs = placeholder_runs(reference["input_ids"][0].tolist(), processor.placeholder_token_ids)
    assert runs == [(processor.image_token_id, n) for n in ours.placeholder_runs]
    assert len(runs) == math.ceil(count / 2)  # tubelets of 2 frames, the last one short


def test_nemotron_needs_a_contract_and_takes_no_images(tiny_nemotron_vl: Path) -> None:
    with pytest.raises(ValueError, match="needs the video sampling contract"):
        load_processor(tiny_nemotron_vl)
    processor = load_processor(tiny_nemotron_vl, _nemotron_contract(False))
    from rl_bridge.processors import MediaProcessingError

    with pytest.raises(MediaProcessingError, match="images are not supported"):
        processor.process_image(np.zeros((8, 8, 3), np.uint8), source="img")


@settings(max_examples=300, deadline=None)
@given(
    width=st.integers(1, 4000),
    height=st.integers(1, 4000),
    target=st.integers(1, 4096),
    keep=st.booleans(),
    patch=st.sampled_from([14, 16]),
    ratio=st.sampled_from([0.5, 0.25, 1.0]),
)
def test_nemotron_frame_size_equals_vllm(
    width: int, height: int, target: int, keep: bool, patch: int, ratio: float
) -> None:
    from vllm.transformers_utils.processors.nano_nemotron_vl import get_video_target_size_and_feature_size

    expected = get_video_target_size_and_feature_size(width, height, target, keep, patch, ratio)[:2]
    ours = video_frame_size(
        width, height, target_num_patches=target, keep_aspect=keep, patch_size=patch, downsample_ratio=ratio
    )
    assert ours == expected
