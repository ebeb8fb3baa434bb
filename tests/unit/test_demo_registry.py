"""The demo apart from the product: the core never imports ``video_grpo_demo`` and finds it only
through entry points (``rl_bridge.registry``, ``gym_video_env.environments.row_generator``)."""

from __future__ import annotations

import ast
import tomllib
import typing
from importlib import metadata
from pathlib import Path

import pytest

from gym_video_env import environments
from rl_bridge import registry
from rl_bridge.paths import project_root
from rl_bridge.recipe import ModelFamily, TaskEnvironment

pytestmark = pytest.mark.unit

ROOT = project_root()
_CORE = (
    "rl_bridge",
    "gym_video_env",
    "vllm_video_plugin",
    "resources_servers",
    "responses_api_models",
    "responses_api_agents",
)


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_core_never_imports_the_demo() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}: {module}"
        for package in _CORE
        for path in sorted((ROOT / "src" / package).rglob("*.py"))
        for module in _imported_modules(path)
        if module.split(".")[0] == "video_grpo_demo"
    ]
    assert not offenders, offenders


def _declared(group: str) -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["entry-points"][group]


def test_declared_entry_points_cover_the_recipes_and_load() -> None:
    models = _declared(registry.MODELS_GROUP)
    tasks = _declared(registry.TASKS_GROUP)
    # Nemotron Omni runs from real checkpoints only (ModelSection refuses model.path: null).
    assert set(models) == set(typing.get_args(ModelFamily)) - {"nemotron_omni"}
    assert set(tasks) == set(typing.get_args(TaskEnvironment))
    assert set(_declared(registry.COMMANDS_GROUP)) == {"tiny-model", "make-clips"}
    assert set(_declared(environments.ROW_GENERATORS_GROUP)) == {"video_mcqa", "video_segments"}
    for group in (
        registry.MODELS_GROUP,
        registry.TASKS_GROUP,
        registry.COMMANDS_GROUP,
        environments.ROW_GENERATORS_GROUP,
    ):
        for name, value in _declared(group).items():
            assert metadata.EntryPoint(name, value, group).load() is not None, (group, name)


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, group: str, eps: dict[str, str]) -> None:
    installed = metadata.EntryPoints(metadata.EntryPoint(name, value, group) for name, value in eps.items())

    def entry_points(**params: str) -> metadata.EntryPoints:
        return installed.select(**params) if params.get("group") == group else metadata.EntryPoints(())

    monkeypatch.setattr(metadata, "entry_points", entry_points)


def test_local_model_loads_the_entry_point_of_the_family(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, registry.MODELS_GROUP, _declared(registry.MODELS_GROUP))
    model = registry.local_model("qwen3_vl")
    config = model.config(text_num_layers=1)
    assert config["num_hidden_layers"] == 1 and "deepstack_visual_indexes" in config["vision_config"]


def test_a_missing_entry_point_names_the_group_and_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, registry.MODELS_GROUP, {"qwen2_5_vl": "json:dumps"})
    with pytest.raises(
        registry.MissingEntryPoint, match=r"'nemotron_omni'.*'video_grpo\.models' has qwen2_5_vl"
    ):
        registry.local_model("nemotron_omni")
    with pytest.raises(registry.MissingEntryPoint, match=r"'mcqa'.*'video_grpo\.tasks' has no entry points"):
        registry.task_rows("mcqa")
    with pytest.raises(LookupError, match=r"'video_mcqa'.*'gym_video_env\.row_generators'"):
        environments.row_generator("video_mcqa")


def test_the_commands_of_entry_points_join_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    from rl_bridge import cli

    _fake_entry_points(monkeypatch, registry.COMMANDS_GROUP, _declared(registry.COMMANDS_GROUP))
    args = cli._parser().parse_args(["tiny-model", "qwen2_5_vl"])
    assert (args.command, args.family, args.needs_trainer) == ("tiny-model", "qwen2_5_vl", True)
    assert cli._parser().parse_args(["make-clips", "out"]).command == "make-clips"
