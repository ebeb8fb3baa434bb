"""Real NeMo Gym servers started by rl_bridge.services.gym_server answer on loopback.

The stock ``example_single_tool_call`` resources server scores rows that carry video; a row whose
trajectory had video in a tool output is accepted once our tool-output handler moved the video.
The stock ``vllm_model`` model server sends a video prompt to the real vLLM server and returns
vLLM's token ids.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import requests

from gym_video_env import MediaSettings, get_plugin_manager
from rl_bridge.paths import gym_python, project_root
from rl_bridge.services.gym_server import (
    GymServers,
    GymServerSpec,
    resolve_gym_config,
    start_gym_servers,
    video_model_server_spec,
)
from rl_bridge.services.process import ServiceError
from tests.fixtures.gym import STOCK_MODEL_SERVER, STOCK_RESOURCES_SERVER

pytestmark = pytest.mark.integration

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def _video_row(video: Path) -> dict[str, Any]:
    """A task row whose prompt carries a local video, as Gym datasets hold them."""
    return {
        "responses_create_params": {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Where is this filmed? Check the weather there."},
                        {"type": "input_video", "video_url": video.as_uri()},
                    ],
                }
            ],
            "tools": [WEATHER_TOOL],
        }
    }


def _response(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A minimal Responses-API response with the given output items."""
    return {
        "id": "resp_test",
        "created_at": 0,
        "model": "policy",
        "object": "response",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


WEATHER_CALL = {
    "type": "function_call",
    "id": "fc_1",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
    "status": "completed",
}


def _post(servers: GymServers, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{servers.url(STOCK_RESOURCES_SERVER)}{path}", json=body, timeout=60)


def test_stock_resources_server_tool_route(gym_stock_resources_server: GymServers) -> None:
    response = _post(gym_stock_resources_server, "/get_weather", {"city": "Oslo"})
    assert response.status_code == 200, response.text
    assert response.json() == {"city": "Oslo", "weather_description": "The weather in Oslo is cold."}


def test_stock_resources_server_verifies_a_row_with_video(
    gym_stock_resources_server: GymServers, sample_video: Path
) -> None:
    row = _video_row(sample_video)
    called = _post(gym_stock_resources_server, "/verify", {**row, "response": _response([WEATHER_CALL])})
    assert called.status_code == 200, called.text
    assert called.json()["reward"] == 1.0
    # Gym kept the video part of the prompt as it was sent.
    echoed_content = called.json()["responses_create_params"]["input"][0]["content"]
    assert {"type": "input_video", "video_url": sample_video.as_uri()} in echoed_content

    answer = {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Paris.", "annotations": []}],
    }
    not_called = _post(gym_stock_resources_server, "/verify", {**row, "response": _response([answer])})
    assert not_called.status_code == 200, not_called.text
    assert not_called.json()["reward"] == 0.0


def test_video_moved_out_of_a_tool_output_is_accepted_by_gym(
    gym_stock_resources_server: GymServers, sample_video: Path
) -> None:
    tool_output = {
        "type": "function_call_output",
        "call_id": "call_1",
        "output": [
            {"type": "input_text", "text": "Here is the next clip."},
            {"type": "input_video", "video_url": sample_video.as_uri()},
        ],
    }
    row = _video_row(sample_video)
    rejected = _post(
        gym_stock_resources_server, "/verify", {**row, "response": _response([WEATHER_CALL, tool_output])}
    )
    assert rejected.status_code == 422, (
        "Gym 0.7 accepts video in tool outputs now: the relocation may be unneeded"
    )

    settings = MediaSettings(media_root=sample_video.parent)
    relocated = get_plugin_manager().hook.relocate_tool_output_media(item=tool_output, settings=settings)
    accepted = _post(
        gym_stock_resources_server, "/verify", {**row, "response": _response([WEATHER_CALL, *relocated])}
    )
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["reward"] == 1.0
    output = accepted.json()["response"]["output"]
    assert [item["type"] for item in output] == ["function_call", "function_call_output", "message"]
    assert output[2]["role"] == "user"
    assert output[2]["content"] == [{"type": "input_video", "video_url": sample_video.as_uri()}]


def test_gym_client_finds_servers_by_name_through_the_head_server(
    gym_stock_resources_server: GymServers,
) -> None:
    """A Gym client that is not a server (as ``gym eval run --no-serve``) reads the head server's config."""
    head = gym_stock_resources_server.config.resolved["head_server"]
    script = textwrap.dedent(
        f"""
        import asyncio
        from nemo_gym.config_types import BaseServerConfig
        from nemo_gym.server_utils import setup_server_client

        async def main():
            client = setup_server_client(BaseServerConfig(host={head["host"]!r}, port={head["port"]}))
            response = await client.post(server_name={STOCK_RESOURCES_SERVER!r}, url_path="/get_weather",
                                         json={{"city": "Lima"}})
            print(await response.text())

        asyncio.run(main())
        """
    )
    completed = subprocess.run(
        [str(gym_python()), "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert completed.returncode == 0, completed.stderr
    assert '"weather_description":"The weather in Lima is cold."' in completed.stdout


def test_resolution_reports_gym_config_errors(tmp_path: Path) -> None:
    agent = GymServerSpec(
        "agent",
        "responses_api_agents",
        "simple_agent",
        {
            "resources_server": {"type": "resources_servers", "name": "missing_resources"},
            "model_server": {"type": "responses_api_models", "name": "missing_model"},
        },
    )
    with pytest.raises(ServiceError, match="references resources_servers/'missing_resources'"):
        resolve_gym_config([agent], run_dir=tmp_path)


def test_a_site_packages_search_root_is_refused(tmp_path: Path) -> None:
    """Gym puts its search roots at the front of sys.path; another environment's packages there
    would replace the Gym environment's own (its openai, pydantic, ...)."""
    spec = video_model_server_spec(
        "video_model", openai_url="http://127.0.0.1:9/v1", model="policy", media_root=tmp_path
    )
    site = tmp_path / "venv" / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True)
    with pytest.raises(ValueError, match=r"must not be an environment's packages \(.*site-packages\)"):
        resolve_gym_config([spec], run_dir=tmp_path / "gym", extra_roots=[site])


def test_a_video_model_server_with_an_unknown_media_handler_fails_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The media handlers are loaded when the server starts, not at its first request."""
    monkeypatch.setenv("GYM_VIDEO_ENV_LOAD_PLUGINS", "no_such_handler")
    spec = video_model_server_spec(
        "video_model", openai_url="http://127.0.0.1:9/v1", model="policy", media_root=tmp_path
    )
    with pytest.raises(ServiceError, match="GYM_VIDEO_ENV_LOAD_PLUGINS names 'no_such_handler'"):
        with start_gym_servers([spec], run_dir=tmp_path / "gym", extra_roots=[project_root() / "src"]):
            pass


def test_a_video_model_server_refuses_a_coalescing_cap_below_its_window(tmp_path: Path) -> None:
    spec = video_model_server_spec(
        "video_model",
        openai_url="http://127.0.0.1:9/v1",
        model="policy",
        media_root=tmp_path,
        coalesce_window_ms=100,
        coalesce_max_wait_ms=50,
    )
    with pytest.raises(ServiceError, match="coalesce_max_wait_ms=50 needs coalesce_window_ms above 0"):
        with start_gym_servers([spec], run_dir=tmp_path / "gym", extra_roots=[project_root() / "src"]):
            pass


def test_resolution_fills_in_gym_defaults_and_binds_loopback(tmp_path: Path) -> None:
    spec = GymServerSpec("weather", "resources_servers", "example_single_tool_call", {"domain": "agent"})
    config = resolve_gym_config([spec], run_dir=tmp_path)
    assert config.resolved["dry_run"] is False
    assert config.resolved["head_server"]["host"] == "127.0.0.1"
    assert config.server_fields("weather")["host"] == "127.0.0.1"
    assert config.url("weather").startswith("http://127.0.0.1:")
    assert (config.server_dirs["weather"] / "app.py").is_file()
    assert config.server_dirs["weather"].parts[-2:] == ("resources_servers", "example_single_tool_call")


def test_stock_model_server_generates_for_a_video_prompt_with_token_ids(
    gym_stock_model_server: GymServers, sample_video: Path, tiny_qwen25vl: Path
) -> None:
    body = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What happens in this video?"},
                    {"type": "input_video", "video_url": sample_video.as_uri()},
                ],
            }
        ],
        "max_output_tokens": 8,
        "temperature": 0.0,
    }
    response = requests.post(
        f"{gym_stock_model_server.url(STOCK_MODEL_SERVER)}/v1/responses", json=body, timeout=300
    )
    assert response.status_code == 200, response.text
    (message,) = [item for item in response.json()["output"] if item["type"] == "message"]
    assert message["role"] == "assistant"
    assert [part["type"] for part in message["content"]] == ["output_text"]
    assert isinstance(message["content"][0]["text"], str)
    # The training fields that return_token_id_information adds, from vLLM's own token ids.
    # The video reached vLLM: its placeholder tokens are in the prompt vLLM tokenized.
    video_token_id = json.loads((tiny_qwen25vl / "config.json").read_text())["video_token_id"]
    assert message["prompt_token_ids"].count(video_token_id) > 0
    assert 0 < len(message["generation_token_ids"]) <= 8
    assert len(message["generation_log_probs"]) == len(message["generation_token_ids"])


def test_doctor_resolves_the_video_model_server_as_the_trainer_hands_it_to_gym() -> None:
    from rl_bridge import doctor

    check = doctor._run("gym config", doctor._gym_config)
    assert check.ok, check.detail
    assert check.detail.endswith("responses_api_models/video_vllm_model")


def test_doctor_fails_on_a_search_root_that_would_shadow_the_gym_environments_packages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sysconfig

    from rl_bridge import doctor, paths

    monkeypatch.setattr(paths, "gym_search_roots", lambda: [Path(sysconfig.get_paths()["purelib"])])
    check = doctor._run("gym config", doctor._gym_config)
    assert not check.ok and "must not be an environment's packages" in check.detail
