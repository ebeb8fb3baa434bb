"""The package's layout rules (docs/ARCHITECTURE.md, "Layout"), checked on the source text: no
import circle anywhere in ``src/`` (imports inside functions and for type checking included), each
room imports only the rooms below it, no module over 600 lines but the recipe schema, and the two
loops short enough to read on one screen."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGES = ("vllm_video_plugin", "gym_video_env", "rl_bridge", "video_grpo_demo")
MAX_LINES = 600
LONGER_ALLOWED = {"rl_bridge/recipe.py"}  # the recipe schema: one pydantic model per section, documented
LOOP_MAX_LINES = 120

ROOMS: tuple[tuple[str, ...], ...] = (
    ("vllm_video_plugin",),
    ("gym_video_env",),
    (  # what the trainer is built from
        "rl_bridge.paths",
        "rl_bridge.console",
        "rl_bridge.services",
        "rl_bridge.trajectory",
        "rl_bridge.processors",
        "rl_bridge.media_batch",
        "rl_bridge.policy_inputs",
        "rl_bridge.rollout",
        "rl_bridge.structured_outputs",
        "rl_bridge.grpo",
        "rl_bridge.refit",
        "rl_bridge.megatron",
    ),
    (
        "rl_bridge.recipe",
        "rl_bridge.user_errors",
        "rl_bridge.registry",
        "rl_bridge.tasks",
        "rl_bridge.placement",
    ),
    ("rl_bridge.backends",),
    ("rl_bridge.loop",),
    ("rl_bridge.cli", "rl_bridge.doctor", "rl_bridge.hostpack", "rl_bridge.hostcheck", "rl_bridge"),
    ("video_grpo_demo",),
)
"""The rooms of ``src/``, lowest first: a module may import its own room's modules and those of
rooms listed before it, never one after. The demo comes last: nothing of the product imports it."""


def _modules() -> dict[str, Path]:
    """Every module of the three packages by dotted name (a package by its ``__init__``)."""
    modules = {}
    for package in PACKAGES:
        for path in (SRC / package).rglob("*.py"):
            parts = path.relative_to(SRC).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports anywhere in its text (a ``from X import y`` counts as
    ``X.y`` when that is a module, else ``X``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def test_no_import_circle_in_src() -> None:
    assert _cycles(_graph()) == []


def _room(module: str) -> int:
    parts = module.split(".")
    name = ".".join(parts[:2]) if parts[0] == "rl_bridge" and len(parts) > 1 else parts[0]
    return next(i for i, room in enumerate(ROOMS) if name in room)


def test_each_room_imports_only_rooms_below_it() -> None:
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if _room(target) > _room(module)
    )
    assert upward == []


def test_the_checker_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_over_600_lines_but_the_recipe_schema() -> None:
    long = {
        str(path.relative_to(SRC)): count
        for path in SRC.rglob("*.py")
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert set(long) <= LONGER_ALLOWED, long


def test_the_loops_read_on_one_screen() -> None:
    for loop in ("sync.py", "async_grpo.py"):
        lines = len((SRC / "rl_bridge" / "loop" / loop).read_text().splitlines())
        assert lines < LOOP_MAX_LINES, (loop, lines)
