"""Media errors name the input, at each layer that knows it.

- ``vllm_video_plugin.inputs``: the one naming rule (a file relative to the media root, a URL, a
  ``data:`` URL by its media type) and the form vLLM's message filter leaves alone;
- ``vllm_video_plugin.connector``: vLLM's media connector in process, as vLLM's chat parser calls
  it (``fetch_video`` / ``fetch_video_async``): a decode failure names the file beside its content
  hash, a missing or unreadable ``file://`` video is a ``ValueError`` (HTTP 400) naming its path;
- ``gym_video_env.request_media.name_media_error``: the Gym model server names the input of vLLM's
  refusal as the request named it.

The live servers (vLLM's real message filter included) are in
``tests/integration/test_reliability_servers.py``; the trainer's masked rows in
``tests/unit/test_bad_inputs.py``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from pathlib import Path
from typing import Any

import pytest

from gym_video_env.hookspecs import MediaSettings
from gym_video_env.request_media import chat_media_urls, name_media_error
from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.errors import MediaInputError, VideoDecodeError
from vllm_video_plugin.inputs import CONNECTOR_NAME, input_name, vllm_message_name

pytestmark = pytest.mark.unit

BLOCK = VideoSamplingContract(style="uniform", num_frames=4).to_media_io_kwargs()


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("clips/a.mp4", "clips/a.mp4"),
        ("file:///root/media/data/clips/a.mp4", "data/clips/a.mp4"),
        ("/root/media/a.mp4", "a.mp4"),
        ("/elsewhere/a.mp4", "/elsewhere/a.mp4"),
        ("file:///elsewhere/a%20b.mp4", "/elsewhere/a b.mp4"),
        ("data:video/mp4;base64,AAAA", "data:video/mp4"),
        ("data:,hello", "data:text/plain"),
        ("https://example.com/v/a.mp4", "https://example.com/v/a.mp4"),
    ],
)
def test_input_name(reference: str, expected: str) -> None:
    assert input_name(reference, media_root="/root/media") == expected


def test_input_name_without_a_media_root() -> None:
    assert input_name("file:///x/a.mp4", media_root=None) == "/x/a.mp4"


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("a.mp4", "a.mp4"),
        ("clips/a.mp4", "clips/a.mp4"),
        ("data/clips/a.mp4", "a.mp4 in data/clips/"),
        ("data:video/mp4", "data:video/mp4"),
        ("/abs/a.mp4", "/abs/a.mp4"),
        ("https://example.com/v/a.mp4", "https://example.com/v/a.mp4"),
    ],
)
def test_vllm_message_name(name: str, shown: str) -> None:
    assert vllm_message_name(name) == shown


# -- vLLM's media connector, in process -----------------------------------------------------------------


@pytest.fixture
def media(tmp_path: Path, sample_video: Path) -> Path:
    """An allowed local media path with a good clip, a CSV named .mp4 two directories deep, a directory
    named .mp4; no ``data/clips/missing.mp4``."""
    root = tmp_path / "allowed"
    (root / "data" / "clips").mkdir(parents=True)
    (root / "clip.mp4").write_bytes(sample_video.read_bytes())
    (root / "data" / "clips" / "table.mp4").write_text("name,answer\nclip-1,A\n" * 20)
    (root / "folder.mp4").mkdir()
    return root


def connector(root: Path) -> Any:
    from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY

    import vllm_video_plugin

    vllm_video_plugin.register()
    return MEDIA_CONNECTOR_REGISTRY.load(
        CONNECTOR_NAME, media_io_kwargs={"video": dict(BLOCK)}, allowed_local_media_path=str(root)
    )


def _refusal(call: Any) -> BaseException:
    try:
        call()
    except Exception as error:
        return error
    raise AssertionError("loaded")


def test_the_connector_loads_as_vllms(media: Path) -> None:
    from vllm_video_plugin import compat

    frames, metadata = compat.fetched_video(connector(media).fetch_video((media / "clip.mp4").as_uri()))
    assert len(frames) == 4 and metadata["video_backend"] == "video_grpo"


def test_a_decode_failure_names_the_file_beside_its_content(media: Path) -> None:
    path = media / "data" / "clips" / "table.mp4"
    error = _refusal(lambda: connector(media).fetch_video(path.as_uri()))
    label = f"<bytes sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}>"
    assert isinstance(error, MediaInputError) and isinstance(error, ValueError)  # vLLM: HTTP 400
    assert str(error).startswith(f"table.mp4 in data/clips/ {label}: not a readable media container")
    assert isinstance(error.__cause__, VideoDecodeError)


@pytest.mark.parametrize(
    ("relative", "reason"),
    [
        ("data/clips/missing.mp4", "missing.mp4 in data/clips/: no such file"),
        ("missing.mp4", "missing.mp4: no such file"),
        ("folder.mp4", "folder.mp4: is a directory, not a media file"),
    ],
)
def test_a_file_url_naming_no_file_is_a_client_error(media: Path, relative: str, reason: str) -> None:
    url = (media / relative).as_uri()
    error = _refusal(lambda: connector(media).fetch_video(url))
    assert isinstance(error, MediaInputError) and str(error) == reason
    assert isinstance(error.__cause__, OSError)  # vLLM's own connector answers this with HTTP 500
    # The server's path: vLLM's chat parser awaits the async fetch.
    error = _refusal(lambda: asyncio.run(connector(media).fetch_video_async(url)))
    assert isinstance(error, MediaInputError) and str(error) == reason


def test_vllms_own_refusals_are_named_too(media: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.mp4"
    outside.write_bytes(b"x")
    error = _refusal(lambda: connector(media).fetch_video(outside.as_uri()))
    assert isinstance(error, MediaInputError)
    assert str(error).startswith(f"{outside}: The file path {outside} must be a subpath")
    data_url = "data:video/mp4;base64," + base64.b64encode(b"not a video at all").decode()
    error = _refusal(lambda: connector(media).fetch_video(data_url))
    assert isinstance(error, MediaInputError) and str(error).startswith("data:video/mp4 <bytes sha256:")


# -- the Gym model server ------------------------------------------------------------------------------------


def test_the_gym_server_names_the_input_of_vllms_refusal(media: Path) -> None:
    settings = MediaSettings(media_root=media)
    bad = media / "data" / "clips" / "table.mp4"
    label = f"<bytes sha256:{hashlib.sha256(bad.read_bytes()).hexdigest()[:16]}>"
    messages = [
        {"role": "system", "content": "Answer."},
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": (media / "clip.mp4").as_uri()}},
                {"type": "text", "text": "and"},
                {"type": "video_url", "video_url": {"url": bad.as_uri()}},
            ],
        },
    ]
    urls = chat_media_urls(messages)
    assert urls == [(media / "clip.mp4").as_uri(), bad.as_uri()]
    # vLLM with its stock connector names the content only: the input is found by its hash.
    stock = f"{label}: not a readable media container"
    assert name_media_error(stock, urls, settings) == f"data/clips/table.mp4 {stock}"
    # This package's connector named it for vLLM's filter, relative to vLLM's allowed path (here a
    # directory above the media root): named as the request named it instead.
    for ours in (f"table.mp4 in media/data/clips/ {stock}", f"table.mp4 {stock}"):
        assert name_media_error(ours, urls, settings) == f"data/clips/table.mp4 {stock}"
    wrapped = f"Failed: {stock}"  # a wrapper of vLLM's own is kept
    assert name_media_error(wrapped, urls, settings) == f"data/clips/table.mp4 {wrapped}"
    # Not a media error, or no input to tell: unchanged.
    for message in ("This model's maximum context length is 32", "<bytes sha256:0123456789abcdef>: x"):
        assert name_media_error(message, urls, settings) == message
    # One media input: it is the one, whatever the label (a data: URL of the same bytes too).
    inline = "data:video/mp4;base64," + base64.b64encode(bad.read_bytes()).decode()
    assert name_media_error(stock, [inline], settings) == f"data:video/mp4 {stock}"


def test_the_servers_this_package_starts_use_the_connector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rl_bridge.services.vllm_server import VLLMServerConfig, server_env

    monkeypatch.delenv("VLLM_MEDIA_CONNECTOR", raising=False)
    log = tmp_path / "log.json"
    assert server_env(VLLMServerConfig(model=tmp_path), logging_config_path=log)["VLLM_MEDIA_CONNECTOR"] == (
        CONNECTOR_NAME
    )
    # Without the plugin there is no such connector; a connector the environment names is kept.
    others = VLLMServerConfig(model=tmp_path, plugins=("another",))
    assert "VLLM_MEDIA_CONNECTOR" not in server_env(others, logging_config_path=log)
    monkeypatch.setenv("VLLM_MEDIA_CONNECTOR", "mine")
    assert "VLLM_MEDIA_CONNECTOR" not in server_env(VLLMServerConfig(model=tmp_path), logging_config_path=log)
