"""The policy as a Megatron-Core model, built from a Hugging Face checkpoint by Megatron-Bridge.

``AutoBridge.from_hf_pretrained(path)`` reads the checkpoint's config and weights,
``to_megatron_provider(load_weights=True)`` turns the config into a model provider that copies the
HF weights in after construction, and ``provide_distributed_model`` builds the model. All geometry
(layer sizes, heads, vocabulary, the vision tower's patch/merge/temporal sizes, multimodal RoPE
sections, special token ids) comes from the checkpoint. Supported: Qwen2.5-VL (HF vision tower,
Megatron GPT language model) and dense Qwen3-VL (megatron-core vision tower and language model with
DeepStack, built from local layers by :mod:`.qwen3_vl` when Transformer Engine is absent).

Call everything here with torch.distributed initialised (:func:`.cpu_support.single_process_group`)
and, on a host without CUDA, inside :func:`.cpu_support.cpu_execution`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from rl_bridge.megatron.cpu_support import cpu_execution_active, cpu_support_needed
from rl_bridge.megatron.mrope import use_reference_rope_index
from rl_bridge.megatron.qwen3_vl import QWEN3_VL_ARCHITECTURES, use_local_layers
from rl_bridge.megatron.te_standin import import_megatron_bridge, transformer_engine_installed

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.module import MegatronModule

__all__ = [
    "LayerSpec",
    "Recompute",
    "VisionAttention",
    "build_policy",
    "forward_logits",
    "hf_vocab_size",
    "load_bridge",
    "mrope_section",
    "vocab_parallel_logits",
]

LayerSpec = Literal["auto", "transformer_engine", "local", "local_sdpa"]
"""Implementation of the language model's transformer layers.

``transformer_engine``: Megatron-Bridge's default TE spec (needs TE). ``local``: megatron-core's
pure-PyTorch spec with its ``DotProductAttention`` (O(S^2) attention memory). ``local_sdpa``: the
local spec with :class:`~rl_bridge.megatron.attention.SDPADotProductAttention`.
``auto``: ``transformer_engine`` when TE is installed, else ``local_sdpa``.
"""

Recompute = Literal["none", "full"]
"""Activation recomputation in training. ``none``: keep every activation for the backward pass.
``full``: keep only each layer's input and recompute the layer in the backward pass (about one more
forward pass of compute for much less activation memory), for the language model's layers
(megatron-core's ``recompute_granularity="full"``, uniform, one layer per checkpoint) and the HF
vision tower's blocks (transformers' gradient checkpointing). CUDA only.
"""

VisionAttention = Literal["hf", "segment_batched"]
"""Attention core of the HF vision tower. ``hf``: transformers' own (without flash-attn, one
attention call per window or frame). ``segment_batched``:
:func:`~rl_bridge.megatron.vision_attention.segment_attention`, one call per window size; the same
function, far fewer kernel launches.
"""

_QWEN2_5_VL_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
_SUPPORTED_ARCHITECTURES = _QWEN2_5_VL_ARCHITECTURES + QWEN3_VL_ARCHITECTURES
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load_bridge(hf_path: str | Path) -> AutoBridge:
    """Megatron-Bridge's ``AutoBridge`` for the HF checkpoint directory ``hf_path``.

    The bridge also exports trained weights back in HF names (``export_hf_weights``).

    Raises:
        FileNotFoundError: ``hf_path`` has no ``config.json``.
        ValueError: the checkpoint's architecture is not supported.
    """
    path = Path(hf_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"load_bridge: {path} is not a Hugging Face checkpoint (no config.json)")
    bridge_module = import_megatron_bridge()
    bridge = bridge_module.AutoBridge.from_hf_pretrained(path)
    architectures = tuple(getattr(bridge.hf_pretrained.config, "architectures", None) or ())
    if not set(architectures) & set(_SUPPORTED_ARCHITECTURES):
        raise ValueError(
            f"load_bridge: {path} has architectures {list(architectures)}; "
            f"supported: {list(_SUPPORTED_ARCHITECTURES)}"
        )
    return bridge


def is_qwen3_vl(bridge: AutoBridge) -> bool:
    """Whether ``bridge`` holds a Qwen3-VL checkpoint (megatron-core vision tower, DeepStack)."""
    architectures = getattr(bridge.hf_pretrained.config, "architectures", None) or ()
    return bool(set(architectures) & set(QWEN3_VL_ARCHITECTURES))


def mrope_section(text_config: Any) -> list[int]:
    """The multimodal RoPE sections (temporal, height, width) of an HF Qwen-VL text config.

    They split ``head_dim / 2`` rotary frequencies between the three position axes. Read from
    ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` (earlier).

    Raises:
        ValueError: the config has no ``mrope_section`` or it does not sum to ``head_dim / 2``.
    """
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    section = rope.get("mrope_section")
    if not section:
        raise ValueError(f"mrope_section: the text config has no mrope_section in its RoPE parameters {rope}")
    head_dim = getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // text_config.num_attention_heads
    )
    if 2 * sum(section) != head_dim:
        raise ValueError(
            f"mrope_section: {list(section)} sums to {sum(section)}, but head_dim / 2 is {head_dim // 2}"
        )
    return [int(s) for s in section]


def _layer_spec(choice: LayerSpec) -> Any:
    """The provider's ``transformer_layer_spec`` for ``choice``, or ``None`` to keep its TE default."""
    te = transformer_engine_installed()
    if choice == "auto":
        choice = "transformer_engine" if te else "local_sdpa"
    if choice == "transformer_engine":
        if not te:
            raise ValueError("build_policy: layer_spec='transformer_engine', but TE is not installed")
        return None
    if choice == "local":
        from megatron.bridge.models.gpt_provider import local_layer_spec

        return local_layer_spec
    from rl_bridge.megatron.attention import sdpa_local_layer_spec

    return sdpa_local_layer_spec


def _require_runtime(caller: str) -> None:
    if not torch.distributed.is_initialized():
        raise RuntimeError(
            f"{caller}: torch.distributed is not initialised; "
            "use rl_bridge.megatron.cpu_support.single_process_group() or the trainer's launcher"
        )
    if cpu_support_needed() and not cpu_execution_active():
        raise RuntimeError(
            f"{caller}: CUDA is not available; run inside rl_bridge.megatron.cpu_support.cpu_execution()"
        )


def build_policy(
    hf_path: str | Path,
    *,
    dtype: torch.dtype,
    freeze_vision: bool = False,
    freeze_projector: bool = False,
    layer_spec: LayerSpec = "auto",
    ddp_config: DistributedDataParallelConfig | None = None,
    recompute: Recompute = "none",
    vision_attention: VisionAttention = "segment_batched",
) -> list[MegatronModule]:
    """Build the Megatron-Core policy from the HF checkpoint at ``hf_path``, weights loaded.

    Args:
        hf_path: HF checkpoint directory (config, safetensors).
        dtype: parameter and compute dtype: ``torch.float32``, ``torch.bfloat16`` or
            ``torch.float16`` (half precision wraps the model in Megatron's ``Float16Module``, which
            returns fp32 logits).
        freeze_vision: no gradients for the vision tower (patch embedding and blocks).
        freeze_projector: no gradients for the vision-to-language projector (the merger).
        layer_spec: the language model's layer implementation, see :data:`LayerSpec`.
        ddp_config: wrap each module in megatron-core's ``DistributedDataParallel`` with this
            config; ``None`` returns the unwrapped modules (logprob-only use, tests).
        recompute: activation recomputation in training, see :data:`Recompute`.
        vision_attention: the vision tower's attention core, see :data:`VisionAttention`.

    Returns:
        One module per virtual pipeline stage (a single module without virtual pipelining).
        Without CUDA, parameters live on the CPU; with CUDA, on the current device.

    Raises:
        ValueError: unsupported ``dtype``, ``layer_spec``, ``recompute``, ``vision_attention`` or
            checkpoint, or recomputation without CUDA.
        RuntimeError: torch.distributed is not initialised, or CUDA is unavailable and
            :func:`.cpu_support.cpu_execution` is not active.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"build_policy: dtype={dtype}; expected one of {[str(d) for d in _DTYPES]}")
    if layer_spec not in get_args(LayerSpec):
        raise ValueError(f"build_policy: layer_spec={layer_spec!r}; expected one of {get_args(LayerSpec)}")
    if recompute not in get_args(Recompute):
        raise ValueError(f"build_policy: recompute={recompute!r}; expected one of {get_args(Recompute)}")
    if vision_attention not in get_args(VisionAttention):
        raise ValueError(
            f"build_policy: vision_attention={vision_attention!r}; "
            f"expected one of {get_args(VisionAttention)}"
        )
    _require_runtime("build_policy")
    if recompute != "none" and cpu_support_needed():
        raise ValueError(
            f"build_policy: recompute={recompute!r} needs CUDA (megatron-core's recomputation saves and "
            "restores CUDA RNG states)"
        )
    bridge = load_bridge(hf_path)
    provider = bridge.to_megatron_provider(load_weights=True)
    # Megatron-Bridge 0.6 leaves the provider's default [16, 24, 24] (head_dim 128) in place.
    provider.mrope_section = mrope_section(bridge.hf_pretrained.config.text_config)
    spec = _layer_spec(layer_spec)
    qwen3 = is_qwen3_vl(bridge)
    if spec is not None:
        provider.transformer_layer_spec = spec
        if qwen3:
            use_local_layers(provider)
    from megatron.core import parallel_state

    # Each stage builds its share of the layers from the provider's pipeline size.
    pipeline = parallel_state.get_pipeline_model_parallel_world_size()
    provider.pipeline_model_parallel_size = pipeline
    if pipeline > 1 and provider.num_moe_experts:
        raise ValueError(
            f"build_policy: pipeline parallel size {pipeline} with MoE layers is not supported "
            "(their all-gather token dispatcher needs one sequence length for every micro-batch)"
        )
    provider.freeze_vision_model = freeze_vision
    provider.freeze_vision_projection = freeze_projector
    if recompute == "full":
        provider.recompute_granularity = "full"
        provider.recompute_method = "uniform"
        provider.recompute_num_layers = 1
    provider.finalize()
    # Stages exchange activations of each micro-batch's own length: the schedule sends their
    # shapes first (set after finalize(), whose check concerns MoE dispatchers only).
    provider.variable_seq_lengths = pipeline > 1

    on_cpu = cpu_support_needed()
    # Megatron-Bridge's own DDP wrapper creates CUDA streams; on CPU the modules are wrapped here.
    model = provider.provide_distributed_model(
        ddp_config=ddp_config,
        wrap_with_ddp=ddp_config is not None and not on_cpu,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=on_cpu,
    )
    if ddp_config is not None and on_cpu:
        model = _wrap_ddp_on_cpu(model, ddp_config)
    for module in model:
        if qwen3:
            continue  # its megatron-core vision tower attends per frame already; recomputed with the LM
        # Text after a video continues past the video's temporal positions, as vLLM and the released
        # model place it (transformers 5's get_rope_index does not).
        use_reference_rope_index(module)
        if not parallel_state.is_pipeline_first_stage():
            continue  # the vision tower lives on the first pipeline stage
        if vision_attention == "segment_batched":
            from rl_bridge.megatron.vision_attention import use_segment_batched_vision_attention

            use_segment_batched_vision_attention(module)
        if recompute == "full":
            _checkpoint_vision_blocks(module)
    return model


def _checkpoint_vision_blocks(module: torch.nn.Module) -> None:
    """Turn on transformers' gradient checkpointing (non-reentrant) in the HF vision tower of ``module``."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    towers = [m for m in module.modules() if isinstance(m, Qwen2_5_VisionTransformerPretrainedModel)]
    if not towers:
        raise ValueError(
            f"build_policy: recompute='full', but {type(module).__name__} has no HF vision tower"
        )
    for tower in towers:
        tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _wrap_ddp_on_cpu(
    model: list[MegatronModule], ddp_config: DistributedDataParallelConfig
) -> list[MegatronModule]:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.utils import get_model_config

    return [
        DistributedDataParallel(config=get_model_config(module), ddp_config=ddp_config, module=module)
        for module in model
    ]


def hf_vocab_size(model: list[MegatronModule]) -> int:
    """The checkpoint's vocabulary size (Megatron pads its embedding and output layer beyond it)."""
    from megatron.core.utils import get_model_config

    return int(get_model_config(model[0]).vocab_size)


def vocab_parallel_logits(module: torch.nn.Module) -> bool:
    """Whether the GPT language model inside ``module`` returns logits sharded over the vocabulary.

    Raises:
        RuntimeError: ``module`` holds no (or more than one) megatron-core ``GPTModel``.
    """
    from megatron.core.models.gpt import GPTModel

    language_models = [m for m in module.modules() if isinstance(m, GPTModel)]
    if len(language_models) != 1:
        raise RuntimeError(
            f"MegatronPolicy: expected one megatron-core GPTModel in {type(module).__name__}, "
            f"found {len(language_models)}"
        )
    return bool(language_models[0].parallel_output)


def forward_logits(
    model: list[MegatronModule],
    *,
    input_ids: torch.Tensor,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token logits of the policy for a batch of prompts, as the HF processor produces them.

    Args:
        input_ids: ``[B, S]`` token ids with the processor's video/image placeholder tokens;
            sequences are causal, so right padding does not change earlier positions.
        pixel_values_videos: ``[video patches, C * temporal_patch * patch * patch]``, all videos of
            the batch concatenated; ``None`` when there is no video.
        video_grid_thw: ``[videos, 3]`` patch grid (frames / temporal patch, height, width).
        second_per_grid_ts: ``[videos]`` seconds per temporal grid step, which scales the temporal
            RoPE positions; pass the processor's value (``None`` means 1.0 s, transformers' default).
        pixel_values: image patches, like ``pixel_values_videos``; ``None`` when there is no image.
        image_grid_thw: ``[images, 3]`` patch grid of the images.

    Returns:
        ``[B, S, V]`` float logits, ``V`` the checkpoint's vocabulary size (padding sliced off).
        With tensor parallelism each rank holds its vocabulary shard ``[B, S, V_padded / TP]``
        instead (:func:`.logprobs.token_logprobs` takes it with the TP group). Gradients flow
        when called with grad enabled. Multimodal RoPE positions are computed by the model from
        ``input_ids`` and the grids. The single-stage model (no pipelining) only.
    """
    if len(model) != 1:
        raise ValueError(f"forward_logits: expects one model chunk (no virtual pipeline), got {len(model)}")
    _require_runtime("forward_logits")
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError(
            "forward_logits: one pipeline stage only (a stage's model returns hidden states, not logits); "
            "MegatronPolicy.logprobs runs the pipeline schedule"
        )
    if input_ids.dim() != 2:
        raise ValueError(
            f"forward_logits: input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}"
        )
    device = next(model[0].parameters()).device
    multimodal = {
        "pixel_values_videos": pixel_values_videos,
        "video_grid_thw": video_grid_thw,
        "second_per_grid_ts": second_per_grid_ts,
        "pixel_values": pixel_values,
        "image_grid_thw": image_grid_thw,
    }
    kwargs = {name: t.to(device) for name, t in multimodal.items() if t is not None}
    logits = model[0](input_ids=input_ids.to(device), position_ids=None, attention_mask=None, **kwargs)
    return logits[..., : hf_vocab_size(model)]
