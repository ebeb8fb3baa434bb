"""What the trainer finds by name through entry points: locally built models, task rows, commands.

A recipe names a model family (``model.family``) and a task environment (``task.environment``).
With ``model.path: null`` the starting checkpoint is built by the object registered under the
family's name in :data:`MODELS_GROUP` (:func:`local_model`); a task's rows are written by the
function registered under the environment's name in :data:`TASKS_GROUP` (:func:`task_rows`);
``video-grpo`` adds the subcommands registered in :data:`COMMANDS_GROUP` (:func:`commands`).

This distribution's demo, ``video_grpo_demo`` (tiny random-weight models, synthetic clips), fills
the three groups from ``pyproject.toml``; another distribution adds its own the same way, as vLLM
finds ``vllm.general_plugins``. Nothing here imports the demo: an entry point is loaded when its
name is asked for, and a name that is not installed is an error naming the group and the name.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from rl_bridge.user_errors import UsageError

if TYPE_CHECKING:
    from rl_bridge.recipe import TaskSection

__all__ = [
    "COMMANDS_GROUP",
    "MODELS_GROUP",
    "TASKS_GROUP",
    "AddCommand",
    "LocalModel",
    "MissingEntryPoint",
    "TaskRows",
    "commands",
    "local_model",
    "task_rows",
]

MODELS_GROUP: Final = "video_grpo.models"
"""Entry points by model family; each loads a :class:`LocalModel`."""
TASKS_GROUP: Final = "video_grpo.tasks"
"""Entry points by task environment; each loads a :data:`TaskRows` function."""
COMMANDS_GROUP: Final = "video_grpo.commands"
"""Entry points by ``video-grpo`` subcommand; each loads an :data:`AddCommand` function."""


class MissingEntryPoint(UsageError, LookupError):
    """No installed distribution registers the name asked for in the group."""


class LocalModel(Protocol):
    """A model family that can be built on this machine (``model.path: null``)."""

    def build(self, *, seed: int = 0, out_dir: Path | None = None, **spec: Any) -> Path:
        """Build (or find in a cache) the checkpoint of ``spec`` (the recipe's ``model.spec``)
        with weights drawn from ``seed``; return its directory."""
        ...

    def config(self, **spec: Any) -> dict[str, Any]:
        """The ``config.json`` fields :meth:`build` would write for ``spec``, without building."""
        ...


TaskRows = Callable[["TaskSection", Path], tuple[list[dict[str, Any]], list[dict[str, Any]]]]
"""``rows(task, media_root) -> (train_rows, held_out_rows)``: writes the task's media under
``media_root`` and returns Gym rows; deterministic in the task's seed (a resumed run calls it again)."""

AddCommand = Callable[[Callable[..., argparse.ArgumentParser]], None]
"""``add_command(add)``: adds a subcommand with ``add(name, func, help) -> parser`` (``func(args)``
returns the exit status); ``parser.set_defaults(needs_trainer=True)`` when it needs the trainer's
packages (``video-grpo`` then names the environment that has them)."""


def _load(group: str, name: str, what: str) -> Any:
    found = metadata.entry_points(group=group, name=name)
    if not found:
        installed = sorted({ep.name for ep in metadata.entry_points(group=group)})
        raise MissingEntryPoint(
            f"no {what} {name!r}: entry point group {group!r} has "
            f"{', '.join(installed) if installed else 'no entry points'} in this environment "
            "(the demo's are declared in video-grpo's pyproject.toml; reinstall it after a change)"
        )
    return next(iter(found)).load()


def local_model(family: str) -> LocalModel:
    """The buildable model registered as ``family`` in :data:`MODELS_GROUP`.

    Raises:
        MissingEntryPoint: none is installed.
    """
    return _load(MODELS_GROUP, family, "locally built model of family")


def task_rows(environment: str) -> TaskRows:
    """The row writer registered as ``environment`` in :data:`TASKS_GROUP`.

    Raises:
        MissingEntryPoint: none is installed.
    """
    return _load(TASKS_GROUP, environment, "task rows for environment")


def commands() -> list[tuple[str, AddCommand]]:
    """The installed subcommands of :data:`COMMANDS_GROUP`, by name (each loaded: keep the modules
    they live in light, ``video-grpo --help`` imports them)."""
    eps = sorted(metadata.entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name)
    return [(ep.name, ep.load()) for ep in eps]
