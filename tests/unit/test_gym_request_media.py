"""gym_video_env.request_media: a raw Gym request's media relocated, checked and made canonical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gym_video_env import MediaSettings
from gym_video_env.request_media import (
    MediaRequestError,
    prepare_request_media,
    relocate_tool_outputs,
)
from tests.fixtures.gym_video import count_media_parts

pytestmark = pytest.mark.unit


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "clips").mkdir(parents=True)
    (root / "clips" / "a.mp4").write_bytes(b"\x00" * 100)
    (root / "clips" / "b.mp4").write_bytes(b"\x00" * 100)
    (root / "cat.png").write_bytes(b"\x00" * 54)
    return root


@pytest.fixture
def settings(media_root: Path) -> MediaSettings:
    return MediaSettings(media_root=media_root)


def _uri(media_root: Path, relative: str) -> str:
    return (media_root / relative).resolve().as_uri()


def _tool_output(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": "call_1", "output": list(parts)}


CALL = {"type": "function_call", "call_id": "call_1", "name": "watch_segment", "arguments": '{"segment": 2}'}


def test_sources_become_canonical_file_urls_inside_the_root(
    settings: MediaSettings, media_root: Path
) -> None:
    body = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_video", "path": "clips/a.mp4"},
                    {"type": "input_video", "video_url": "clips/b.mp4"},
                    {"type": "input_image", "image_url": {"url": "cat.png"}},
                    {"type": "input_text", "text": "What happens?"},
                ],
            }
        ],
        "max_output_tokens": 8,
    }
    prepared = prepare_request_media(body, settings)
    assert prepared["max_output_tokens"] == 8
    assert prepared["input"][0]["content"] == [
        {"type": "input_video", "video_url": {"url": _uri(media_root, "clips/a.mp4")}},
        {"type": "input_video", "video_url": {"url": _uri(media_root, "clips/b.mp4")}},
        {"type": "input_image", "image_url": _uri(media_root, "cat.png"), "detail": "auto"},
        {"type": "input_text", "text": "What happens?"},
    ]
    # The caller's body is not modified.
    assert body["input"][0]["content"][0] == {"type": "input_video", "path": "clips/a.mp4"}


def test_tool_output_media_move_into_a_user_message_right_after_it(
    settings: MediaSettings, media_root: Path
) -> None:
    prompt = {"role": "user", "content": "Watch the segments."}
    tool_output = _tool_output(
        {"type": "input_text", "text": "Segment 2 of 2:"}, {"type": "input_video", "video_url": "clips/b.mp4"}
    )
    prepared = prepare_request_media({"input": [prompt, CALL, tool_output]}, settings)
    assert prepared["input"] == [
        prompt,
        CALL,
        {
            "type": "function_call_output",
            "call_id": "call_1",
            "output": [
                {"type": "input_text", "text": "Segment 2 of 2:"},
                {"type": "input_text", "text": "[moved to the next user message: 1 video]"},
            ],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_video", "video_url": {"url": _uri(media_root, "clips/b.mp4")}}],
        },
    ]


def test_reject_policy_names_the_tool_output(settings: MediaSettings) -> None:
    tool_output = _tool_output({"type": "input_video", "video_url": "clips/b.mp4"})
    with pytest.raises(MediaRequestError) as excinfo:
        prepare_request_media({"input": [CALL, tool_output]}, settings, tool_output_media="reject")
    assert excinfo.value.location == "input[1]"
    assert "policy is 'reject'" in excinfo.value.reason


def test_unknown_policy_is_an_error(settings: MediaSettings) -> None:
    with pytest.raises(ValueError, match="tool_output_media must be one of relocate, reject, got 'drop'"):
        prepare_request_media({"input": []}, settings, tool_output_media="drop")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "input_video", "video_url": "../outside.mp4"}, "outside the media root"),
        ({"type": "input_video", "path": "clips/missing.mp4"}, "no such file"),
        ({"type": "input_video", "video_url": "ftp://host/a.mp4"}, "unsupported URL scheme 'ftp'"),
        ({"type": "input_video", "video_url": "http://[::1"}, "not a valid URL (Invalid IPv6 URL)"),
        ({"type": "input_video", "path": "clips/a\x00.mp4"}, "not a usable file path (embedded null byte)"),
        ({"type": ["input_video"]}, "unknown content part type ['input_video']"),
    ],
    ids=["outside_root", "missing", "bad_scheme", "bad_url", "nul_in_path", "unhashable_type"],
)
def test_bad_parts_are_named_by_location(
    part: dict[str, Any], message: str, settings: MediaSettings, media_root: Path
) -> None:
    (media_root.parent / "outside.mp4").write_bytes(b"\x00")
    body = {"input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [part]}]}
    with pytest.raises(MediaRequestError) as excinfo:
        prepare_request_media(body, settings)
    assert excinfo.value.location == "input[1].content[0]"
    assert message in str(excinfo.value)


@pytest.mark.parametrize("role", ["system", "developer", "assistant", ["user"]])
def test_media_outside_user_messages_are_refused(role: Any, settings: MediaSettings) -> None:
    # Gym converts a system message's video to a chat system message that its own chat model
    # then rejects (HTTP 500): the request must fail here, naming the part.
    content = [{"type": "input_text", "text": "Watch:"}, {"type": "input_video", "path": "clips/a.mp4"}]
    with pytest.raises(MediaRequestError) as excinfo:
        prepare_request_media({"input": [{"role": role, "content": content}]}, settings)
    assert excinfo.value.location == "input[0].content[1]"
    assert f"allowed in user messages only, not in a message with role {role!r}" in excinfo.value.reason


def test_relocated_media_are_checked_too(settings: MediaSettings) -> None:
    tool_output = _tool_output({"type": "input_video", "video_url": "../../etc/passwd"})
    with pytest.raises(
        MediaRequestError, match=r"^input\[0\]\(relocated\)\.content\[0\]: .*outside the media"
    ):
        prepare_request_media({"input": [tool_output]}, settings)


def test_size_limits_apply(media_root: Path) -> None:
    body = {"input": [{"role": "user", "content": [{"type": "input_video", "path": "clips/a.mp4"}]}]}
    with pytest.raises(MediaRequestError, match="is 100 bytes, more than the limit of 99 bytes"):
        prepare_request_media(body, MediaSettings(media_root=media_root, max_video_bytes=99))


def test_text_requests_and_assistant_items_pass_unchanged(settings: MediaSettings) -> None:
    assert prepare_request_media({"input": "hello"}, settings) == {"input": "hello"}
    assistant = {"role": "assistant", "content": [{"type": "output_text", "text": "A"}]}
    assert prepare_request_media({"input": [assistant]}, settings)["input"] == [assistant]


def test_relocate_tool_outputs_keeps_other_items(settings: MediaSettings) -> None:
    video = {"type": "input_video", "video_url": "clips/b.mp4"}
    relocated = relocate_tool_outputs([CALL, _tool_output(video)], settings)
    assert [item.get("type") for item in relocated] == ["function_call", "function_call_output", "message"]
    assert relocated[2] == {"type": "message", "role": "user", "content": [video]}


def test_count_media_parts_counts_messages_and_tool_outputs() -> None:
    video = {"type": "input_video", "video_url": "a.mp4"}
    items = [{"role": "user", "content": [video, video]}, _tool_output(video), CALL, "not an item"]
    assert count_media_parts(items, "input_video") == 3
    assert count_media_parts(items, "input_image") == 0
