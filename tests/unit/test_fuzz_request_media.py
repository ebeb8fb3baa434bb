"""Fuzzing the Responses -> chat media conversion: any request gives a MediaRequestError or a request
with every media part kept (tool-output media relocated), canonical, and converted one to one by
NeMo Gym's own Responses -> chat converter.

The first part runs here (gym_video_env's ``prepare_request_media``). The Gym converter lives in the
Gym environment's Python, so :func:`check_gym_conversion`, a hypothesis property over the same
strategies, runs there: the test starts that interpreter on this very file.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gym_video_env import MediaSettings
from gym_video_env.request_media import MediaRequestError, prepare_request_media
from rl_bridge.paths import cache_dir
from tests.fixtures.gym_video import count_media_parts

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=250, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
MEDIA_TYPES = ("input_video", "input_image")

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=12,
)


def media_root() -> Path:
    """A media root with two clips and an image, created once per interpreter."""
    root = cache_dir("tests", "fuzz_request_media")
    if not (root / "cat.png").is_file():
        (root / "clips").mkdir(parents=True, exist_ok=True)
        (root / "clips" / "a.mp4").write_bytes(b"\x00" * 64)
        (root / "clips" / "b.mp4").write_bytes(b"\x00" * 64)
        (root / "cat.png").write_bytes(b"\x00" * 32)
    return root


SOURCES = st.sampled_from(
    [
        "clips/a.mp4",
        "clips/b.mp4",
        "cat.png",
        "clips/missing.mp4",
        "../outside.mp4",
        "/etc/passwd",
        "file:///etc/passwd",
        "data:video/mp4;base64,AAAA",
        "http://example.com/a.mp4",
        "",
        "ftp://x/y",
    ]
)
HOSTILE_SOURCES = SOURCES | st.just("http://[::1") | st.text(max_size=10)


@st.composite
def media_parts(draw: st.DrawFn, hostile: bool = True) -> dict[str, Any]:
    kind = draw(st.sampled_from(MEDIA_TYPES))
    source = draw(HOSTILE_SOURCES if hostile else SOURCES)
    if kind == "input_video":
        key = draw(st.sampled_from(["video_url", "path", "frames_manifest", "video"]))
        value: Any = {"url": source} if key == "video_url" and draw(st.booleans()) else source
    else:
        key = draw(st.sampled_from(["image_url", "path"]))
        value = {"url": source} if key == "image_url" and draw(st.booleans()) else source
    part: dict[str, Any] = {"type": kind, key: value}
    if hostile and draw(st.integers(0, 5)) == 0:
        part[draw(st.sampled_from(["video_url", "image_url", "detail", "path", "extra"]))] = draw(
            JSON | SOURCES
        )
    return part


TEXT = st.builds(lambda text: {"type": "input_text", "text": text}, st.text(max_size=6))


@st.composite
def items(draw: st.DrawFn, hostile: bool = True) -> Any:
    """A Responses input item; ``hostile`` adds odd roles, part types and values of any JSON type."""
    parts = st.lists(st.one_of(media_parts(hostile), TEXT, *([JSON] if hostile else [])), max_size=4)
    shape = draw(st.sampled_from(["message", "message", "tool", "call", *(["junk"] if hostile else [])]))
    if shape == "message":
        roles = st.sampled_from(["user", "system", "developer"])
        role = draw(roles | JSON if hostile else roles)
        content = draw(parts | st.text(max_size=6) | JSON if hostile else parts | st.text(max_size=6))
        item: dict[str, Any] = {"role": role, "content": content}
        if draw(st.booleans()):
            item["type"] = "message"
        return item
    if shape == "tool":
        return {"type": "function_call_output", "call_id": "c", "output": draw(parts | st.text(max_size=6))}
    if shape == "call":
        return {"type": "function_call", "call_id": "c", "name": "watch", "arguments": "{}"}
    return draw(JSON)


BODIES = st.builds(
    lambda items, extra: {"input": items, **extra},
    st.lists(items(), max_size=4) | st.text(max_size=5) | JSON,
    st.dictionaries(st.sampled_from(["model", "max_output_tokens"]), JSON, max_size=1),
)
GYM_BODIES = st.builds(lambda items: {"input": items}, st.lists(items(hostile=False), min_size=1, max_size=4))


def _media_count(body: dict[str, Any]) -> int:
    items = body.get("input")
    if not isinstance(items, list):
        return 0
    return sum(count_media_parts(items, kind) for kind in MEDIA_TYPES)


def _prepare(body: Any) -> dict[str, Any] | None:
    """The prepared body, or ``None`` after a MediaRequestError naming the part and the reason."""
    try:
        return prepare_request_media(body, MediaSettings(media_root=media_root()))
    except MediaRequestError as error:
        assert error.location.startswith("input[") and error.reason
        return None


@FUZZ
@given(body=BODIES)
@example(body={"input": [{"role": "user", "content": [{"type": ["input_video"]}]}]}).via(
    "unhashable part type"
)
@example(body={"input": [{"role": ["user"], "content": []}]}).via("unhashable role")
@example(
    body={"input": [{"role": "user", "content": [{"type": "input_video", "video_url": "http://[::1"}]}]}
).via("a URL urllib cannot split")
def test_prepared_requests_keep_every_media_part_in_canonical_form(body: dict[str, Any]) -> None:
    prepared = _prepare(body)
    if prepared is None:
        return
    assert _media_count(prepared) == _media_count(body)
    for item in prepared["input"] if isinstance(prepared["input"], list) else []:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "function_call_output" and isinstance(item.get("output"), list):
            assert not any(isinstance(p, dict) and p.get("type") in MEDIA_TYPES for p in item["output"])
        if item.get("role") in ("user", "system", "developer") and isinstance(item.get("content"), list):
            for part in item["content"]:
                if isinstance(part, dict) and part.get("type") == "input_video":
                    assert set(part) == {"type", "video_url"} and isinstance(part["video_url"]["url"], str)
                elif isinstance(part, dict) and part.get("type") == "input_image":
                    assert set(part) == {"type", "image_url", "detail"} and isinstance(part["image_url"], str)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=GYM_BODIES)
# Gym converts a system (or developer) message's video to a chat system message with a video_url
# part, which its own chat request model then rejects (pydantic ValidationError, HTTP 500): media
# must be refused there with a MediaRequestError (HTTP 400), or moved into a user message.
@example(body={"input": [{"role": "system", "content": [{"type": "input_video", "path": "clips/a.mp4"}]}]})
def check_gym_conversion(body: dict[str, Any]) -> None:
    """In the Gym environment: prepared requests that Gym accepts convert to chat messages with one
    ``video_url`` / ``image_url`` part per media part of the request."""
    from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming
    from nemo_gym.responses_converter import ResponsesConverter
    from pydantic import ValidationError

    prepared = _prepare(body)
    if prepared is None:
        return
    try:
        params = NeMoGymResponseCreateParamsNonStreaming.model_validate(prepared)
    except ValidationError:
        return  # Gym answers 422 naming the field: not a media question
    try:
        chat = ResponsesConverter(
            return_token_id_information=False
        ).responses_to_chat_completion_create_params(params)
    except NotImplementedError:
        return  # Gym's documented refusal of content it cannot express in chat (audio, files...)
    messages = chat.model_dump()["messages"] if hasattr(chat, "model_dump") else chat["messages"]
    converted = sum(
        1
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") in ("video_url", "image_url")
    )
    assert converted == _media_count(prepared) == _media_count(body), (prepared, messages)


def test_gym_converts_every_prepared_media_part() -> None:
    from rl_bridge.paths import gym_python

    # The Gym interpreter is another Python: none of this one's environment may leak into it.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('fuzz_request_media', {str(Path(__file__))!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "module.check_gym_conversion()\n"
        "print('gym conversion ok')\n"
    )
    result = subprocess.run(
        [str(gym_python()), "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={"PYTHONPATH": "", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )
    assert result.returncode == 0 and "gym conversion ok" in result.stdout, (
        f"the Gym-side property failed (exit {result.returncode}):\n"
        f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )
