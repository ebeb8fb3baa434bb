"""The placement planner (rl_bridge.placement) and ``video-grpo plan``: layouts the GPU recipes
promise, refusals before anything starts, CPU and colocated plans, the model shapes it reads."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rl_bridge.cli import main as cli_main
from rl_bridge.paths import project_root
from rl_bridge.placement import GiB, Hardware, PlacementError, format_plan, model_shape, plan_placement
from rl_bridge.recipe import load_recipe

pytestmark = pytest.mark.unit

RECIPES = project_root() / "recipes"
CPU_RECIPES = sorted(  # not _gpu, _1gpu, _1gpu_h100
    path
    for path in RECIPES.glob("*.yaml")
    if not any(part.endswith("gpu") for part in path.stem.split("_")[-2:])
)
ONE_HOST = Hardware(nodes=1, gpus_per_node=8, gpu_memory_bytes=80 * GiB)
"""What the GPU recipes' headers ask for: one 8-GPU host (80 GiB GPUs: H100, A100-80GB)."""
BIG_HOST = Hardware(nodes=1, gpus_per_node=8, gpu_memory_bytes=192 * GiB)


# (recipe, hardware, vLLM replicas, vLLM TP, policy TP, DP, EP): the layouts the headers promise.
PROMISED = [
    ("qwen2_5_vl_3b_gpu", ONE_HOST, 4, 1, 1, 4, 1),  # "4 vLLM replicas of 1 GPU each", "data parallel 4"
    ("qwen2_5_vl_7b_gpu", ONE_HOST, 2, 2, 2, 2, 1),  # "vLLM 2 replicas x TP 2, Megatron TP 2 x DP 2"
    # "vLLM TP 4, Megatron TP 4 x EP 4": the layout on 8 GPUs with room for its memory (below: 80 GiB
    # GPUs cannot hold the policy).
    ("nemotron_nano_omni_gpu", BIG_HOST, 1, 4, 4, 1, 4),
]


@pytest.mark.parametrize(("name", "hardware", "replicas", "vllm_tp", "tp", "dp", "ep"), PROMISED)
def test_gpu_recipes_plan_as_their_headers_promise(
    name: str, hardware: Hardware, replicas: int, vllm_tp: int, tp: int, dp: int, ep: int
) -> None:
    recipe = load_recipe(RECIPES / f"{name}.yaml")
    plan = plan_placement(recipe, hardware)
    assert plan.placement == "split"
    assert len(plan.vllm) == replicas and all(r.tensor_parallel == vllm_tp for r in plan.vllm)
    assert all(len(r.devices) == vllm_tp and len({d.node for d in r.devices}) == 1 for r in plan.vllm)
    parallel = (plan.tensor_parallel, plan.pipeline_parallel, plan.data_parallel, plan.expert_parallel)
    assert parallel == (tp, 1, dp, ep)
    assert len(plan.policy) == recipe.model.policy_gpus == tp * dp
    assert [len(g) for g in plan.tensor_groups] == [tp] * dp
    assert [len(g) for g in plan.data_groups] == [dp] * tp
    # Split: disjoint devices, all eight GPUs of the host used.
    assert plan.vllm_devices.isdisjoint(plan.policy_devices)
    assert len(plan.vllm_devices) == recipe.model.vllm_gpus and len(plan.policy_devices) == len(plan.policy)
    assert len(plan.vllm_devices | plan.policy_devices) == 8
    assert plan.reference is False and plan.reference_memory is None  # kl_coef: 0.0
    assert plan.distributed_optimizer == (dp > 1)
    need, _ = plan.policy_gpu_bytes()
    assert need <= hardware.gpu_memory_bytes
    assert plan.vllm_memory.total == int(recipe.model.vllm_gpu_memory_utilization * hardware.gpu_memory_bytes)


def test_the_7b_plan_places_tensor_groups_on_consecutive_gpus() -> None:
    plan = plan_placement(load_recipe(RECIPES / "qwen2_5_vl_7b_gpu.yaml"), ONE_HOST)
    assert [[str(d) for d in r.devices] for r in plan.vllm] == [["n0:g0", "n0:g1"], ["n0:g2", "n0:g3"]]
    assert [str(r.device) for r in plan.policy] == ["n0:g4", "n0:g5", "n0:g6", "n0:g7"]
    assert plan.tensor_groups == ((0, 1), (2, 3)) and plan.data_groups == ((0, 2), (1, 3))


def test_the_memory_estimate_follows_the_documented_formula() -> None:
    recipe = load_recipe(RECIPES / "qwen2_5_vl_7b_gpu.yaml", ["train.loss.kl_coef=0.01"])
    plan = plan_placement(recipe, BIG_HOST)
    params = 8_292_166_656
    local = params / (2 * 1)  # TP 2 x PP 1
    assert plan.policy_memory.weights == round(local * 2)  # bf16
    assert plan.policy_memory.gradients == round(local * 4)  # fp32 gradient buffer
    assert plan.policy_memory.optimizer == round(local * 12 / 2)  # master + 2 moments, / DP 2
    # 3 clips x 1024 video tokens + 4 answers x 256 + 256 text tokens, 2 per micro-batch; the vision
    # tower sees 4 patches a video token (1280 wide, 32 blocks, not split by TP). The recipe
    # recomputes: each layer's input kept, one layer's 17 elements at a time; x 1.9 measured.
    tokens = 2 * (3 * 1024 + 4 * 256 + 256)
    patches = 2 * 3 * 1024 * 4
    elements = tokens * 3584 * 28 / 2 * (1 + 17 / 28) + patches * 1280 * 32 * (1 + 17 / 32)
    assert recipe.train.recompute == "full"
    assert plan.policy_memory.activations == round(elements * 2 * 1.9)
    kept = plan_placement(load_recipe(RECIPES / "qwen2_5_vl_7b_gpu.yaml", ["train.recompute=none"]), BIG_HOST)
    elements = tokens * 3584 * 28 / 2 * 17 + patches * 1280 * 32 * 17
    assert kept.policy_memory.activations == round(elements * 2 * 1.9)
    assert plan.reference and plan.reference_memory is not None
    assert plan.reference_memory.total == round(local * 2)  # forward-only, on the policy's GPUs
    assert plan.vllm_memory.weights == math.ceil(params * 2 / 2)
    no_sharding = plan_placement(recipe, BIG_HOST, distributed_optimizer=False)
    assert no_sharding.policy_memory.optimizer == round(local * 12)


def test_known_checkpoints_count_their_published_parameters() -> None:
    for name, total in (("qwen2_5_vl_3b_gpu", 3_754_622_976), ("qwen2_5_vl_7b_gpu", 8_292_166_656)):
        assert model_shape(load_recipe(RECIPES / f"{name}.yaml")).parameters == total
    qwen3 = (("Qwen/Qwen3-VL-4B-Instruct", 4_437_815_808), ("Qwen/Qwen3-VL-8B-Instruct", 8_767_123_696))
    for hub_id, total in qwen3:  # published totals
        recipe = load_recipe(None, ["model.family=qwen3_vl", f"model.path={hub_id}"])
        assert model_shape(recipe).parameters == total, hub_id
    nemotron = model_shape(load_recipe(RECIPES / "nemotron_nano_omni_gpu.yaml"))
    assert nemotron.language_parameters == 31_577_940_288  # Nemotron 3 Nano: 31.6 B published
    assert (nemotron.num_attention_heads, nemotron.num_key_value_heads, nemotron.num_layers) == (32, 2, 52)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_tiny_shape_counts_the_tiny_checkpoint_exactly(family: str) -> None:
    from safetensors import safe_open

    from video_grpo_demo.tiny_models import build_tiny_model

    model_dir = build_tiny_model(family)
    counted = {"language": 0, "vision": 0}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as weights:
            for name in weights.keys():
                part = "vision" if "visual" in name else "language"
                counted[part] += math.prod(weights.get_slice(name).get_shape())
    from_spec = model_shape(load_recipe(None, [f"model.family={family}"]))
    from_config = model_shape(load_recipe(None, [f"model.family={family}", f"model.path={model_dir}"]))
    for shape in (from_spec, from_config):
        assert shape.language_parameters == counted["language"]
        assert shape.vision_parameters == counted["vision"]
    assert from_config.source.endswith("config.json")
    assert json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"] == (
        from_spec.vocab_size
    )


@pytest.mark.parametrize("path", CPU_RECIPES, ids=lambda p: p.stem)
def test_cpu_recipes_plan_their_servers_and_ranks_on_the_cpu(path: Path) -> None:
    recipe = load_recipe(path)
    plan = plan_placement(recipe, Hardware())
    assert plan.placement == "cpu"
    assert len(plan.vllm) == recipe.model.cpu_vllm_servers and all(r.devices == () for r in plan.vllm)
    assert len(plan.policy) == recipe.model.cpu_policy_ranks and all(r.device is None for r in plan.policy)
    assert "cpu" in format_plan(plan)


def test_the_scaled_cpu_recipe_plans_two_servers_and_two_data_parallel_ranks() -> None:
    plan = plan_placement(load_recipe(RECIPES / "tiny_cpu_scaled.yaml"), Hardware())
    assert (len(plan.vllm), len(plan.policy)) == (2, 2)
    assert (plan.tensor_parallel, plan.data_parallel, plan.distributed_optimizer) == (1, 2, True)
    assert plan.data_groups == ((0, 1),)
    tp = plan_placement(
        load_recipe(RECIPES / "tiny_cpu_scaled.yaml", ["model.policy_tensor_parallel_size=2"]), Hardware()
    )
    assert (tp.tensor_parallel, tp.data_parallel, tp.tensor_groups) == (2, 1, ((0, 1),))


def test_a_cpu_pipeline_plans_one_stage_per_rank() -> None:
    plan = plan_placement(
        load_recipe(None, ["model.cpu_policy_ranks=2", "model.policy_pipeline_parallel_size=2"]), Hardware()
    )
    assert (plan.tensor_parallel, plan.pipeline_parallel, plan.data_parallel) == (1, 2, 1)
    assert [(r.rank, r.pipeline_rank, r.data_rank, r.device) for r in plan.policy] == [
        (0, 0, 0, None),
        (1, 1, 0, None),
    ]
    assert plan.pipeline_groups == ((0, 1),)


def test_a_cpu_tensor_parallel_size_that_does_not_fit_the_heads_is_refused() -> None:
    recipe = load_recipe(None, ["model.cpu_policy_ranks=4", "model.policy_tensor_parallel_size=4"])
    with pytest.raises(PlacementError, match="model.policy_tensor_parallel_size=4"):
        plan_placement(recipe, Hardware())


def _colocated_7b(*overrides: str) -> object:
    recipe = load_recipe(
        RECIPES / "qwen2_5_vl_7b_gpu.yaml",
        ["model.placement=colocated", "model.vllm_gpu_memory_utilization=0.3", *overrides],
    )
    return plan_placement(recipe, Hardware(1, 4, 80 * GiB))


def test_colocated_plans_share_the_same_gpus() -> None:
    plan = _colocated_7b()
    assert plan.placement == "colocated"
    assert plan.vllm_devices == plan.policy_devices and len(plan.policy_devices) == 4
    need, breakdown = plan.policy_gpu_bytes()
    # Resident policy state, plus vLLM's reservation (larger than the activations) while generating.
    state = plan.policy_memory.weights + plan.policy_memory.gradients + plan.policy_memory.optimizer
    assert need == state + max(plan.policy_memory.activations, plan.vllm_memory.total)
    assert "while generating" in breakdown and "colocated" in format_plan(plan)
    # vLLM TP 4 and policy TP 2 on the same four GPUs.
    plan = _colocated_7b("model.vllm_tensor_parallel_size=4")
    assert len(plan.vllm) == 1 and plan.vllm_devices == plan.policy_devices


def _refusal(name: str, hardware: Hardware, *overrides: str) -> str:
    with pytest.raises(PlacementError) as caught:
        plan_placement(load_recipe(RECIPES / f"{name}.yaml", list(overrides)), hardware)
    return str(caught.value)


def test_more_gpus_than_the_hardware_has_is_refused() -> None:
    message = _refusal("qwen2_5_vl_7b_gpu", Hardware(1, 4, 80 * GiB))
    assert "needs 8 GPUs (model.vllm_gpus=4 + model.policy_gpus=4); the hardware has 4" in message


def test_a_tensor_parallel_size_must_fit_the_heads() -> None:
    message = _refusal(
        "qwen2_5_vl_7b_gpu",
        Hardware(2, 8, 80 * GiB),
        "model.vllm_gpus=8",
        "model.vllm_tensor_parallel_size=8",
    )
    assert "model.vllm_tensor_parallel_size=8 does not divide the model's 28 attention heads" in message
    message = _refusal(
        "qwen2_5_vl_7b_gpu",
        ONE_HOST,
        "model.vllm_gpus=1",
        "model.vllm_tensor_parallel_size=1",
        "model.policy_gpus=7",
        "model.policy_tensor_parallel_size=7",
    )
    assert "model.policy_tensor_parallel_size=7 does not divide the model's 4 KV heads" in message
    # More ranks than KV heads replicate them (megatron-core and vLLM allow it): Nemotron's 2 KV
    # heads under TP 4 plan.
    plan_placement(load_recipe(RECIPES / "nemotron_nano_omni_gpu.yaml"), BIG_HOST)


def test_a_tensor_parallel_group_stays_on_one_node() -> None:
    message = _refusal("qwen2_5_vl_7b_gpu", Hardware(8, 1, 80 * GiB))
    assert "model.vllm_tensor_parallel_size=2 is over the 1 GPUs per node" in message
    message = _refusal("qwen2_5_vl_7b_gpu", Hardware(3, 3, 80 * GiB))
    assert "finds no node with 2 free GPUs on 3 nodes x 3 GPUs" in message


def test_a_role_that_does_not_fit_its_gpu_is_refused() -> None:
    # Nemotron Omni's policy on four 80 GiB GPUs (TP 4 x EP 4, DP 1: nothing shards the optimizer).
    message = _refusal("nemotron_nano_omni_gpu", ONE_HOST)
    assert "a policy GPU needs about 151.2 GiB" in message and "over the GPU memory of 80.0 GiB" in message
    assert "a smaller train.micro_batch_size (now 1), train.recompute=full (now none)" in message
    message = _refusal("qwen2_5_vl_3b_gpu", ONE_HOST, "model.vllm_gpu_memory_utilization=0.05")
    assert "weights need about 7.0 GiB per GPU (TP 1), over the 4.0 GiB" in message
    assert "model.vllm_gpu_memory_utilization=0.05 reserves of a 80.0 GiB GPU" in message
    # Colocated with vLLM's default 85 % reservation next to the resident policy state.
    message = _refusal("qwen2_5_vl_7b_gpu", Hardware(1, 4, 80 * GiB), "model.placement=colocated")
    assert "a policy GPU needs about 114.3 GiB" in message and "vLLM's 68.0 while generating" in message


def test_colocated_with_different_gpu_counts_is_refused() -> None:
    message = _refusal("qwen2_5_vl_3b_gpu", ONE_HOST, "model.placement=colocated", "model.policy_gpus=2")
    assert "model.vllm_gpus=4 and model.policy_gpus=2 must be equal" in message


def test_an_unknown_checkpoint_is_refused() -> None:
    message = _refusal("qwen2_5_vl_3b_gpu", ONE_HOST, "model.path=someone/Qwen2.5-VL-1B-Unknown")
    assert "model.path='someone/Qwen2.5-VL-1B-Unknown' is not a local checkpoint directory" in message
    assert "Qwen/Qwen2.5-VL-7B-Instruct" in message
    assert issubclass(PlacementError, ValueError)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gpus_per_node=st.sampled_from([1, 2, 4, 8]),
    spare_nodes=st.integers(0, 1),
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.integers(1, 4),
    dp=st.integers(1, 4),
    vllm_tp=st.sampled_from([1, 2]),
    vllm_replicas=st.integers(1, 4),
)
def test_policy_ranks_cover_their_gpus_once_and_tensor_groups_stay_contiguous(
    gpus_per_node: int, spare_nodes: int, tp: int, pp: int, dp: int, vllm_tp: int, vllm_replicas: int
) -> None:
    assume(max(tp, vllm_tp) <= gpus_per_node)
    policy_gpus, vllm_gpus = tp * pp * dp, vllm_tp * vllm_replicas
    nodes = -(-(policy_gpus + vllm_gpus) // gpus_per_node) + spare_nodes
    hardware = Hardware(nodes, gpus_per_node, 10_000 * GiB)  # memory is not the question here
    recipe = load_recipe(
        RECIPES / "qwen2_5_vl_3b_gpu.yaml",  # 16 attention heads, 2 KV heads: every TP here fits
        [
            f"model.vllm_gpus={vllm_gpus}",
            f"model.vllm_tensor_parallel_size={vllm_tp}",
            f"model.policy_gpus={policy_gpus}",
            f"model.policy_tensor_parallel_size={tp}",
            f"model.policy_pipeline_parallel_size={pp}",
        ],
    )
    plan = plan_placement(recipe, hardware)  # sizes dividing a node always pack
    devices = [rank.device for rank in plan.policy]
    assert len(devices) == len(set(devices)) == policy_gpus == len(plan.policy_devices)
    assert plan.policy_devices.isdisjoint(plan.vllm_devices) and len(plan.vllm_devices) == vllm_gpus
    assert sorted(r for group in plan.tensor_groups for r in group) == list(range(policy_gpus))
    for group in plan.tensor_groups:
        placed = [plan.policy[rank].device for rank in group]
        assert list(group) == list(range(group[0], group[0] + tp)), "consecutive ranks"
        assert len({d.node for d in placed}) == 1, "one node"
        assert [d.gpu for d in placed] == list(range(placed[0].gpu, placed[0].gpu + tp)), "consecutive GPUs"
    for rank in plan.policy:
        assert rank.rank == rank.tensor_rank + tp * (rank.data_rank + dp * rank.pipeline_rank)


def test_cli_plan_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    recipe = str(RECIPES / "qwen2_5_vl_7b_gpu.yaml")
    argv = ["plan", "-r", recipe, "--gpus-per-node", "8", "--gpu-memory-gib", "80"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "placement: split    hardware: 1 node x 8 GPUs x 80.0 GiB" in out
    assert "role    replica/rank  devices      parallel group      memory GiB" in out
    assert "vllm    replica 1     n0:g2 n0:g3  TP 2" in out
    assert "policy  rank 3        n0:g7        TP [2 3]  DP [1 3]  54.3" in out
    assert cli_main([*argv, "model.placement=colocated", "model.vllm_gpu_memory_utilization=0.3"]) == 0
    assert "placement: colocated" in capsys.readouterr().out


def test_cli_plan_exits_2_with_the_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    recipe = str(RECIPES / "qwen2_5_vl_3b_gpu.yaml")
    assert cli_main(["plan", "-r", recipe, "--gpus-per-node", "4", "--gpu-memory-gib", "80"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "video-grpo plan: the recipe needs 8 GPUs" in captured.err and "the hardware has 4" in captured.err
    assert cli_main(["plan", "-r", recipe, "--gpus-per-node", "8", "--gpu-memory-gib", "0"]) == 2
    assert "need gpu_memory_bytes > 0" in capsys.readouterr().err


def test_cli_plan_imports_neither_vllm_nor_megatron() -> None:
    code = (
        "import sys; from rl_bridge.cli import main; "
        f"rc = main(['plan', '-r', {str(RECIPES / 'qwen2_5_vl_3b_gpu.yaml')!r}, '--gpus-per-node', '8', "
        "'--gpu-memory-gib', '80']); "
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'megatron')); "
        "print('LOADED', loaded); sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stdout


def test_the_local_backend_pins_each_vllm_replica_and_policy_rank_to_its_planned_gpu() -> None:
    from rl_bridge.backends.policy_ranks import rank_environment
    from rl_bridge.backends.vllm_servers import replica_server
    from rl_bridge.services.vllm_server import VLLMServerConfig

    plan = plan_placement(load_recipe(RECIPES / "qwen2_5_vl_7b_gpu.yaml"), Hardware(1, 8, 80 * GiB))
    config = VLLMServerConfig(model=Path("/unused"), extra_env={"KEEP": "1"})
    pinned = [replica_server(config, replica, several=True) for replica in plan.vllm]
    assert [(c.extra_env, name) for c, name in pinned] == [
        ({"KEEP": "1", "CUDA_VISIBLE_DEVICES": "0,1"}, "vllm-0"),
        ({"KEEP": "1", "CUDA_VISIBLE_DEVICES": "2,3"}, "vllm-1"),
    ]
    environments = [rank_environment(rank, len(plan.policy), 29500) for rank in plan.policy]
    assert [(e.rank, e.local_rank, e.world_size) for e in environments] == [
        (0, 4, 4),
        (1, 5, 4),
        (2, 6, 4),
        (3, 7, 4),
    ]
    cpu = plan_placement(load_recipe(RECIPES / "tiny_cpu_scaled.yaml"), Hardware())
    assert replica_server(config, cpu.vllm[1], several=True) == (config, "vllm-1")
    assert {rank_environment(rank, 2, 29500).local_rank for rank in cpu.policy} == {0}
