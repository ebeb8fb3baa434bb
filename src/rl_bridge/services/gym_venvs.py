"""Point Gym's per-server venvs at an existing environment, so ``gym env start`` installs nothing.

``gym env start`` runs every server with the interpreter of its own venv,
``<uv_venv_dir>/<server type>/<server name>/.venv/bin/python``, and builds that venv with ``uv``
from the server's ``requirements.txt`` unless ``skip_venv_if_present`` is set and the venv already
exists. This package's servers need the ``video-grpo`` distribution, which their
``requirements.txt`` does not name (that name on the package index is not this project's), so Gym
must reuse an environment that has it installed: the Gym environment ``envs/gym/.venv`` of a
checkout, or the user's own venv with ``pip install video-grpo[gym]`` from a wheel of this project.

:func:`link_server_venvs` writes ``<dest>/<type>/<name>/.venv`` as a symlink to that environment
for each server directory a video setup runs; then::

    gym env start ... +skip_venv_if_present=true +uv_venv_dir=<dest>

starts every server from it, with no ``uv`` and no package index. ``video-grpo gym-venvs DEST``
is the command-line form.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from rl_bridge.paths import gym_python, gym_servers_root
from rl_bridge.services.gym_server import SERVER_TYPES

__all__ = ["DEFAULT_STOCK_SERVERS", "link_server_venvs"]

#: Gym's built-in servers a video setup runs next to this package's: the stock agent paired with
#: ``video_mcqa``, the stock model server and the environment servers rollout collection goes through.
DEFAULT_STOCK_SERVERS = (
    "responses_api_agents/simple_agent",
    "responses_api_models/vllm_model",
    "environment_servers/legacy_agent",
    "environment_servers/single_agent_turn",
    "environment_servers/single_agent_turn_legacy",
)


def _venv_site_packages(venv: Path) -> Path:
    """The ``site-packages`` directory of ``venv``.

    Raises:
        FileNotFoundError: ``venv`` has no ``bin/python`` or no ``lib/python3*/site-packages``.
    """
    if not (venv / "bin" / "python").exists():
        raise FileNotFoundError(f"{venv} is not a venv: it has no bin/python")
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    if not found:
        raise FileNotFoundError(f"{venv} is not a venv: it has no lib/python3*/site-packages")
    return found[0]


def _server_dirs(root: Path) -> list[Path]:
    """Every server directory under Gym root ``root`` (``<type>/<name>`` with a ``requirements.txt``
    or ``pyproject.toml``, as Gym counts them), sorted."""
    found: list[Path] = []
    for server_type in SERVER_TYPES:
        base = root / server_type
        if not base.is_dir():
            continue
        for candidate in sorted(base.iterdir()):
            if (candidate / "requirements.txt").is_file() or (candidate / "pyproject.toml").is_file():
                found.append(candidate)
    return found


def link_server_venvs(
    dest: Path,
    *,
    venv: Path | None = None,
    search_dirs: Iterable[Path] = (),
    stock_servers: Sequence[str] = DEFAULT_STOCK_SERVERS,
) -> list[Path]:
    """Write ``<dest>/<type>/<name>/.venv -> venv`` for the servers of a video setup; returns the links.

    Linked: every server directory of this package (``<checkout>/src`` when run from a checkout,
    and the ones a wheel put into ``venv``'s site-packages), every server directory under each of
    ``search_dirs`` (Gym roots of your own servers, as passed to ``gym --search-dir``), and the
    built-in ``stock_servers`` (``type/name``) found in ``venv``. An existing link is replaced;
    anything else in the way is an error.

    Args:
        dest: What to pass Gym as ``uv_venv_dir``; created if missing.
        venv: The environment every server runs in (it must have nemo-gym and this package);
            ``None``: the Gym environment of this checkout (the one :func:`~rl_bridge.paths.gym_python`
            names).

    Raises:
        FileNotFoundError: ``venv`` is not a venv, a search dir does not exist, or a stock server
            is not in ``venv``.
        FileExistsError: a ``.venv`` in ``dest`` exists and is not a symlink.
    """
    venv = (venv if venv is not None else gym_python().parent.parent).absolute()
    site = _venv_site_packages(venv)
    names: dict[str, Path] = {}
    ours = gym_servers_root()  # the checkout's src, or where the package is installed
    roots = [ours] + ([site] if site != ours else [])
    for root in roots:
        for directory in _server_dirs(root):
            if root == site and not _is_this_package(directory):
                continue
            names.setdefault(f"{directory.parent.name}/{directory.name}", directory)
    for search_dir in search_dirs:
        if not Path(search_dir).is_dir():
            raise FileNotFoundError(f"search dir {search_dir} does not exist")
        for directory in _server_dirs(Path(search_dir)):
            names.setdefault(f"{directory.parent.name}/{directory.name}", directory)
    for stock in stock_servers:
        if not ((site / stock / "requirements.txt").is_file() or (site / stock / "pyproject.toml").is_file()):
            raise FileNotFoundError(f"Gym server {stock} is not installed in {venv} ({site / stock})")
        names.setdefault(stock, site / stock)
    links: list[Path] = []
    for name in sorted(names):
        link = dest / name / ".venv"
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            raise FileExistsError(
                f"{link} exists and is not a symlink; remove it or pick another uv_venv_dir"
            )
        os.symlink(venv, link, target_is_directory=True)
        links.append(link)
    return links


def _is_this_package(directory: Path) -> bool:
    """Whether a server directory in site-packages came from this package's wheel (its
    ``requirements.txt`` says so)."""
    requirements = directory / "requirements.txt"
    return requirements.is_file() and "video-grpo" in requirements.read_text(encoding="utf-8")
