"""The distribution's shape: import boundaries, entry points, console script, lock coverage."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rl_bridge import paths
from rl_bridge.paths import gym_python, project_root

pytestmark = pytest.mark.unit

ROOT = project_root()

# Modules that the trainer, the Gym servers and the sampling code import; none may need vLLM or
# NeMo Gym (nor, for the pure parts, torch).
LIGHT_MODULES = [
    "vllm_video_plugin",
    "gym_video_env",
    "gym_video_env.hookspecs",
    "gym_video_env.plugins",
    "rl_bridge",
    "rl_bridge.cli",
    "rl_bridge.paths",
    "rl_bridge.services",
]


def _run_python(code: str, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, check=False)


def test_light_modules_import_without_vllm_nemo_gym_or_torch() -> None:
    # A None entry in sys.modules makes any import of that name raise ImportError.
    blocked = ["vllm", "nemo_gym", "torch", "transformers", "megatron"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        f"import importlib\nfor m in {LIGHT_MODULES!r}: importlib.import_module(m)\n"
        "print('ok')\n"
    )
    result = _run_python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_vllm_general_plugin_entry_point_is_declared() -> None:
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert eps.get("video_grpo") == "vllm_video_plugin:register"


def test_media_handler_entry_points_resolve() -> None:
    eps = metadata.entry_points(group="gym_video_env.media_handlers")
    names = {ep.name for ep in eps}
    assert {"input_video", "input_image", "tool_output_media"} <= names
    for ep in eps:
        if ep.dist is not None and ep.dist.name == "video-grpo":
            assert ep.load() is not None


def test_console_script_runs() -> None:
    script = Path(sys.executable).parent / "video-grpo"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    for command in ("train", "tiny-model", "make-clips", "serve-vllm", "gym-dataset", "doctor"):
        assert command in result.stdout


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_gym_lock_pins_every_dependency_of_the_gym_role() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["gym"]
    lock = (ROOT / "envs" / "gym" / "requirements.lock").read_text()
    pinned = {m.group(1).lower().replace("_", "-") for m in re.finditer(r"^([A-Za-z0-9_.\-]+)==", lock, re.M)}
    missing = sorted({_requirement_name(r) for r in wanted} - pinned)
    assert not missing, f"envs/gym/requirements.lock lacks {missing}; run `make lock`"


def test_gym_environment_sees_the_package_and_its_entry_points() -> None:
    python = gym_python()
    assert python.exists(), f"{python} missing: run scripts/setup"
    code = (
        "import importlib.metadata as m, nemo_gym, gym_video_env\n"
        "print(sorted(e.name for e in m.entry_points(group='gym_video_env.media_handlers')))\n"
    )
    result = _run_python(code, str(python))
    assert result.returncode == 0, result.stderr
    assert "input_video" in result.stdout


def test_gym_search_roots_are_the_checkout_in_an_editable_install() -> None:
    assert paths.gym_search_roots() == [project_root() / "src"]


@pytest.mark.parametrize("site", ["site-packages", "dist-packages"])
def test_gym_search_roots_are_none_in_a_wheel_install(
    site: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gym would put a root at the front of its sys.path: this environment's site-packages there
    shadows the Gym environment's own packages (its pinned openai), so a wheel install passes none
    and Gym finds the servers where the Gym environment has this package installed."""
    monkeypatch.setattr(paths, "gym_servers_root", lambda: tmp_path / "lib" / "python3.12" / site)
    assert paths.gym_search_roots() == []
