"""Every recipe in recipes/ loads and is consistent; GPU recipes refuse to start without their hardware.

The GPU recipes (Qwen2.5-VL-3B/7B, Nemotron 3 Nano Omni) are validated here only: bf16, a real
checkpoint, vLLM tensor parallelism dividing its GPUs, Megatron parallelism dividing the policy's,
Transformer Engine for Nemotron, and every clip of a trajectory within the model's context.
"""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import torch
import yaml

from gym_video_env.grading import LETTER_INSTRUCTION
from rl_bridge.loop.async_grpo import run_async
from rl_bridge.loop.sync import run_sync
from rl_bridge.paths import project_root
from rl_bridge.recipe import HardwareError, Recipe, load_recipe
from video_grpo_demo.task import task_rows

pytestmark = pytest.mark.unit

RECIPES = sorted((project_root() / "recipes").glob("*.yaml"))
GPU_RECIPES = [  # _gpu, _1gpu, _1gpu_h100
    path for path in RECIPES if any(part.endswith("gpu") for part in path.stem.split("_")[-2:])
]
CPU_RECIPES = [path for path in RECIPES if path not in GPU_RECIPES]


def _leaf_keys(data: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            keys += _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def test_the_recipes_are_there() -> None:
    names = {path.name for path in RECIPES}
    assert {
        "tiny_cpu_sync.yaml",
        "tiny_cpu_multiturn.yaml",
        "tiny_cpu_agentic.yaml",
        "qwen2_5_vl_3b_gpu.yaml",
        "qwen2_5_vl_3b_1gpu.yaml",
        "qwen2_5_vl_3b_1gpu_h100.yaml",
        "qwen2_5_vl_7b_gpu.yaml",
        "nemotron_nano_omni_gpu.yaml",
    } <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_and_every_key_is_a_field(path: Path) -> None:
    recipe = load_recipe(path)
    data = yaml.safe_load(path.read_text())
    dumped = recipe.model_dump(by_alias=True)
    for key in _leaf_keys(data):
        node = dumped
        for part in key.split("."):
            assert part in node, f"{path.name}: {key} is not a recipe field"
            node = node[part]
    assert recipe.run_dir == Path("runs") / path.stem


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
@pytest.mark.parametrize("override", ["model.tensor_parallel=2", "task.environmnet=segments", "extra=1"])
def test_unknown_keys_are_rejected_in_every_recipe(path: Path, override: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        load_recipe(path, [override])


@pytest.mark.parametrize("path", CPU_RECIPES, ids=lambda p: p.stem)
def test_cpu_recipes_build_the_tiny_model_in_fp32(path: Path) -> None:
    model = load_recipe(path).model
    assert model.path is None and model.num_gpus == 0 and model.dtype == "float32"


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.stem)
def test_gpu_recipes_are_consistent(path: Path) -> None:
    recipe = load_recipe(path)
    model = recipe.model
    # A real checkpoint, or a full-size model built on the host from its dimensions (random weights).
    assert model.path or model.spec.get("vocab_size", 0) >= 151936, "a GPU recipe trains a full-size model"
    assert model.dtype == "bfloat16"
    assert model.vllm_gpus > 0 and model.policy_gpus > 0
    assert model.vllm_gpus % model.vllm_tensor_parallel_size == 0
    model_parallel = model.policy_tensor_parallel_size * model.policy_pipeline_parallel_size
    assert model.policy_gpus == model_parallel * model.policy_data_parallel_size
    # Real models answer in free text: no one-token letter restriction.
    assert recipe.task.answer_format == "boxed" and not recipe.rollout.restrict_to_options
    # The clips of a whole trajectory, at full frame count, and the answers fit the context.
    side, temporal = model.video_token_geometry
    task = recipe.task
    per_clip = -(-task.num_frames // temporal) * -(-task.width // side) * -(-task.height // side)
    answers = (task.videos_per_prompt + 1) * recipe.rollout.max_output_tokens
    assert task.videos_per_prompt * per_clip + answers <= model.max_model_len
    assert task.num_frames % temporal == 0, "whole temporal patches"
    if model.family == "nemotron_omni":
        assert model.layer_spec == "transformer_engine" and model.trust_remote_code


def test_nemotron_recipe_asks_for_transformer_engine() -> None:
    model = load_recipe(project_root() / "recipes" / "nemotron_nano_omni_gpu.yaml").model
    assert model.family == "nemotron_omni"
    assert model.layer_spec == "transformer_engine"
    assert model.policy_expert_parallel_size > 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.vllm_gpus=4", "model.policy_gpus=4", "model.vllm_tensor_parallel_size=3"], "not divide"),
        (["model.vllm_gpus=4", "model.policy_gpus=6", "model.policy_tensor_parallel_size=4"], "multiple"),
        (["model.vllm_gpus=4", "model.policy_gpus=0"], "both on GPUs or both on CPU"),
        (["model.dtype=bfloat16"], "need GPUs"),
        (
            ["model.cpu_policy_ranks=3", "model.policy_pipeline_parallel_size=2"],
            "model.policy_pipeline_parallel_size=2 does not divide model.cpu_policy_ranks=3",
        ),
        (["model.path=Qwen/Qwen2.5-VL-3B-Instruct", "model.spec.text_num_layers=1"], "tunes the tiny model"),
        (["model.family=nemotron_omni"], "no tiny CPU model"),
        (["model.placement=colocated", "mode=async"], "needs mode='sync'"),
        (["model.placement=colocated", "cluster.backend=ray"], "local backend only"),
        (["task.width=2048", "task.height=2048", "task.num_frames=64"], "over model.max_model_len"),
        (["task.environment=segments", "task.name=count"], "task.name must be 'colour'"),
        (["task.bad_row_fraction=1.0"], "bad_row_fraction"),
        (["rollout.coalesce_max_wait_ms=500"], "needs rollout.coalesce_window_ms above 0"),
        (
            ["rollout.coalesce_window_ms=100", "rollout.coalesce_max_wait_ms=50"],
            "needs rollout.coalesce_window_ms above 0 and at most it",
        ),
        (["rollout.spread_group_samples=true"], "needs rollout.gym_workers >= 2"),
        (["task.later_clips=blank"], "apply to task.segments_question='last' only"),
        (["task.segments_question=last"], "task.environment='segments' only"),
        (
            ["task.environment=segments", "task.segments_question=last", "task.num_segments=1"],
            "num_segments >= 2",
        ),
        (
            ["task.environment=segments", "task.segments_question=last", "task.earlier_colours=non_option"],
            "num_options < 6",
        ),
    ],
)
def test_inconsistent_settings_are_rejected(overrides: list[str], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        load_recipe(None, overrides)


def test_the_multiturn_recipe_shows_the_answer_in_the_last_clip_only_and_its_control_blanks_it(
    tmp_path: Path,
) -> None:
    path = project_root() / "recipes" / "tiny_cpu_multiturn.yaml"
    shown = task_rows(load_recipe(path).task, tmp_path / "shown", 8, seed=0, subdir="train")
    blank = task_rows(
        load_recipe(path, ["task.later_clips=blank"]).task, tmp_path / "blank", 8, seed=0, subdir="train"
    )
    for a, b in zip(shown, blank, strict=True):
        params = a["responses_create_params"]
        assert params["tool_choice"] == "none"
        assert params["input"][0]["content"][0]["text"].endswith(LETTER_INSTRUCTION)
        first, last = a["segment_colours"]
        assert a["options"][a["answer"]] == last and first in ("cyan", "magenta")
        assert a["segments"][0] == b["segments"][0] and a["segments"][1] == f"train/{last}.mp4"
        assert b["segments"][1] == "train/black.mp4" and b["answer"] == a["answer"]


def test_nemotron_without_transformer_engine_is_rejected() -> None:
    path = project_root() / "recipes" / "nemotron_nano_omni_gpu.yaml"
    with pytest.raises(pydantic.ValidationError, match="needs model.layer_spec='transformer_engine'"):
        load_recipe(path, ["model.layer_spec=local_sdpa"])


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.stem)
def test_gpu_recipe_without_cuda_fails_before_building_anything(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = load_recipe(path, [f"run_dir={tmp_path / 'run'}"])
    gpus = load_recipe(path).model.num_gpus
    with pytest.raises(
        HardwareError, match=rf"is GPU-only: it needs {gpus} CUDA GPUs .*CUDA is not available"
    ):
        recipe.require_hardware()
    earlier_run = tmp_path / "run" / "summary.json"
    earlier_run.parent.mkdir()
    earlier_run.write_text("{}")
    for run in (run_sync, run_async):
        with pytest.raises(HardwareError, match="GPU-only"):
            run(recipe)
    assert earlier_run.read_text() == "{}", (
        "an earlier run directory is left alone when the hardware is missing"
    )


def test_gpu_recipe_needs_enough_gpus_and_transformer_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    import rl_bridge.megatron.te_standin as te_standin

    recipe = load_recipe(project_root() / "recipes" / "nemotron_nano_omni_gpu.yaml")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(HardwareError, match="needs 8 CUDA GPUs .*found 4"):
        recipe.require_hardware()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(te_standin, "transformer_engine_installed", lambda: False)
    with pytest.raises(HardwareError, match="needs Transformer Engine"):
        recipe.require_hardware()
    monkeypatch.setattr(te_standin, "transformer_engine_installed", lambda: True)
    recipe.require_hardware()


def test_cpu_recipes_need_no_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for path in CPU_RECIPES:
        load_recipe(path).require_hardware()
    Recipe().require_hardware()
