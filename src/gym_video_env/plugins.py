"""The plugin manager: the hook specs plus every handler in the ``gym_video_env.media_handlers`` group.

The built-in handlers (``input_video``, ``input_image``, ``tool_output_media``) are entry points of
this distribution in that group, loaded exactly like a third party's; their implementations are
``trylast``, so an installed plugin is asked first.

Environment variables, read when the manager is built:

``GYM_VIDEO_ENV_LOAD_PLUGINS``
    Comma-separated entry-point names to load (e.g. ``input_video,my_handler``). Unset: all of
    them; empty: none. A name that is not in the group is an error.
``GYM_VIDEO_ENV_TRACE_HOOKS``
    ``1``: print every hook call to stderr with its implementations and its result.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import pluggy

from gym_video_env import hookspecs

__all__ = [
    "ENTRY_POINT_GROUP",
    "LOAD_PLUGINS_ENV",
    "TRACE_HOOKS_ENV",
    "PluginLoadError",
    "get_plugin_manager",
    "reset_plugin_manager",
]

ENTRY_POINT_GROUP = "gym_video_env.media_handlers"
LOAD_PLUGINS_ENV = "GYM_VIDEO_ENV_LOAD_PLUGINS"
TRACE_HOOKS_ENV = "GYM_VIDEO_ENV_TRACE_HOOKS"


class PluginLoadError(RuntimeError):
    """The media-handler plugins could not be loaded as configured."""


_plugin_manager: pluggy.PluginManager | None = None


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built on first use from the installed entry points."""
    global _plugin_manager
    if _plugin_manager is None:
        _plugin_manager = _build_plugin_manager()
    return _plugin_manager


def reset_plugin_manager() -> None:
    """Drop the process-wide manager; the next :func:`get_plugin_manager` rediscovers entry points."""
    global _plugin_manager
    _plugin_manager = None


def _build_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    available = _entry_points_by_name()
    selected = _selected_plugin_names(available)
    if selected is None:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    else:
        for name in selected:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
    # A misspelled hook implementation fails here instead of never being called.
    pm.check_pending()
    if os.environ.get(TRACE_HOOKS_ENV) == "1":
        pm.add_hookcall_monitoring(_trace_before, _trace_after)
    return pm


def _entry_points_by_name() -> dict[str, importlib.metadata.EntryPoint]:
    """The group's entry points by name; a name claimed by two distributions is an error."""
    owners: defaultdict[str, set[str]] = defaultdict(set)
    by_name: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        owners[ep.name].add(ep.dist.name if ep.dist is not None else "<unknown distribution>")
        by_name[ep.name] = ep
    clashes = {name: sorted(dists) for name, dists in owners.items() if len(dists) > 1}
    if clashes:
        details = "; ".join(f"{name!r} from {' and '.join(dists)}" for name, dists in sorted(clashes.items()))
        raise PluginLoadError(
            f"Entry-point names in group {ENTRY_POINT_GROUP!r} must be unique, but {details}. "
            "Rename one of them."
        )
    return by_name


def _selected_plugin_names(available: Mapping[str, importlib.metadata.EntryPoint]) -> list[str] | None:
    """Names listed in ``GYM_VIDEO_ENV_LOAD_PLUGINS``, or ``None`` when it is unset (load all)."""
    raw = os.environ.get(LOAD_PLUGINS_ENV)
    if raw is None:
        return None
    names = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in available]
    if unknown:
        raise PluginLoadError(
            f"{LOAD_PLUGINS_ENV} names {', '.join(map(repr, unknown))}, which the entry-point group "
            f"{ENTRY_POINT_GROUP!r} does not have. Available: {', '.join(sorted(available)) or '(none)'}."
        )
    return names


def _trace_before(hook_name: str, hook_impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]) -> None:
    # pluggy calls implementations last-registered first, with tryfirst/trylast applied.
    order = ", ".join(impl.plugin_name for impl in reversed(hook_impls))
    print(f"[gym_video_env] {hook_name}({_format_kwargs(kwargs)}) -> asking: {order}", file=sys.stderr)


def _trace_after(
    outcome: pluggy.Result[Any],
    hook_name: str,
    hook_impls: Sequence[pluggy.HookImpl],
    kwargs: Mapping[str, Any],
) -> None:
    if outcome.exception is not None:
        result = f"raised {outcome.exception!r}"
    else:
        result = f"returned {outcome.get_result()!r}"
    print(f"[gym_video_env] {hook_name} {result}", file=sys.stderr)


def _format_kwargs(kwargs: Mapping[str, Any], max_chars: int = 200) -> str:
    text = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."
