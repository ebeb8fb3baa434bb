"""Project-local locations: caches, environments and run directories.

Everything lives under the project root (the checkout), overridable with environment variables,
so a run never writes outside the places a user expects.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "gym_python", "gym_search_roots", "gym_servers_root", "is_site_dir", "project_root"]


def project_root() -> Path:
    """The checkout this package was installed from (editable install), else the working directory."""
    env = os.environ.get("VIDEO_GRPO_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "envs").is_dir():
            return parent
    return Path.cwd()


def cache_dir(*parts: str) -> Path:
    """``$VIDEO_GRPO_CACHE`` or ``<project root>/.cache``, joined with ``parts`` and created."""
    base = Path(os.environ.get("VIDEO_GRPO_CACHE", project_root() / ".cache"))
    path = base.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def gym_servers_root() -> Path:
    """The directory holding this package's Gym server directories (``responses_api_models/``,
    ``responses_api_agents/``, ``resources_servers/``), the root Gym searches for them: the
    checkout's ``src`` in an editable install, the environment's site-packages in a wheel install
    (where a checkout's ``src`` does not exist)."""
    import gym_video_env

    return Path(gym_video_env.__file__).resolve().parent.parent


def is_site_dir(path: Path) -> bool:
    """Whether ``path`` is an environment's package directory (``site-packages``, ``dist-packages``)."""
    return Path(path).name in ("site-packages", "dist-packages")


def gym_search_roots() -> list[Path]:
    """The roots to hand NeMo Gym (``NEMO_GYM_EXTRA_ROOTS``) so it finds this package's servers.

    The checkout's ``src`` in an editable install. None in a wheel install: there the Gym environment
    has this package installed too, and Gym searches the site-packages it is installed in. Gym puts
    its extra roots at the front of ``sys.path``, so this environment's site-packages there would
    shadow the Gym environment's own packages (its pinned openai, for one) with ours.
    """
    root = gym_servers_root()
    return [] if is_site_dir(root) else [root]


def gym_python() -> Path:
    """The Python interpreter of the NeMo Gym environment (``$VIDEO_GRPO_GYM_PYTHON`` overrides)."""
    env = os.environ.get("VIDEO_GRPO_GYM_PYTHON")
    if env:
        return Path(env)
    return project_root() / "envs" / "gym" / ".venv" / "bin" / "python"
