"""After ``pip install`` of the wheel, ``gym`` finds this package's servers with no path configuration.

Gym searches its install root (the site-packages holding ``nemo_gym``) for server directories in its
namespace packages, so the test installs the project's wheel next to nemo-gym in a fresh venv: uv
builds the wheel and installs both offline (from its cache), and the venv borrows nemo-gym's
dependencies from the Gym environment through a ``.pth`` file. ``gym list`` then runs from a
directory that holds no servers, with no ``NEMO_GYM_EXTRA_ROOTS``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rl_bridge.paths import gym_python, project_root

pytestmark = pytest.mark.integration

SERVERS = {
    "models": ["video_vllm_model"],
    "resources-servers": ["video_mcqa", "video_segments"],
    "agents": ["video_tools_agent"],
}


def _run(argv: list[str], *, cwd: Path, timeout: float = 300) -> str:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("NEMO_GYM_", "PYTHON", "VIRTUAL_ENV"))
    }
    completed = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert completed.returncode == 0, f"{' '.join(argv)} failed:\n{completed.stderr[-3000:]}"
    return completed.stdout


def _uv() -> Path | None:
    """The uv that ``scripts/setup`` pinned (``.cache/bootstrap/bin/uv``), else uv on ``PATH``, else None."""
    pinned = project_root() / ".cache" / "bootstrap" / "bin" / "uv"
    if pinned.is_file():
        return pinned
    found = shutil.which("uv")
    return Path(found) if found else None


@pytest.fixture(scope="module")
def installed_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with nemo-gym 0.7.0 and this project's wheel in one site-packages."""
    uv = _uv()
    assert uv is not None, "uv is needed to build and install the wheel offline; run scripts/setup"
    work = tmp_path_factory.mktemp("gym_wheel_install")
    _run([uv, "build", "--wheel", "--offline", "-o", str(work / "dist"), str(project_root())], cwd=work)
    (wheel,) = (work / "dist").glob("video_grpo-*.whl")
    venv = work / "venv"
    _run([uv, "venv", "--offline", "-q", "--python", str(gym_python()), str(venv)], cwd=work)
    python = venv / "bin" / "python"
    # nemo-gym declares Requires-Python >=3.13.14, which the Gym environment's 3.13.0 does not meet.
    _run(
        [uv, "pip", "install", "-q", "--offline", "--no-deps", "--python", str(python)]
        + ["--python-version", "3.13.14", "nemo-gym==0.7.0", str(wheel)],
        cwd=work,
    )
    site = next((venv / "lib").glob("python3*/site-packages"))
    gym_site = next((gym_python().parent.parent / "lib").glob("python3*/site-packages"))
    (site / "zz_gym_environment_dependencies.pth").write_text(f"{gym_site}\n")
    return venv


@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_gym_lists_the_servers_of_the_installed_wheel(
    installed_venv: Path, kind: str, tmp_path: Path
) -> None:
    listing = _run([str(installed_venv / "bin" / "gym"), "list", kind], cwd=tmp_path)
    for name in SERVERS[kind]:
        assert name in listing, (
            f"`gym list {kind}` does not show {name} after installing the wheel; the wheel must ship "
            f"src/{_namespace(kind)} (see [tool.hatch.build.targets.wheel] packages in pyproject.toml)"
        )


def test_the_gym_environment_alone_does_not_list_them(tmp_path: Path) -> None:
    """Control: the editable install in the Gym environment puts no server directory into site-packages."""
    listing = _run([str(gym_python().parent / "gym"), "list", "models"], cwd=tmp_path)
    assert "vllm_model" in listing and "video_vllm_model" not in listing


def _namespace(kind: str) -> str:
    return {
        "models": "responses_api_models",
        "resources-servers": "resources_servers",
        "agents": "responses_api_agents",
    }[kind]


def test_shipped_configs_resolve_with_gym(tmp_path: Path) -> None:
    src = project_root() / "src"
    configs = [
        src / "responses_api_models/video_vllm_model/configs/video_vllm_model.yaml",
        src / "resources_servers/video_mcqa/configs/video_mcqa.yaml",
        src / "resources_servers/video_segments/configs/video_segments.yaml",
    ]
    argv = [str(gym_python().parent / "gym"), "env", "resolve"]
    for config in configs:
        argv += ["--config", str(config)]
    argv += [f"+video_media_root={tmp_path}", "+policy_base_url=http://127.0.0.1:9/v1"]
    argv += [
        "+policy_api_key=unused",
        "+policy_model_name=policy",
        "+error_on_agent_without_environment_server=true",
    ]
    resolved = _run(argv, cwd=tmp_path)
    for flag in ("media_root", "tool_output_media", "video_sampling_contract", "send_media_io_kwargs"):
        assert f"      {flag}: " in resolved, f"{flag} is missing from the resolved video_vllm_model config"
    assert f"media_root: {tmp_path}" in resolved
    assert "observation_route: /next_segment" in resolved
