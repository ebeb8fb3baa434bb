"""The optimizer in host memory (``train.optimizer_offload_fraction``): the recipe field and its
checks, the megatron-core settings it becomes, the state the policy reports, and the planner
moving that state to the host. megatron-core's ``HybridDeviceOptimizer`` copies over CUDA streams
and pins host memory, so it cannot be built without CUDA: these tests check the settings handed
to megatron-core and the accounting over a hand-assembled one, not a step."""

from __future__ import annotations

from types import SimpleNamespace

import pydantic
import pytest
import torch

from rl_bridge.megatron.optimizer import build_optimizer, optimizer_config, state_bytes
from rl_bridge.megatron.policy_config import PolicyConfig
from rl_bridge.paths import project_root
from rl_bridge.placement import GiB, Hardware, format_plan, plan_placement
from rl_bridge.recipe import load_recipe

pytestmark = pytest.mark.unit

ONE_GPU = project_root() / "recipes" / "qwen2_5_vl_3b_1gpu.yaml"
H100 = project_root() / "recipes" / "qwen2_5_vl_3b_1gpu_h100.yaml"


@pytest.mark.parametrize(
    ("path", "overrides", "message"),
    [
        (None, ["train.optimizer_offload_fraction=1.5"], "less than or equal to 1"),
        (None, ["train.optimizer_offload_fraction=-0.1"], "greater than or equal to 0"),
        (None, ["train.optimizer_offload_fraction=0.5"], "needs GPUs"),
        (
            ONE_GPU,
            ["train.optimizer_offload_fraction=1", "train.distributed_optimizer=false"],
            "needs megatron-core's distributed optimizer",
        ),
    ],
)
def test_the_recipe_field_is_checked(path, overrides: list[str], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        load_recipe(path, overrides)


def test_the_recipe_field_reaches_the_policy_config_with_the_distributed_optimizer() -> None:
    assert load_recipe(ONE_GPU).policy_config().optimizer_offload_fraction == 0
    assert not load_recipe(ONE_GPU).distributed_optimizer  # one rank: off unless offloading
    recipe = load_recipe(H100)
    assert recipe.train.optimizer_offload_fraction == 1.0 and recipe.distributed_optimizer
    config = recipe.policy_config()
    assert config.optimizer_offload_fraction == 1.0 and config.distributed_optimizer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optimizer_offload_fraction": 1.5, "distributed_optimizer": True}, r"in \[0, 1\]"),
        ({"optimizer_offload_fraction": 0.5}, "needs distributed_optimizer=True"),
    ],
)
def test_policy_config_checks_the_fraction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**kwargs)


def test_no_offload_leaves_megatrons_optimizer_as_it_was() -> None:
    config = optimizer_config(PolicyConfig(dtype=torch.bfloat16, learning_rate=1e-5))
    assert not config.optimizer_cpu_offload and config.optimizer_offload_fraction == 0
    assert not config.use_precision_aware_optimizer and not config.use_distributed_optimizer
    assert config.bf16 and config.lr == 1e-5 and config.decoupled_weight_decay


@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_offloading_asks_megatron_for_its_hybrid_device_optimizer(fraction: float) -> None:
    config = optimizer_config(
        PolicyConfig(dtype=torch.bfloat16, distributed_optimizer=True, optimizer_offload_fraction=fraction)
    )
    assert config.optimizer_cpu_offload and config.optimizer_offload_fraction == fraction
    # What megatron-core's offload path needs: AdamW, the distributed optimizer, precision-aware
    # (the HybridDeviceOptimizer holds the fp32 master weights, the GPU keeps no copy).
    assert config.optimizer == "adam" and config.decoupled_weight_decay
    assert config.use_distributed_optimizer and config.use_precision_aware_optimizer
    assert config.use_precision_aware_optimizer_no_fp8_or_ds_fp8  # the path that reads decoupled_grad
    assert config.overlap_cpu_optimizer_d2h_h2d and config.pin_cpu_grads and config.pin_cpu_params


def test_build_optimizer_hands_those_settings_to_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.core.optimizer as megatron_optimizer

    seen = []
    optimizer = SimpleNamespace(scale_loss=lambda loss: loss)

    def get_megatron_optimizer(config, model):
        seen.append(config)
        return optimizer

    monkeypatch.setattr(megatron_optimizer, "get_megatron_optimizer", get_megatron_optimizer)
    model = SimpleNamespace(config=SimpleNamespace(), no_sync=lambda: None)
    config = PolicyConfig(dtype=torch.bfloat16, distributed_optimizer=True, optimizer_offload_fraction=1.0)
    assert build_optimizer([model], config) is optimizer
    assert seen[0].optimizer_cpu_offload and seen[0].optimizer_offload_fraction == 1.0
    assert model.config.grad_scale_func is optimizer.scale_loss


def _hybrid(cpu_params: list[torch.Tensor]) -> object:
    """A ``HybridDeviceOptimizer`` as megatron-core leaves one after a step with everything offloaded:
    a torch AdamW per fp32 host copy, its moments, the pinned gradient copies (not pinned here)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    hybrid = HybridDeviceOptimizer.__new__(HybridDeviceOptimizer)
    hybrid.cpu_optimizers = [torch.optim.AdamW([p]) for p in cpu_params]
    hybrid.gpu_optimizer = None
    hybrid.cpu_copy_map_grad = {}
    for p, adam in zip(cpu_params, hybrid.cpu_optimizers, strict=True):
        p.grad = hybrid.cpu_copy_map_grad[p] = torch.ones_like(p)
        adam.step()
    return hybrid


def test_state_bytes_counts_the_offloaded_state_as_host_memory() -> None:
    # The parameters on an accelerator (the meta device stands in for the GPU), fp32 host copies.
    module = torch.nn.Linear(8, 4, bias=False, device="meta", dtype=torch.bfloat16)
    host_copy = torch.zeros(32)
    hybrid = _hybrid([host_copy])
    optimizer = SimpleNamespace(optimizer=hybrid)
    counted = state_bytes(module, optimizer)
    # fp32 master, two moments, the gradient copy, 4 bytes each, and AdamW's 4-byte step.
    assert counted == {"parameters": 64, "gradients": 0, "optimizer": 0, "optimizer_host": 4 * 128 + 4}
    # The same tensors with the parameters on the CPU are the optimizer's own memory, not offloaded.
    on_cpu = state_bytes(torch.nn.Linear(8, 4, bias=False), optimizer)
    assert on_cpu["optimizer"] == 4 * 128 + 4 and on_cpu["optimizer_host"] == 0


def test_state_bytes_skips_views_of_the_parameters() -> None:
    # The precision-aware distributed optimizer steps views of the parameter buffer.
    module = torch.nn.Linear(8, 4, bias=False)
    view = next(module.parameters()).detach().view(-1)
    adam = torch.optim.AdamW([view])
    optimizer = SimpleNamespace(optimizer=adam, shard_fp32_from_float16_groups=[[view]])
    assert state_bytes(module, optimizer)["optimizer"] == 0


def test_the_planner_moves_the_offloaded_state_to_the_host() -> None:
    gpu = Hardware(nodes=1, gpus_per_node=1, gpu_memory_bytes=141 * GiB)
    kept = plan_placement(load_recipe(ONE_GPU), gpu).policy_memory
    assert kept.host_optimizer == 0
    half = plan_placement(load_recipe(ONE_GPU, ["train.optimizer_offload_fraction=0.5"]), gpu).policy_memory
    # One rank: the distributed optimizer shards nothing; half of 12 bytes a parameter moves, and the
    # host also holds fp32 copies of that half's gradients.
    assert half.optimizer == pytest.approx(kept.optimizer / 2, abs=1)
    assert half.host_optimizer == pytest.approx(kept.optimizer / 2 * (12 + 4) / 12, abs=1)
    assert half.total == pytest.approx(kept.total - kept.optimizer / 2, abs=1)
    for part in ("weights", "gradients", "activations"):
        assert getattr(half, part) == getattr(kept, part)


def test_the_h100_recipe_fits_an_80_gib_gpu_with_room() -> None:
    plan = plan_placement(load_recipe(H100), Hardware(nodes=1, gpus_per_node=1, gpu_memory_bytes=80 * GiB))
    need, _ = plan.policy_gpu_bytes()
    assert need <= 70 * GiB
    assert plan.policy_memory.optimizer == 0 and plan.policy_memory.host_optimizer > 50 * GiB
    assert plan.distributed_optimizer and plan.optimizer_offload_fraction == 1.0
    table = format_plan(plan)
    assert "100% of its state in host memory" in table and "host memory: optimizer 55.9" in table
