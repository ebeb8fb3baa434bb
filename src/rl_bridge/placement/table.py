"""The plan as ``video-grpo plan`` prints it."""

from __future__ import annotations

from rl_bridge.placement.hardware import GiB
from rl_bridge.placement.plan import Plan

__all__ = ["format_plan"]


def format_plan(plan: Plan) -> str:
    """The plan as a readable table: role, replica/rank, devices, parallel group, memory (GiB)."""
    shape = plan.shape
    optimizer = "distributed optimizer" if plan.distributed_optimizer else "replicated optimizer"
    if plan.optimizer_offload_fraction:
        optimizer += f", {plan.optimizer_offload_fraction:.0%} of its state in host memory"
    lines = [
        f"placement: {plan.placement}    hardware: {plan.hardware.describe()}",
        f"model: {_count(shape.language_parameters)} language"
        + (f" ({_count(shape.expert_parameters)} in experts)" if shape.expert_parameters else "")
        + f" + {_count(shape.vision_parameters)} vision parameters ({shape.source})",
        f"       {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_attention_heads} "
        f"attention / {shape.num_key_value_heads} KV heads, vocabulary {shape.vocab_size}",
        f"vLLM: {len(plan.vllm)} replica(s) x TP {plan.vllm[0].tensor_parallel}    policy: "
        f"TP {plan.tensor_parallel} x PP {plan.pipeline_parallel} x DP {plan.data_parallel}, "
        f"EP {plan.expert_parallel}, {optimizer}"
        + ("    reference policy on the policy ranks" if plan.reference else ""),
        "",
    ]
    rows = [("role", "replica/rank", "devices", "parallel group", "memory GiB")]
    vllm_gib, policy_gib = f"{plan.vllm_memory.total / GiB:.1f}", f"{plan.policy_memory.total / GiB:.1f}"
    for replica in plan.vllm:
        devices = " ".join(map(str, replica.devices)) or "cpu"
        rows.append(("vllm", f"replica {replica.index}", devices, f"TP {replica.tensor_parallel}", vllm_gib))
    for rank in plan.policy:
        device = str(rank.device or "cpu")
        rows.append(("policy", f"rank {rank.rank}", device, _groups_of(plan, rank.rank), policy_gib))
    if plan.reference_memory is not None:
        ranks = f"ranks 0-{len(plan.policy) - 1}" if len(plan.policy) > 1 else "rank 0"
        gib = f"{plan.reference_memory.total / GiB:.1f}"
        rows.append(("reference", ranks, "the policy ranks'", "as the policy", gib))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        lines.append("  ".join(cells).rstrip())
    lines += ["", f"vllm (per device):   {plan.vllm_memory.describe()}"]
    lines.append(f"policy (per device): {plan.policy_memory.describe()}")
    if plan.reference_memory is not None:
        lines.append(f"reference:           {plan.reference_memory.describe()}")
    if plan.placement != "cpu":
        need, breakdown = plan.policy_gpu_bytes()
        lines.append(
            f"a policy GPU holds {need / GiB:.1f} of {plan.hardware.gpu_memory_bytes / GiB:.1f} GiB "
            f"({breakdown})"
        )
    return "\n".join(lines)


def _groups_of(plan: Plan, rank: int) -> str:
    """The parallel groups ``rank`` belongs to: TP always, the others when larger than 1."""
    named = (
        ("TP", plan.tensor_parallel, plan.tensor_groups),
        ("DP", plan.data_parallel, plan.data_groups),
        ("PP", plan.pipeline_parallel, plan.pipeline_groups),
        ("EP", plan.expert_parallel, plan.expert_groups),
    )
    return "  ".join(
        f"{name} [{' '.join(map(str, group))}]"
        for name, size, groups in named
        if size > 1 or name == "TP"
        for group in groups
        if rank in group
    )


def _count(parameters: int) -> str:
    """``3.09 B``, ``1.68 M``: a parameter count to read."""
    return f"{parameters / 1e9:.2f} B" if parameters >= 1e8 else f"{parameters / 1e6:.2f} M"
