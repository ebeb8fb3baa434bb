"""Qwen3-VL (dense and MoE) through Megatron-Bridge without Transformer Engine.

Megatron-Bridge 0.6.2 has Qwen3-VL (``Qwen3VLBridge``, ``modelling_qwen3_vl``): a megatron-core
language model with DeepStack (vision features of early vision blocks added into the first text
layers) and interleaved multimodal RoPE, and a megatron-core vision tower. Its model code builds
both with Transformer Engine layers and no way to ask for anything else:

* ``Qwen3VLModelProvider.provide`` takes the language layers from
  ``get_gpt_layer_with_transformer_engine_spec``;
* ``Qwen3VLModel.__init__`` takes the vision layers from
  ``get_vit_layer_with_transformer_engine_spec`` and builds the patch mergers from ``TENorm``,
  ``TEColumnParallelLinear`` and ``TERowParallelLinear`` (names that import without TE and fail
  when instantiated).

:func:`provide_without_te` builds the same ``Qwen3VLModel`` from megatron-core's local layers:
the language model from :func:`~rl_bridge.megatron.attention.sdpa_local_layer_spec` (with QK
norms), the vision tower from the local ViT spec with torch norms and
:class:`~rl_bridge.megatron.attention.SDPADotProductAttention`, which takes the tower's packed
(THD) frames and attends within each frame, and the mergers from torch norms and megatron-core's
own parallel linears. Parameter names then differ from the TE ones only where Megatron-Bridge's
mapping registry already translates them (``input_layernorm`` for
``linear_qkv.layer_norm_weight``, ``pre_mlp_layernorm`` for ``linear_fc1.layer_norm_weight``), so
loading and exporting HF weights is the bridge's own. Tensor parallelism works as in the TE build
(the local linears are the same column/row split); sequence parallelism does not (torch norms).

``Qwen3VLSelfAttention`` sends every megatron-core ``DotProductAttention`` (the local spec's, and
ours, a subclass) to its own fallback, which materialises fp32 ``[batch, heads, seq, seq]`` scores
and probabilities: gigabytes per layer at video lengths. The language layers built here compute
the same causal attention with ``scaled_dot_product_attention`` instead (flash or memory-efficient
kernels on GPUs); the fallback stays for the query-shorter-than-key case it also serves.

Qwen3-VL MoE builds the same way, its experts as megatron-core's ``SequentialMLP`` (no grouped
GEMM, which needs TE): correct, and slow at real expert counts (one GEMM per expert); that, and
expert parallelism over it, is what stands between this and a 30B-A3B run without TE.

One correction to the model itself: Megatron-Bridge's patch mergers (the final merger and the
DeepStack mergers) apply the vision blocks' tanh-approximated GELU, where HF transformers and vLLM
apply the exact GELU (``nn.GELU()``). With random weights that alone moves the logits by about
1e-4; :func:`provide_without_te` gives the mergers the exact GELU, so the policy computes what vLLM
samples from.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from rl_bridge.megatron.te_standin import import_megatron_bridge

__all__ = ["QWEN3_VL_ARCHITECTURES", "provide_without_te", "use_local_layers"]

QWEN3_VL_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")


def _vision_layer_spec() -> Any:
    """megatron-core's local ViT layer spec with torch norms and the SDPA core attention."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from rl_bridge.megatron.attention import SDPADotProductAttention

    spec = copy.deepcopy(get_vit_layer_with_local_spec())
    spec.submodules.input_layernorm = WrappedTorchNorm
    spec.submodules.pre_mlp_layernorm = WrappedTorchNorm
    spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention
    return spec


@contextmanager
def _local_vision_modules() -> Iterator[None]:
    """While active, ``Qwen3VLModel.__init__`` builds its vision tower and mergers from local layers.

    It reads the four names below from its module's globals at construction time; they are swapped
    for local equivalents and restored on exit (construction only: nothing is looked up later).
    """
    import_megatron_bridge()
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as qwen3_vl_model
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    local = {
        "get_vit_layer_with_transformer_engine_spec": _vision_layer_spec,
        "TENorm": WrappedTorchNorm,
        "TEColumnParallelLinear": ColumnParallelLinear,
        "TERowParallelLinear": RowParallelLinear,
    }
    saved = {name: getattr(qwen3_vl_model, name) for name in local}
    for name, value in local.items():
        setattr(qwen3_vl_model, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(qwen3_vl_model, name, value)


def provide_without_te(
    provider: Any,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
) -> Any:
    """``Qwen3VLModelProvider.provide`` with local layers: the same model, no Transformer Engine.

    Args:
        provider: a finalised ``Qwen3VLModelProvider`` (dense; its ``transformer_layer_spec`` is
            the language layer spec, a spec or a function of the provider).
        pre_process, post_process, vp_stage: as ``provide``.
    """
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model import Qwen3VLModel

    if provider.sequence_parallel:
        raise ValueError("provide_without_te: sequence parallelism needs Transformer Engine's norms")
    spec = provider.transformer_layer_spec
    if isinstance(spec, types.FunctionType):
        spec = spec(provider)
    with _local_vision_modules():
        model = Qwen3VLModel(
            language_transformer_config=provider,
            language_transformer_layer_spec=copy.deepcopy(spec),
            vision_transformer_config=provider.vision_config,
            pre_process=True if pre_process is None else pre_process,
            post_process=True if post_process is None else post_process,
            pg_collection=provider._pg_collection,
            add_encoder=provider.add_encoder,
            add_decoder=provider.add_decoder,
        )
    _exact_gelu_in_mergers(model)
    _sdpa_causal_language_attention(model)
    if provider.freeze_language_model or provider.freeze_vision_model or provider.freeze_vision_projection:
        model.freeze(
            freeze_language_model=provider.freeze_language_model,
            freeze_vision_model=provider.freeze_vision_model,
            freeze_vision_projection=provider.freeze_vision_projection,
        )
    return model


def _exact_gelu_in_mergers(model: Any) -> None:
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import Qwen3VLVisionPatchMerger

    for module in model.modules():
        if isinstance(module, Qwen3VLVisionPatchMerger):
            module.activation_func = functools.partial(F.gelu, approximate="none")


def _sdpa_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """``Qwen3VLSelfAttention._local_causal_attention`` through SDPA: ``[s, b, heads, d]`` in,
    ``[s, b, heads * d]`` out, causal, grouped-query heads shared."""
    if query.shape[0] != key.shape[0]:
        from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.attention import Qwen3VLSelfAttention

        return Qwen3VLSelfAttention._local_causal_attention(query, key, value, scale)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    context = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _sdpa_causal_language_attention(model: Any) -> None:
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.attention import Qwen3VLSelfAttention

    if model.language_model is None:
        return
    for module in model.language_model.modules():
        if isinstance(module, Qwen3VLSelfAttention):
            module._local_causal_attention = _sdpa_causal


def use_local_layers(provider: Any) -> None:
    """Make ``provider`` (a ``Qwen3VLModelProvider`` or ``Qwen3VLMoEModelProvider``, not yet
    finalised) build with :func:`provide_without_te`.

    For MoE it also turns off what needs TE in the expert layers: grouped GEMM (the local spec then
    builds megatron-core's ``SequentialMLP``, one MLP per local expert, which Megatron-Bridge maps to
    the HF experts like the grouped layout), the fused permutation and Apex's persistent norms, and
    the router's load-balancing loss (coefficient 0: the loss is the documented GRPO objective).
    And it trains the language model and vision tower: the MoE provider freezes both by default,
    the build's ``freeze_*`` arguments decide instead.
    """
    provider.provide = types.MethodType(provide_without_te, provider)
    if getattr(provider, "num_moe_experts", None):
        provider.moe_grouped_gemm = False
        provider.moe_permute_fusion = False
        if not torch.cuda.is_available():
            # The all-to-all dispatcher creates a CUDA stream at construction; all-gather routes
            # the same tokens to the same experts without one.
            provider.moe_token_dispatcher_type = "allgather"
        # The GRPO objective as documented: no load-balancing term is added to its gradient.
        provider.moe_aux_loss_coeff = 0.0
    provider.persist_layer_norm = False  # Apex's persistent LayerNorm kernel; torch norms here
    provider.freeze_language_model = False
