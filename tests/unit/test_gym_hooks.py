"""The media-handler hooks of gym_video_env: specs, entry-point loading, built-in behaviour.

Tests of a hook are named ``test_hook_<hook name>_...``; ``test_every_hook_has_tests`` enforces it.
"""

from __future__ import annotations

import base64
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pluggy
import pytest

from gym_video_env import MediaError, MediaSettings, hookspecs
from gym_video_env.plugins import (
    ENTRY_POINT_GROUP,
    LOAD_PLUGINS_ENV,
    TRACE_HOOKS_ENV,
    PluginLoadError,
    get_plugin_manager,
    reset_plugin_manager,
)

pytestmark = pytest.mark.unit

BUILTIN_PLUGINS = {"input_video", "input_image", "tool_output_media"}


@pytest.fixture(autouse=True)
def _fresh_plugin_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test builds its own manager, from the environment it sets up, and leaves none behind."""
    monkeypatch.delenv(LOAD_PLUGINS_ENV, raising=False)
    monkeypatch.delenv(TRACE_HOOKS_ENV, raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "clips").mkdir(parents=True)
    (root / "clips" / "a.mp4").write_bytes(b"\x00" * 100)
    (root / "frames.json").write_text("{}")
    (root / "cat.png").write_bytes(b"\x89PNG" + b"\x00" * 50)
    return root


@pytest.fixture
def settings(media_root: Path) -> MediaSettings:
    return MediaSettings(media_root=media_root)


@pytest.fixture
def install_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], None]:
    """Install a one-module distribution whose entry point in our group is that module.

    ``importlib.metadata`` finds the ``*.dist-info`` directory on ``sys.path`` exactly as it finds
    an installed wheel, so the plugin goes through the same discovery as a real third party's.
    """
    site = tmp_path / "site"

    def install(module_name: str, source: str) -> None:
        site.mkdir(exist_ok=True)
        (site / f"{module_name}.py").write_text(textwrap.dedent(source))
        dist_info = site / f"{module_name}-0.1.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module_name}\nVersion: 0.1\n")
        (dist_info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{module_name} = {module_name}\n")
        monkeypatch.syspath_prepend(str(site))
        monkeypatch.delitem(sys.modules, module_name, raising=False)
        reset_plugin_manager()

    return install


def _video(**source: Any) -> dict[str, Any]:
    return {"type": "input_video", **source}


def _data_url(payload: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


# --- the plugin manager ---------------------------------------------------------------------------


def test_builtin_handlers_are_registered_through_the_entry_point_group() -> None:
    pm = get_plugin_manager()
    assert BUILTIN_PLUGINS <= {name for name, _ in pm.list_name_plugin()}
    # Registered by the entry-point loader (it records the distribution), not by a direct register().
    distributions = {pm.get_name(plugin): dist.project_name for plugin, dist in pm.list_plugin_distinfo()}
    assert {distributions.get(name) for name in BUILTIN_PLUGINS} == {"video-grpo"}


def _hook_names() -> list[str]:
    """Every hook the specs declare (a manager with the specs only: no plugin is loaded)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return sorted(name for name in dir(pm.hook) if not name.startswith("_"))


@pytest.mark.parametrize("hook_name", _hook_names())
def test_every_hook_has_tests(hook_name: str) -> None:
    tests = [name for name in globals() if name.startswith(f"test_hook_{hook_name}")]
    assert tests, f"Plugin hook is missing tests: {hook_name}"


def test_third_party_handler_takes_precedence_over_builtins(
    install_distribution: Callable[[str, str], None], settings: MediaSettings
) -> None:
    install_distribution(
        "thirdparty_video_handler",
        """
        from gym_video_env import hookimpl

        @hookimpl
        def convert_media_part(part, settings):
            if part.get("type") == "input_video":
                return {"type": "video_url", "video_url": {"url": "thirdparty://clip"}}
            return None
        """,
    )
    pm = get_plugin_manager()
    assert "thirdparty_video_handler" in {name for name, _ in pm.list_name_plugin()}
    converted = pm.hook.convert_media_part(part=_video(path="clips/a.mp4"), settings=settings)
    assert converted == {"type": "video_url", "video_url": {"url": "thirdparty://clip"}}
    # Parts the plugin declines still reach the built-ins.
    image = pm.hook.convert_media_part(part={"type": "input_image", "path": "cat.png"}, settings=settings)
    assert image["image_url"]["url"].endswith("/cat.png")


def test_misspelled_hook_implementation_fails_at_load(
    install_distribution: Callable[[str, str], None],
) -> None:
    install_distribution(
        "misspelled_handler",
        """
        from gym_video_env import hookimpl

        @hookimpl
        def convert_media_prat(part, settings):
            return None
        """,
    )
    with pytest.raises(pluggy.PluginValidationError, match="convert_media_prat"):
        get_plugin_manager()


def test_load_plugins_env_restricts_the_plugins_loaded(
    monkeypatch: pytest.MonkeyPatch, settings: MediaSettings
) -> None:
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "input_image, tool_output_media")
    pm = get_plugin_manager()
    assert {name for name, _ in pm.list_name_plugin()} == {"input_image", "tool_output_media"}
    assert pm.hook.convert_media_part(part=_video(path="clips/a.mp4"), settings=settings) is None


def test_load_plugins_env_with_unknown_name_lists_the_available_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "input_vidoe")
    with pytest.raises(PluginLoadError, match=r"'input_vidoe'.*Available: .*input_video"):
        get_plugin_manager()


def test_trace_hooks_env_prints_each_call(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], settings: MediaSettings
) -> None:
    monkeypatch.setenv(TRACE_HOOKS_ENV, "1")
    get_plugin_manager().hook.convert_media_part(part=_video(path="clips/a.mp4"), settings=settings)
    err = capsys.readouterr().err
    assert "convert_media_part(" in err and "input_video" in err
    assert "returned {'type': 'video_url'" in err


# --- convert_media_part -----------------------------------------------------------------------------


def test_hook_convert_media_part_video_path_becomes_file_url_in_media_root(
    settings: MediaSettings, media_root: Path
) -> None:
    converted = get_plugin_manager().hook.convert_media_part(
        part=_video(path="clips/a.mp4"), settings=settings
    )
    assert converted == {
        "type": "video_url",
        "video_url": {"url": (media_root / "clips" / "a.mp4").resolve().as_uri()},
    }


@pytest.mark.parametrize("key", ["video_url", "video"])
@pytest.mark.parametrize("wrap", [False, True], ids=["string", "url_object"])
def test_hook_convert_media_part_video_urls(
    key: str, wrap: bool, settings: MediaSettings, media_root: Path
) -> None:
    file_url = (media_root / "clips" / "a.mp4").resolve().as_uri()
    data_url = _data_url(b"\x00" * 12)
    hook = get_plugin_manager().hook
    for url in (file_url, data_url):
        part = _video(**{key: {"url": url} if wrap else url})
        assert hook.convert_media_part(part=part, settings=settings) == {
            "type": "video_url",
            "video_url": {"url": url},
        }


def test_hook_convert_media_part_frames_manifest(settings: MediaSettings, media_root: Path) -> None:
    converted = get_plugin_manager().hook.convert_media_part(
        part=_video(frames_manifest="frames.json"), settings=settings
    )
    assert converted == {
        "type": "video_url",
        "video_url": {"url": (media_root / "frames.json").resolve().as_uri()},
    }


def test_hook_convert_media_part_image_keeps_detail(settings: MediaSettings, media_root: Path) -> None:
    part = {"type": "input_image", "image_url": (media_root / "cat.png").as_uri(), "detail": "low"}
    converted = get_plugin_manager().hook.convert_media_part(part=part, settings=settings)
    assert converted == {
        "type": "image_url",
        "image_url": {"url": (media_root / "cat.png").as_uri(), "detail": "low"},
    }


def test_hook_convert_media_part_declines_non_media_parts(settings: MediaSettings) -> None:
    part = {"type": "input_text", "text": "hello"}
    assert get_plugin_manager().hook.convert_media_part(part=part, settings=settings) is None


def test_hook_convert_media_part_remote_urls_need_permission(media_root: Path) -> None:
    part = _video(video_url="https://example.com/a.mp4")
    hook = get_plugin_manager().hook
    with pytest.raises(MediaError, match="remote media URLs are not allowed"):
        hook.convert_media_part(part=part, settings=MediaSettings(media_root=media_root))
    allowed = MediaSettings(media_root=media_root, allow_remote_urls=True)
    assert (
        hook.convert_media_part(part=part, settings=allowed)["video_url"]["url"]
        == "https://example.com/a.mp4"
    )


def test_hook_convert_media_part_path_outside_media_root_is_rejected(settings: MediaSettings) -> None:
    with pytest.raises(MediaError) as excinfo:
        get_plugin_manager().hook.convert_media_part(part=_video(path="../secret.mp4"), settings=settings)
    assert excinfo.value.source == "../secret.mp4"
    assert "outside the media root" in excinfo.value.reason


# --- validate_media ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        {"path": "../outside.mp4"},
        {"path": "clips/../../outside.mp4"},
        {"path": "/etc/passwd"},
        {"video_url": "file:///etc/passwd"},
        {"frames_manifest": "../outside.json"},
    ],
    ids=["dotdot", "nested_dotdot", "absolute", "file_url", "manifest"],
)
def test_hook_validate_media_path_escape_names_path_and_reason(
    source: dict[str, str], settings: MediaSettings, media_root: Path
) -> None:
    (media_root.parent / "outside.mp4").write_bytes(b"\x00")
    (media_root.parent / "outside.json").write_text("{}")
    with pytest.raises(MediaError) as excinfo:
        get_plugin_manager().hook.validate_media(part=_video(**source), settings=settings)
    written = next(iter(source.values()))
    assert excinfo.value.source == written.removeprefix("file://")
    assert f"outside the media root {media_root.resolve()}" in str(excinfo.value)


def test_hook_validate_media_symlink_out_of_media_root_is_rejected(
    settings: MediaSettings, media_root: Path
) -> None:
    target = media_root.parent / "outside.mp4"
    target.write_bytes(b"\x00")
    (media_root / "link.mp4").symlink_to(target)
    with pytest.raises(MediaError, match=rf"link\.mp4: resolves to {target.resolve()}, which is outside"):
        get_plugin_manager().hook.validate_media(part=_video(path="link.mp4"), settings=settings)


def test_hook_validate_media_accepts_files_inside_the_root(settings: MediaSettings, media_root: Path) -> None:
    hook = get_plugin_manager().hook
    assert hook.validate_media(part=_video(path="clips/a.mp4"), settings=settings) == []
    absolute = _video(video_url=(media_root / "clips" / "a.mp4").as_uri())
    assert hook.validate_media(part=absolute, settings=settings) == []


def test_hook_validate_media_missing_file_and_missing_root(settings: MediaSettings) -> None:
    hook = get_plugin_manager().hook
    with pytest.raises(MediaError, match=r"^clips/b\.mp4: no such file"):
        hook.validate_media(part=_video(path="clips/b.mp4"), settings=settings)
    with pytest.raises(MediaError, match="no media root is configured"):
        hook.validate_media(part=_video(path="clips/a.mp4"), settings=MediaSettings())


def test_hook_validate_media_size_limits(media_root: Path) -> None:
    hook = get_plugin_manager().hook
    limits = MediaSettings(media_root=media_root, max_video_bytes=99, max_image_bytes=10)
    with pytest.raises(MediaError, match="is 100 bytes, more than the limit of 99 bytes"):
        hook.validate_media(part=_video(path="clips/a.mp4"), settings=limits)
    with pytest.raises(MediaError, match="is 100 bytes, more than the limit of 99 bytes"):
        hook.validate_media(part=_video(video_url=_data_url(b"\x00" * 100)), settings=limits)
    assert hook.validate_media(part=_video(video_url=_data_url(b"\x00" * 99)), settings=limits) == []
    with pytest.raises(MediaError, match="is 54 bytes, more than the limit of 10 bytes"):
        hook.validate_media(part={"type": "input_image", "path": "cat.png"}, settings=limits)
    # A manifest's size says nothing about the video it describes.
    assert hook.validate_media(part=_video(frames_manifest="frames.json"), settings=limits) == []


@pytest.mark.parametrize("n", range(1, 7))
def test_hook_validate_media_data_url_size_matches_decoded_size(n: int) -> None:
    hook = get_plugin_manager().hook
    at_limit = MediaSettings(max_video_bytes=n)
    below_limit = MediaSettings(max_video_bytes=n - 1)
    part = _video(video_url=_data_url(os.urandom(n)))
    assert hook.validate_media(part=part, settings=at_limit) == []
    with pytest.raises(MediaError, match=f"is {n} bytes"):
        hook.validate_media(part=part, settings=below_limit)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (_video(), "input_video: needs exactly one of path, frames_manifest, video_url, video, got none"),
        (_video(path="a.mp4", video_url="file:///a.mp4"), "got ['path', 'video_url']"),
        (_video(video_url=""), "input_video.video_url: must be a non-empty string"),
        (_video(video_url="ftp://host/a.mp4"), "unsupported URL scheme 'ftp'"),
        (_video(video_url="file://otherhost/a.mp4"), "not host 'otherhost'"),
        (_video(video_url="data:video/mp4;base64,abc"), "not a multiple of 4"),
    ],
    ids=["no_source", "two_sources", "empty_url", "ftp", "remote_file_url", "bad_base64"],
)
def test_hook_validate_media_malformed_parts(
    part: dict[str, Any], message: str, settings: MediaSettings
) -> None:
    with pytest.raises(MediaError) as excinfo:
        get_plugin_manager().hook.validate_media(part=part, settings=settings)
    assert message in str(excinfo.value)


# --- relocate_tool_output_media ---------------------------------------------------------------------


def test_hook_relocate_tool_output_media_moves_media_to_a_following_user_message(
    settings: MediaSettings,
) -> None:
    video = _video(path="clips/a.mp4")
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    item = {
        "type": "function_call_output",
        "call_id": "call_1",
        "output": [
            {"type": "input_text", "text": "clip 2:"},
            video,
            image,
            _video(video_url="file:///b.mp4"),
        ],
    }
    relocated = get_plugin_manager().hook.relocate_tool_output_media(item=item, settings=settings)
    assert relocated == [
        {
            "type": "function_call_output",
            "call_id": "call_1",
            "output": [
                {"type": "input_text", "text": "clip 2:"},
                {"type": "input_text", "text": "[moved to the next user message: 2 videos and 1 image]"},
            ],
        },
        {"type": "message", "role": "user", "content": [video, image, _video(video_url="file:///b.mp4")]},
    ]


@pytest.mark.parametrize(
    "item",
    [
        {"type": "function_call_output", "call_id": "c", "output": "plain text"},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "t"}]},
        {"type": "message", "role": "user", "content": [_video(path="clips/a.mp4")]},
    ],
    ids=["string_output", "text_only_output", "user_message"],
)
def test_hook_relocate_tool_output_media_keeps_items_without_tool_media(
    item: dict[str, Any], settings: MediaSettings
) -> None:
    assert get_plugin_manager().hook.relocate_tool_output_media(item=item, settings=settings) is None
