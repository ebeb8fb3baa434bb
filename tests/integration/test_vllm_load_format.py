"""``--load-format video_grpo``: the contract is checked against the checkpoint's vision geometry.

A contract that contradicts the tiny Qwen2.5-VL stops the real server at start-up with a message
naming both values; a matching one serves video (the session's shared ``vllm_plugin_qwen25vl``,
started with the matching contract, which the loader and refit tests use too). The geometry readers
are also checked in process against the tiny checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from rl_bridge.services.process import ServiceError
from rl_bridge.services.vllm_server import VLLMServer, VLLMServerConfig, start_vllm_server
from tests.fixtures.vllm import QWEN25VL_CONTRACT
from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.geometry import (
    CONTRACT_CONFIG_KEY,
    VisionGeometry,
    check_geometry,
    geometry_mismatches,
    read_processor_config,
    vision_geometry,
)
from vllm_video_plugin.model_loader import MODEL_LOADER_NAME

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The tiny Qwen2.5-VL: patch 14, merge 2, temporal 2, video pixels 3136..12544.
MATCHING = QWEN25VL_CONTRACT
assert MATCHING == VideoSamplingContract(
    style="qwen2_vl",
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    min_pixels=3136,
    max_pixels=12544,
)


def geometry_of(model_dir: Path) -> VisionGeometry:
    config = json.loads((model_dir / "config.json").read_text())
    return vision_geometry(config, read_processor_config(model_dir))


def test_geometry_of_the_tiny_checkpoints(
    tiny_qwen25vl: Path, tiny_qwen3vl: Path, tiny_nemotron_vl: Path
) -> None:
    qwen25 = geometry_of(tiny_qwen25vl)
    assert (qwen25.family, qwen25.patch_size, qwen25.spatial_merge_size) == ("qwen", 14, 2)
    assert qwen25.temporal_patch_size == 2
    assert (qwen25.min_pixels, qwen25.max_pixels, qwen25.aspect_policy) == (3136, 12544, "keep")
    assert geometry_mismatches(MATCHING, qwen25) == []
    assert geometry_of(tiny_qwen3vl).patch_size == 16
    nemotron = geometry_of(tiny_nemotron_vl)
    assert (nemotron.family, nemotron.patch_size, nemotron.spatial_merge_size) == ("nemotron", 16, 2)
    assert nemotron.temporal_patch_size == 2
    assert (nemotron.target_num_patches, nemotron.aspect_policy) == (None, "stretch")
    nemotron_contract = VideoSamplingContract(style="nemotron_rounded", num_frames=8, aspect_policy="stretch")
    assert geometry_mismatches(nemotron_contract, nemotron) == []
    assert geometry_mismatches(VideoSamplingContract(style="uniform", num_frames=8), nemotron) == [
        "aspect_policy: contract aspect_policy=keep, "
        "checkpoint vision_config.video_maintain_aspect_ratio=stretch"
    ]


def test_every_contradiction_is_named(tiny_qwen25vl: Path) -> None:
    contract = MATCHING.model_copy(update={"temporal_patch_size": 4, "max_pixels": 50176})
    with pytest.raises(ValueError) as raised:
        check_geometry(contract, geometry_of(tiny_qwen25vl), checkpoint="ckpt")
    message = str(raised.value)
    assert "contract temporal_patch_size=4, checkpoint vision_config.temporal_patch_size=2" in message
    expected = "contract max_pixels=50176, checkpoint video processor size.longest_edge (max_pixels)=12544"
    assert expected in message
    assert message.startswith("the video sampling contract does not match the vision geometry of ckpt")


def config_for(model: Path, media: Path, contract: VideoSamplingContract) -> VLLMServerConfig:
    extra = json.dumps({CONTRACT_CONFIG_KEY: contract.model_dump(mode="json", exclude_none=True)})
    return VLLMServerConfig(
        model=model,
        dtype="float32",
        load_format=MODEL_LOADER_NAME,
        allowed_local_media_path=media,
        extra_args=("--model-loader-extra-config", extra),
        worker_in_engine_process=True,
        startup_timeout_s=600,
    )


def test_contradicting_contract_stops_the_server_at_start_up(
    tiny_qwen25vl: Path, sample_video: Path, tmp_path: Path
) -> None:
    contract = MATCHING.model_copy(update={"patch_size": 16})
    with pytest.raises(ServiceError):
        start_vllm_server(config_for(tiny_qwen25vl, sample_video.parent, contract), log_dir=tmp_path)
    log = (tmp_path / "vllm.log").read_text(errors="replace")
    assert "contract patch_size=16, checkpoint vision_config.patch_size=14" in log, log[-4000:]


def test_matching_contract_serves(
    vllm_plugin_qwen25vl: VLLMServer, tiny_qwen25vl: Path, sample_video: Path
) -> None:
    server = vllm_plugin_qwen25vl  # the session's server started with --load-format video_grpo
    assert server.config.load_format == MODEL_LOADER_NAME
    args = server.config.extra_args
    expected = config_for(tiny_qwen25vl, sample_video.parent, MATCHING).extra_args
    assert json.loads(args[args.index("--model-loader-extra-config") + 1]) == json.loads(expected[1])
    body = {
        "model": server.model_name,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": sample_video.as_uri()}},
                    {"type": "text", "text": "What color is the clip?"},
                ],
            }
        ],
        "max_tokens": 2,
    }
    response = requests.post(f"{server.openai_url}/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 0
    log = server.log_path.read_text(errors="replace")
    assert f"video sampling contract matches the vision geometry of {tiny_qwen25vl}" in log
