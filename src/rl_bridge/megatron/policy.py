"""The trainable policy: a Megatron-Core model with its optimizer, driven like an RL policy worker.

:class:`MegatronPolicy` is built from a Hugging Face checkpoint (through Megatron-Bridge's
``AutoBridge``) and offers what a GRPO loop asks of the policy:

* :meth:`~MegatronPolicy.logprobs`: per-token log-probabilities of given sequences, forward-only
  through megatron-core's forward-backward schedule;
* :meth:`~MegatronPolicy.train_step`: one optimizer step on a batch through the same schedule
  (micro-batches, gradient accumulation, DDP gradient reduction, Megatron's optimizer), with the
  loss supplied by the caller (:class:`PolicyLoss`);
* :meth:`~MegatronPolicy.export_hf_weights` / :meth:`~MegatronPolicy.save_hf_checkpoint`: the
  current weights under their HF names, streamed or written as a directory vLLM can load;
* :meth:`~MegatronPolicy.save_checkpoint` / :meth:`~MegatronPolicy.load_checkpoint`: model,
  optimizer, step counter and RNG state, so training resumes exactly.

Parallelism: tensor, pipeline and data parallelism as set up in megatron-core's parallel state
(each data-parallel rank passes its own share of the batch; every tensor- and pipeline-parallel
rank of a replica the same share); no context parallelism, no sequence packing (samples are
right-padded per micro-batch). Under tensor parallelism the language model's layers and output
layer are sharded (logprobs use the vocabulary-parallel path of :func:`.logprobs.token_logprobs`)
and the HF vision tower is replicated. Under pipeline parallelism the first stage holds the vision
tower, the projector and the embedding, the last the output layer; megatron-core's 1F1B schedule
passes activations between stages (their shapes with them, as micro-batches differ in length),
the last stage computes logprobs and losses and hands them to the other stages, so every rank
returns the same results. Exports gather full HF tensors on every rank, and training checkpoints
are per rank. All methods are collective over the ranks of the model. Use it with torch.distributed
and Megatron's parallel state initialised (:func:`.distributed.model_parallel_group` under
torchrun, :func:`.cpu_support.single_process_group` for one process) and, on a host without CUDA,
inside :func:`.cpu_support.cpu_execution` (see :func:`.model.build_policy`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rl_bridge.grpo import GRPOLossConfig, grpo_loss, loss_denominator
from rl_bridge.megatron.batch import MediaTokens, MicroBatch, PolicySample, collate
from rl_bridge.megatron.cpu_support import cpu_support_needed
from rl_bridge.megatron.logprobs import token_logprobs
from rl_bridge.megatron.model import (
    LayerSpec,
    Recompute,
    VisionAttention,
    build_policy,
    hf_vocab_size,
    load_bridge,
)
from rl_bridge.structured_outputs import unpack_bitmask

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.transformer.module import MegatronModule

__all__ = ["GRPOPolicyLoss", "MegatronPolicy", "PolicyConfig", "PolicyLoss", "StepCounts", "TrainStepMetrics"]

_CHECKPOINT_FORMAT = 1
_CHECKPOINT_META = "meta.json"
# Files of an HF checkpoint that hold weights; everything else (config, tokenizer, processor,
# chat template, generation config, remote code) is copied next to exported weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class StepCounts:
    """Sizes of a whole training step's batch (all micro-batches, all data-parallel ranks).

    Only samples with a positive ``loss_weight`` count: they are the ones the loss averages over.
    """

    num_target_tokens: int
    """Target tokens."""
    num_target_sequences: int
    """Samples with at least one target token."""
    normalizer: float
    """The sum of the loss's :meth:`PolicyLoss.denominator` over every micro-batch of the step on
    every data-parallel rank: what each micro-batch's part is divided by."""


class PolicyLoss(Protocol):
    """The training objective, evaluated one micro-batch at a time (e.g. the GRPO loss).

    A loss with a true ``wants_entropy`` attribute is also given ``entropy=``: ``[B, S]`` fp32
    entropies of the current policy at each target position (with gradient; zero elsewhere).
    """

    def denominator(self, batch: MicroBatch) -> float:
        """This micro-batch's share of the step's normaliser (e.g. its weighted target tokens).

        The policy sums it over the step's micro-batches and data-parallel ranks before the first
        forward and passes the sum as :attr:`StepCounts.normalizer`, so numerator and
        denominator run over the same tokens whatever the split.
        """
        ...

    def __call__(
        self, logprobs: torch.Tensor, mask: torch.Tensor, batch: MicroBatch, counts: StepCounts
    ) -> tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]:
        """This micro-batch's part of the step's loss, given the current policy's log-probabilities.

        Args:
            logprobs: ``[B, S]`` fp32 log-probabilities of ``batch.input_ids`` under the current
                policy (with gradient), aligned like every per-token field: ``logprobs[b, t]`` is
                ``log p(input_ids[b, t] | input_ids[b, :t])``; zero where ``mask`` is false.
            mask: ``[B, S]`` bool, ``batch.target_mask``: the positions to train on. At least one
                is true (micro-batches without targets are not passed to the loss).
            batch: the micro-batch (advantages, loss weights, old/behaviour/reference logprobs).
            counts: the step's batch sizes and normaliser.

        Returns:
            The loss part, a scalar with gradient, such that the parts of all micro-batches (and
            data-parallel ranks) **sum** to the step's loss: the part's numerator divided by
            ``counts.normalizer``. Then scalar metrics (detached tensors or floats), each a mean
            over this micro-batch's trained tokens (targets of samples with a positive weight),
            which the step averages with those token counts as weights; a name ending in ``_max``
            is a maximum instead, and the step reports the largest.
        """
        ...


class GRPOPolicyLoss:
    """:func:`rl_bridge.grpo.grpo_loss` as a :class:`PolicyLoss`.

    Takes each micro-batch's ``old_logprobs``, ``behaviour_logprobs``, ``ref_logprobs``,
    advantages and loss weights; the denominator is :func:`rl_bridge.grpo.loss_denominator` of the
    config's aggregation, so the micro-batch parts sum to the batch loss. Metrics: those of
    ``grpo_loss`` except the additive ``loss/total``, ``loss/pg`` and ``tokens/valid`` (the step
    reports its loss and token counts itself) and the per-sequence mean
    ``mismatch/seq_mult_prob_error`` (not a token mean).
    """

    _LEFT_OUT = ("loss/total", "loss/pg", "tokens/valid", "mismatch/seq_mult_prob_error")

    #: The entropy is always taken: for ``loss/entropy``, and for the bonus when ``entropy_coef > 0``.
    wants_entropy = True

    def __init__(self, config: GRPOLossConfig) -> None:
        self.config = config

    def denominator(self, batch: MicroBatch) -> float:
        return float(loss_denominator(batch.target_mask, batch.loss_weights, self.config))

    def __call__(
        self,
        logprobs: torch.Tensor,
        mask: torch.Tensor,
        batch: MicroBatch,
        counts: StepCounts,
        *,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if entropy is not None and not self.config.entropy_coef > 0:
            entropy = entropy.detach()  # the metric only
        loss, metrics = grpo_loss(
            logprobs,
            batch.advantages,
            mask,
            self.config,
            old_logprobs=batch.old_logprobs,
            behaviour_logprobs=batch.behaviour_logprobs,
            ref_logprobs=batch.ref_logprobs,
            sample_weights=batch.loss_weights,
            normalizer=counts.normalizer,
            entropy=entropy,
        )
        return loss, {name: value for name, value in metrics.items() if name not in self._LEFT_OUT}


@dataclass(frozen=True)
class PolicyConfig:
    """How the policy is built and optimised."""

    dtype: torch.dtype = torch.float32
    """Parameter and compute dtype (``float32``, ``bfloat16`` or ``float16``); the optimizer keeps
    fp32 master weights for the half-precision ones."""
    learning_rate: float = 1e-6
    """Adam learning rate (constant)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Maximum global L2 norm of the gradient (megatron-core's ``clip_grad``, on CPU as on GPUs); 0
    turns clipping off."""
    micro_batch_size: int = 1
    """Samples per forward pass; a batch is split into ``ceil(len(batch) / micro_batch_size)``
    micro-batches whose gradients are accumulated."""
    temperature: float = 1.0
    """Logits are divided by it before the softmax, in :meth:`MegatronPolicy.logprobs` and in
    training. Use the rollouts' sampling temperature when the rollout engine reports logprobs after
    temperature (vLLM's ``processed_logprobs``), 1.0 with its default ``raw_logprobs``."""
    token_support: tuple[int, ...] | None = None
    """Token ids the rollout engine's sampling was restricted to (vLLM ``allowed_token_ids``):
    logprobs are those of the softmax over these tokens only, the distribution the tokens were
    sampled from (vLLM's ``processed_logprobs``); ``None``: the whole vocabulary."""
    freeze_vision: bool = False
    """No updates to the vision tower (patch embedding and blocks)."""
    freeze_projector: bool = False
    """No updates to the vision-to-language projector (merger)."""
    layer_spec: LayerSpec = "auto"
    """The language model's layer implementation (see :data:`.model.LayerSpec`)."""
    recompute: Recompute = "none"
    """Activation recomputation in training (see :data:`.model.Recompute`)."""
    vision_attention: VisionAttention = "segment_batched"
    """The vision tower's attention core (see :data:`.model.VisionAttention`); ``segment_batched``
    is the same function with far fewer kernel launches (GPU)."""
    fused_kernels: bool = True
    """On CUDA: the elementwise work (RoPE, SwiGLU, norms, the vision tower's rotary embedding and
    MLP activations) fused by ``torch.compile`` (:func:`.fusion.fuse_elementwise`), the language
    model's weight gradients accumulated in fp32 by their GEMMs
    (:func:`.fusion.fuse_weight_gradient_accumulation`), and torch's fused Adam kernel for the fp32
    master weights. The same functions, rounded differently in the last bits. No effect on CPU."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer: the fp32 master weights and Adam's moments sharded over
    the data-parallel ranks (gradients reduce-scattered, parameters all-gathered after the step),
    the optimizer's memory divided by the data-parallel size. Same update as the replicated one."""
    trainable: bool = True
    """``False``: a forward-only policy, such as the frozen reference of a KL term: no DDP gradient
    buffers, no optimizer, parameters in ``dtype`` without gradients (``dtype``'s bytes per
    parameter instead of about 16); :meth:`MegatronPolicy.train_step` and checkpoints refuse."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"PolicyConfig: micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if not self.temperature > 0:
            raise ValueError(f"PolicyConfig: temperature must be > 0, got {self.temperature}")
        if self.token_support is not None and not self.token_support:
            raise ValueError("PolicyConfig: token_support must hold at least one token id (or be None)")
        if self.learning_rate < 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise ValueError(
                f"PolicyConfig: learning_rate={self.learning_rate}, weight_decay={self.weight_decay} and "
                f"clip_grad={self.clip_grad} must be >= 0"
            )


@dataclass(frozen=True)
class TrainStepMetrics:
    """What one :meth:`MegatronPolicy.train_step` did, summed or averaged over data-parallel ranks."""

    step: int
    """Training steps taken so far, this one included (a step skipped by the optimizer counts)."""
    loss: float
    """The step's loss: the sum of the loss parts of all micro-batches (before the update)."""
    grad_norm: float | None
    """Global L2 norm of the gradient before clipping; ``None`` when the optimizer did not compute it."""
    learning_rate: float
    num_samples: int
    num_target_tokens: int
    """Target positions (those of samples with zero loss weight included)."""
    num_tokens: int
    """Unpadded tokens forwarded."""
    update_skipped: bool
    """The optimizer skipped the update (fp16 loss-scale overflow)."""
    loss_metrics: dict[str, float] = field(default_factory=dict)
    """Token-weighted means (maxima for ``*_max``) of the metrics returned by the loss."""
    logprobs: list[torch.Tensor] | None = None
    """With ``train_step(..., return_logprobs=True)``: this rank's samples' logprobs from the
    step's forward pass, before the update (layout of :meth:`MegatronPolicy.logprobs`); with one
    optimizer step per rollout batch they are ``pi_old``, with no separate pass."""

    def as_dict(self) -> dict[str, float]:
        """Flat ``train/...`` scalars for a logger (``grad_norm`` left out when unknown)."""
        out = {
            "train/step": float(self.step),
            "train/loss": self.loss,
            "train/learning_rate": self.learning_rate,
            "train/num_samples": float(self.num_samples),
            "train/num_target_tokens": float(self.num_target_tokens),
            "train/num_tokens": float(self.num_tokens),
            "train/update_skipped": float(self.update_skipped),
        }
        if self.grad_norm is not None:
            out["train/grad_norm"] = self.grad_norm
        out.update({f"train/{name}": value for name, value in self.loss_metrics.items()})
        return out


class MegatronPolicy:
    """A Megatron-Core policy built from an HF checkpoint, with DDP and Megatron's Adam optimizer.

    Args:
        hf_path: HF checkpoint directory (config, safetensors, tokenizer/processor files).
        config: model and optimizer settings.

    Raises:
        ValueError: unsupported checkpoint or settings.
        RuntimeError: the runtime is not set up (see the module docstring) or uses context
            parallelism.
    """

    def __init__(self, hf_path: str | Path, config: PolicyConfig | None = None) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallelConfig

        self.config = config or PolicyConfig()
        self.hf_path = Path(hf_path)
        if parallel_state.get_context_parallel_world_size() != 1:
            raise RuntimeError(
                "MegatronPolicy: context parallelism needs sequence packing, which is not supported"
            )
        self._bridge = load_bridge(self.hf_path)
        self._weight_syncs: dict[str, Any] = {}
        """Per vLLM server (its base URL): the weight-transfer group joined by :meth:`connect_vllm`."""
        half = self.config.dtype in (torch.bfloat16, torch.float16)
        self._model: list[MegatronModule] = build_policy(
            self.hf_path,
            dtype=self.config.dtype,
            freeze_vision=self.config.freeze_vision,
            freeze_projector=self.config.freeze_projector,
            layer_spec=self.config.layer_spec,
            ddp_config=(
                DistributedDataParallelConfig(
                    grad_reduce_in_fp32=half, use_distributed_optimizer=self.config.distributed_optimizer
                )
                if self.config.trainable
                else None
            ),
            recompute=self.config.recompute,
            vision_attention=self.config.vision_attention,
        )
        if len(self._model) != 1:
            raise RuntimeError(f"MegatronPolicy: expected one model chunk, got {len(self._model)}")
        self._optimizer: MegatronOptimizer | None = None
        if self.config.trainable:
            self._build_optimizer()
        if self.config.fused_kernels:
            self.fuse_kernels()
        if not self.config.trainable:
            for parameter in self._model[0].parameters():
                parameter.requires_grad_(False)
            self._model[0].eval()

        hf_config = self._bridge.hf_pretrained.config
        text_config = hf_config.text_config
        self.vocab_size = hf_vocab_size(self._model)
        """Real vocabulary size (Megatron's padded columns excluded)."""
        self.media_tokens = MediaTokens(
            video_token_id=int(hf_config.video_token_id),
            image_token_id=int(hf_config.image_token_id),
            spatial_merge_size=int(hf_config.vision_config.spatial_merge_size),
        )
        pad = text_config.pad_token_id if text_config.pad_token_id is not None else text_config.eos_token_id
        self.pad_token_id = int(pad[0] if isinstance(pad, (list, tuple)) else pad)
        """Token id written at right-padding positions (the checkpoint's pad, else its EOS token)."""
        # megatron-core's output layer leaves the logits sharded over the vocabulary across
        # tensor-parallel ranks unless the language model gathers them (parallel_output=False).
        self._logits_tp_group = (
            parallel_state.get_tensor_model_parallel_group()
            if parallel_state.get_tensor_model_parallel_world_size() > 1
            and _vocab_parallel_logits(self._model[0])
            else None
        )
        self._step = 0
        self._device = next(self._model[0].parameters()).device
        self._token_support = (
            torch.tensor(self.config.token_support, dtype=torch.long, device=self._device)
            if self.config.token_support is not None
            else None
        )

    def _build_optimizer(self) -> None:
        """Megatron's Adam over the trainable parameters, and the hooks megatron-core's schedule
        calls around the backward passes (as Megatron-LM sets them up)."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.utils import get_model_config

        from rl_bridge.megatron.multi_tensor import use_foreach_multi_tensor

        use_foreach_multi_tensor()  # norm, clipping and master-weight copy in a few kernels, not per tensor
        beta1, beta2 = self.config.adam_betas
        optimizer_config = OptimizerConfig(
            optimizer="adam",
            lr=self.config.learning_rate,
            weight_decay=self.config.weight_decay,
            adam_beta1=beta1,
            adam_beta2=beta2,
            adam_eps=self.config.adam_eps,
            clip_grad=self.config.clip_grad,
            bf16=self.config.dtype == torch.bfloat16,
            fp16=self.config.dtype == torch.float16,
            params_dtype=self.config.dtype,
            use_distributed_optimizer=self.config.distributed_optimizer,
        )
        self._optimizer = get_megatron_optimizer(optimizer_config, self._model)
        model_config = get_model_config(self._model[0])
        model_config.grad_scale_func = self._optimizer.scale_loss
        model_config.no_sync_func = self._model[0].no_sync
        model_config.finalize_model_grads_func = finalize_model_grads

    def fuse_kernels(self) -> dict[str, int]:
        """Fuse the elementwise regions (:func:`.fusion.fuse_elementwise`), accumulate the language
        model's weight gradients inside their GEMMs (:func:`.fusion.fuse_weight_gradient_accumulation`)
        and switch torch's Adam to its fused kernel (megatron-core falls back to torch's ``AdamW``
        without Apex or Transformer Engine, in its multi-tensor ``foreach`` form). CUDA only; returns
        what was changed (empty on CPU)."""
        from rl_bridge.megatron.fusion import fuse_elementwise, fuse_weight_gradient_accumulation

        changed = fuse_elementwise(self._model[0])
        if changed and self._optimizer is not None:
            if fused_wgrad := fuse_weight_gradient_accumulation(self._model[0]):
                changed["wgrad_accumulation"] = fused_wgrad
            for inner in getattr(self._optimizer, "chained_optimizers", [self._optimizer]):
                adam = inner.optimizer
                if isinstance(adam, torch.optim.Adam | torch.optim.AdamW):
                    for group in adam.param_groups:
                        group.update(fused=True, foreach=False)
                        for parameter in group["params"]:  # the fused kernel keeps steps on the device
                            state = adam.state.get(parameter, {})
                            if "step" in state:
                                state["step"] = state["step"].to(parameter.device, torch.float32)
                    changed["fused_adam"] = changed.get("fused_adam", 0) + 1
        return changed

    def _require_trainable(self, what: str) -> MegatronOptimizer:
        if self._optimizer is None:
            raise RuntimeError(
                f"MegatronPolicy.{what}: this policy is forward-only (PolicyConfig.trainable=False)"
            )
        return self._optimizer

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the policy's state: ``parameters`` (in the compute dtype),
        ``gradients`` (DDP's gradient buffers) and ``optimizer`` (fp32 master weights and Adam's
        moments; Adam creates its moments at the first step)."""
        from megatron.core.distributed import DistributedDataParallel

        module = self._model[0]
        parameters = sum(p.numel() * p.element_size() for p in module.parameters())
        buffers = (
            [*module.buffers, *module.expert_parallel_buffers]
            if isinstance(module, DistributedDataParallel)
            else []
        )
        gradients = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
        optimizer = 0
        if self._optimizer is not None:
            seen: set[int] = set()
            for inner in getattr(self._optimizer, "chained_optimizers", [self._optimizer]):
                tensors = [t for state in inner.optimizer.state.values() for t in state.values()]
                for group in getattr(inner, "fp32_from_float16_groups", ()):
                    tensors.extend(group)
                for tensor in tensors:
                    if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                        seen.add(id(tensor))
                        optimizer += tensor.numel() * tensor.element_size()
        return {"parameters": parameters, "gradients": gradients, "optimizer": optimizer}

    def memory_stats(self, *, reset: bool = False) -> dict[str, float]:
        """This rank's CUDA memory since the last reset, in GiB: ``peak_allocated`` and
        ``peak_reserved`` (PyTorch's caching allocator), ``reserved`` now; empty without CUDA.
        ``reset`` starts the next interval."""
        if not torch.cuda.is_available():
            return {}
        gib = 1024**3
        stats = {
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / gib,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / gib,
            "reserved_gib": torch.cuda.memory_reserved() / gib,
        }
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return stats

    def release_memory(self) -> float:
        """Return the memory PyTorch's caching allocator holds but no tensor uses (the step's
        activations) to the device, so that a colocated vLLM can wake into it. Parameters,
        gradients and optimizer state stay. Returns the GiB released (0 without CUDA)."""
        if not torch.cuda.is_available():
            return 0.0
        before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        return (before - torch.cuda.memory_reserved()) / 1024**3

    # -- properties ---------------------------------------------------------------------------------

    @property
    def model(self) -> list[MegatronModule]:
        """The Megatron modules (one chunk), DDP-wrapped when trainable."""
        return self._model

    @property
    def optimizer(self) -> MegatronOptimizer:
        """Megatron's optimizer over the trainable parameters (a forward-only policy has none)."""
        return self._require_trainable("optimizer")

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by :meth:`load_checkpoint`)."""
        return self._step

    @property
    def learning_rate(self) -> float:
        """Current learning rate of the first parameter group (0 for a forward-only policy)."""
        return float(self._optimizer.param_groups[0]["lr"]) if self._optimizer is not None else 0.0

    # -- forward passes through megatron-core's schedule ------------------------------------------

    def _micro_batches(self, batch: Sequence[PolicySample], micro_batch_size: int | None) -> list[MicroBatch]:
        if not batch:
            raise ValueError("MegatronPolicy: the batch is empty")
        size = self.config.micro_batch_size if micro_batch_size is None else micro_batch_size
        if size < 1:
            raise ValueError(f"MegatronPolicy: micro_batch_size must be >= 1, got {size}")
        return [
            collate(batch[i : i + size], pad_token_id=self.pad_token_id, media_tokens=self.media_tokens).to(
                self._device
            )
            for i in range(0, len(batch), size)
        ]

    def _target_logprobs(
        self, logits: torch.Tensor, micro_batch: MicroBatch, *, entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[B, S]`` fp32 logprobs of the target tokens from ``[B, S, local vocab]`` logits (0
        elsewhere); with ``entropy`` also the ``[B, S]`` entropies at the same positions."""
        batch_size, seq_len, local_vocab = logits.shape
        sample, position = micro_batch.target_mask.nonzero(as_tuple=True)
        # The logits at position t - 1 predict the token at position t.
        rows = logits.reshape(batch_size * seq_len, local_vocab).index_select(
            0, sample * seq_len + position - 1
        )
        values = token_logprobs(
            rows,
            micro_batch.input_ids[sample, position],
            vocab_size=self.vocab_size,
            temperature=self.config.temperature,
            tp_group=self._logits_tp_group,
            support=self._token_support,
            allowed=(
                unpack_bitmask(micro_batch.allowed_tokens, self.vocab_size)
                if micro_batch.allowed_tokens is not None
                else None
            ),
            return_entropy=entropy,
        )
        zeros = torch.zeros(batch_size, seq_len, dtype=torch.float32, device=logits.device)
        if not entropy:
            return zeros.index_put((sample, position), values)
        values, entropies = values
        return zeros.index_put((sample, position), values), zeros.index_put((sample, position), entropies)

    def _run_schedule(
        self,
        micro_batches: list[MicroBatch],
        loss_for: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]],
        *,
        forward_only: bool,
    ) -> list[dict[str, Any]]:
        """Run megatron-core's forward-backward schedule; returns each micro-batch's reported dict."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # Half-precision models are wrapped in Float16Module, which by default copies the logits
        # to fp32. The output layer computes them in half precision, so the copy adds no
        # precision, only a [tokens, vocabulary] fp32 tensor and its gradient; token_logprobs
        # upcasts one chunk at a time instead.
        output_kwargs = {"fp32_output": False} if self.config.dtype != torch.float32 else {}

        def forward_step(
            data_iterator: Iterator[MicroBatch], model: torch.nn.Module
        ) -> tuple[torch.Tensor, Any]:
            micro_batch = next(data_iterator)
            output = model(
                input_ids=micro_batch.input_ids,
                position_ids=None,
                attention_mask=None,
                **output_kwargs,
                **micro_batch.media,
            )
            # Logits on the last pipeline stage; elsewhere the hidden states the schedule sends on,
            # which point-to-point sends need in one contiguous block.
            return output.contiguous(), partial(loss_for, micro_batch)

        reported = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=self._model,
            num_microbatches=len(micro_batches),
            seq_length=max(mb.input_ids.size(1) for mb in micro_batches),
            micro_batch_size=max(mb.input_ids.size(0) for mb in micro_batches),
            forward_only=forward_only,
        )
        return _from_last_stage(reported)

    def logprobs(
        self, batch: Sequence[PolicySample], *, micro_batch_size: int | None = None
    ) -> list[torch.Tensor]:
        """Per-token log-probabilities of each sample's target tokens under the current weights.

        Runs in eval mode without gradients. The ``advantage`` and logprob fields of the samples
        are not used.

        Args:
            batch: the samples; ``target_mask`` selects the positions computed.
            micro_batch_size: samples per forward pass; ``None`` means ``config.micro_batch_size``.

        Returns:
            One ``[T_i]`` fp32 CPU tensor per sample: ``log p(input_ids[t] | input_ids[:t])`` at
            target positions (at the configured temperature), 0 elsewhere; the layout of
            :attr:`PolicySample.old_logprobs`.
        """
        micro_batches = self._micro_batches(batch, micro_batch_size)

        def loss_for(micro_batch: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            return logits.new_zeros(()), {"logprobs": self._target_logprobs(logits, micro_batch)}

        self._model[0].eval()
        with torch.no_grad():
            reported = self._run_schedule(micro_batches, loss_for, forward_only=True)
        out: list[torch.Tensor] = []
        for micro_batch, record in zip(micro_batches, reported, strict=True):
            values = record["logprobs"].cpu()
            out.extend(values[row, :length] for row, length in enumerate(micro_batch.lengths.tolist()))
        return out

    # -- training ---------------------------------------------------------------------------------

    def train_step(
        self,
        batch: Sequence[PolicySample],
        loss_fn: PolicyLoss,
        *,
        micro_batch_size: int | None = None,
        return_logprobs: bool = False,
    ) -> TrainStepMetrics:
        """One optimizer step on ``batch`` with the loss ``loss_fn``.

        The batch is split into micro-batches of ``micro_batch_size`` samples (``None``:
        ``config.micro_batch_size``) whose gradients are accumulated. Before the first forward the
        loss's :meth:`PolicyLoss.denominator` of every micro-batch is summed over the
        micro-batches and the data-parallel ranks; each micro-batch's part is divided by that
        sum, so the loss and its gradient do not depend on the split. DDP reduces the gradients,
        then the optimizer clips (where possible) and steps.

        Args:
            batch: this data-parallel rank's samples.
            loss_fn: the objective.
            micro_batch_size: samples per forward pass.
            return_logprobs: also return the forward's detached logprobs of each sample
                (:attr:`TrainStepMetrics.logprobs`).

        Raises:
            ValueError: the batch is empty, or no sample with a positive loss weight has a target
                token on any data-parallel rank.
        """
        from megatron.core import parallel_state

        optimizer = self._require_trainable("train_step")
        micro_batches = self._micro_batches(batch, micro_batch_size)
        dp_group = parallel_state.get_data_parallel_group()
        dp_size = parallel_state.get_data_parallel_world_size()
        weighted = [s for s in batch if s.loss_weight > 0]
        sizes = torch.tensor(
            [
                sum(s.num_target_tokens for s in weighted),
                sum(s.num_target_tokens > 0 for s in weighted),
                sum(s.num_target_tokens for s in batch),
                sum(s.input_ids.numel() for s in batch),
                len(batch),
                sum(loss_fn.denominator(mb) for mb in micro_batches),
            ],
            dtype=torch.float64,
            device=self._device,
        )
        torch.distributed.all_reduce(sizes, group=dp_group)
        loss_tokens, loss_sequences, target_tokens, tokens, samples = (int(v) for v in sizes[:5].tolist())
        normalizer = float(sizes[5])
        if loss_tokens == 0 or not normalizer > 0:
            raise ValueError(
                "MegatronPolicy.train_step: no sample with a positive loss_weight has a target token"
            )
        counts = StepCounts(
            num_target_tokens=loss_tokens, num_target_sequences=loss_sequences, normalizer=normalizer
        )
        num_micro_batches = len(micro_batches)

        def loss_for(micro_batch: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            targets = micro_batch.num_target_tokens
            trained = int((micro_batch.target_mask & (micro_batch.loss_weights > 0).unsqueeze(-1)).sum())
            if targets == 0:
                # A backward pass like every other micro-batch's, with zero gradient.
                empty = {"loss": 0.0, "trained": 0, "metrics": {}}
                if return_logprobs:
                    empty["logprobs"] = torch.zeros(micro_batch.input_ids.shape, dtype=torch.float32)
                return logits.sum() * 0.0, empty
            if getattr(loss_fn, "wants_entropy", False):
                logprobs, entropy = self._target_logprobs(logits, micro_batch, entropy=True)
                loss, metrics = loss_fn(
                    logprobs, micro_batch.target_mask, micro_batch, counts, entropy=entropy
                )
            else:
                logprobs = self._target_logprobs(logits, micro_batch)
                loss, metrics = loss_fn(logprobs, micro_batch.target_mask, micro_batch, counts)
            reported: dict[str, Any] = {
                "loss": float(loss.detach()),
                "trained": trained,
                "metrics": {name: float(_detached(value)) for name, value in metrics.items()},
            }
            if return_logprobs:
                reported["logprobs"] = logprobs.detach().cpu()
            # megatron-core divides the returned loss by the number of micro-batches, and DDP
            # averages gradients over data-parallel ranks; both are undone, so that the gradient is
            # that of the sum of the parts, the step's loss.
            return loss * (num_micro_batches * dp_size), reported

        self._model[0].train()
        self._model[0].zero_grad_buffer()
        optimizer.zero_grad()
        reported = self._run_schedule(micro_batches, loss_for, forward_only=False)
        update_successful, grad_norm, _ = optimizer.step()
        self._step += 1

        step_loss = torch.tensor(sum(r["loss"] for r in reported), dtype=torch.float64, device=self._device)
        torch.distributed.all_reduce(step_loss, group=dp_group)
        logprobs: list[torch.Tensor] | None = None
        if return_logprobs:
            logprobs = [
                record["logprobs"][row, :length]
                for micro_batch, record in zip(micro_batches, reported, strict=True)
                for row, length in enumerate(micro_batch.lengths.tolist())
            ]
        return TrainStepMetrics(
            step=self._step,
            loss=float(step_loss),
            grad_norm=None if grad_norm is None else float(grad_norm),
            learning_rate=self.learning_rate,
            num_samples=samples,
            num_target_tokens=target_tokens,
            num_tokens=tokens,
            update_skipped=not update_successful,
            loss_metrics=self._reduce_metrics(reported, dp_group),
            logprobs=logprobs,
        )

    def _reduce_metrics(
        self, reported: list[dict[str, Any]], dp_group: torch.distributed.ProcessGroup
    ) -> dict[str, float]:
        """The loss's per-micro-batch metrics over the step: means weighted by each micro-batch's
        trained tokens, maxima for names ending in ``_max``; over all data-parallel ranks."""
        names = sorted({name for record in reported for name in record["metrics"]})
        means = [name for name in names if not name.endswith("_max")]
        maxima = [name for name in names if name.endswith("_max")]
        sums = torch.zeros(len(means) + 1, dtype=torch.float64, device=self._device)
        largest = torch.full((len(maxima),), -math.inf, dtype=torch.float64, device=self._device)
        for record in reported:
            weight = record["trained"]
            sums[-1] += weight
            for index, name in enumerate(means):
                sums[index] += weight * record["metrics"].get(name, 0.0)
            for index, name in enumerate(maxima):
                if name in record["metrics"]:
                    largest[index] = max(float(largest[index]), record["metrics"][name])
        torch.distributed.all_reduce(sums, group=dp_group)
        if maxima:
            torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, group=dp_group)
        total = float(sums[-1]) or 1.0
        out = {name: float(sums[index]) / total for index, name in enumerate(means)}
        out.update({name: float(value) for name, value in zip(maxima, largest.tolist(), strict=True)})
        return out

    # -- weights in HF names ----------------------------------------------------------------------

    @torch.no_grad()
    def export_hf_weights(self, *, cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the current weights as ``(hf_name, tensor)``, one tensor at a time, on the CPU
        (``cpu=False``: on the policy's device, for a transfer that sends from there).

        Names and layouts are the HF checkpoint's: Megatron-Bridge all-gathers the
        tensor-parallel shards, so every rank receives the same full tensors, and splits fused
        projections. Collective: every rank of the model must iterate to the end. A yielded tensor
        may share memory with a parameter: clone it to keep it across a training step.
        """
        yield from self._bridge.export_hf_weights(self._model, cpu=cpu, show_progress=False)

    def export_hf_weight_chunks(self, max_chunk_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """:meth:`export_hf_weights` grouped into chunks of at most ``max_chunk_bytes`` bytes each.

        A tensor larger than ``max_chunk_bytes`` forms a chunk of its own. For senders that ship
        weights to an inference engine in bounded pieces.
        """
        return chunk_by_bytes(self.export_hf_weights(), max_chunk_bytes)

    def save_hf_checkpoint(self, directory: str | Path, *, max_shard_bytes: int = 5 * 1024**3) -> Path:
        """Write the current weights as an HF checkpoint directory that vLLM and transformers load.

        Weights go to ``model.safetensors``, or to ``model-0000i-of-0000n.safetensors`` shards of
        at most ``max_shard_bytes`` each (a larger tensor gets a shard of its own) with
        ``model.safetensors.index.json``; every non-weight file of the source checkpoint (config,
        generation config, tokenizer, processor, chat template) is copied. The directory is
        assembled next to ``directory`` and renamed into place, so a reader never sees a partial
        checkpoint; at most one shard is held in memory. Collective: every rank takes part in the
        export, rank 0 alone writes (once, also under tensor or data parallelism).

        Returns:
            ``directory``.

        Raises:
            FileExistsError: ``directory`` exists and is not empty (raised on every rank).
        """
        target = Path(directory)
        write = torch.distributed.get_rank() == 0
        problem = [f"save_hf_checkpoint: {target} exists and is not empty"]
        if not (write and target.exists() and any(target.iterdir())):
            problem = [None]
        torch.distributed.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise FileExistsError(problem[0])
        if not write:
            for _ in self.export_hf_weights():
                pass
            torch.distributed.barrier()
            return target

        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            _write_safetensors(staging, self.export_hf_weight_chunks(max_shard_bytes))
            for source in sorted(self.hf_path.iterdir()):
                if source.is_file() and not _is_weight_file(source.name):
                    shutil.copy2(source, staging / source.name)
            if target.exists():
                target.rmdir()
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        torch.distributed.barrier()
        return target

    # -- in-memory refit ----------------------------------------------------------------------------

    def connect_vllm(
        self,
        base_url: str,
        *,
        backend: str,
        bucket_bytes: int,
        vllm_workers: int = 1,
        timeout_s: float = 600.0,
    ) -> None:
        """Join the weight-transfer group of the vLLM server at ``base_url`` (again after a
        restart), through vLLM's weight-transfer API (:mod:`rl_bridge.refit.sync`). Collective:
        every rank calls it; global rank 0 sends, from the address on its route to the server.
        Each server of a run with several has a group of its own.
        """
        from rl_bridge.services.process import free_port
        from rl_bridge.refit.sync import WeightSync, sender_address
        from vllm_video_plugin.refit_receiver import GLOO_BACKEND

        old = self._weight_syncs.pop(base_url, None)
        if old is not None:
            old.close()
        # gloo sends from host memory; NCCL and CUDA IPC from the device, where the export stays.
        on_cpu = backend == GLOO_BACKEND
        sync = WeightSync(lambda: self.export_hf_weights(cpu=on_cpu))
        address = sender_address(base_url)
        sync.connect(
            base_url,
            backend=backend,  # type: ignore[arg-type]
            master_address=address,
            master_port=free_port(address),
            vllm_workers=vllm_workers,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
        )
        self._weight_syncs[base_url] = sync

    def send_weights_to_vllm(self, base_url: str | None = None) -> dict[str, float]:
        """Stream the current weights to the connected server at ``base_url`` (``None``: to every
        connected server in turn, each from its own export stream) (:meth:`connect_vllm` first):
        ``/start_weight_update``, one ``/update_weights`` per bucket, ``/finish_weight_update``.
        Collective. Returns rank 0's figures (``refit/bytes``, ``refit/buckets``,
        ``refit/transfer_s``, summed over the servers); the caller pauses the server and resets
        its caches around it (:meth:`rl_bridge.refit.client.RefitClient.refit_with`)."""
        if base_url is not None and base_url not in self._weight_syncs:
            raise RuntimeError(f"send_weights_to_vllm({base_url!r}) before connect_vllm({base_url!r})")
        if not self._weight_syncs:
            raise RuntimeError("send_weights_to_vllm before connect_vllm")
        targets = [base_url] if base_url is not None else list(self._weight_syncs)
        figures: dict[str, float] = {}
        for url in targets:
            for name, value in self._weight_syncs[url].send().items():
                figures[name] = figures.get(name, 0.0) + value
        return figures

    # -- training checkpoints -----------------------------------------------------------------------

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Save model, optimizer, step counter and RNG state to ``directory`` (created if needed).

        Each rank writes ``rank_<global rank>.pt`` (``torch.save`` of its state dicts: under tensor
        parallelism its shards of the weights and optimizer state, and its own RNG states); rank 0
        then writes ``meta.json`` with the step, world size and tensor-parallel size, last, so a
        checkpoint whose save was interrupted has no ``meta.json`` and is refused by
        :meth:`load_checkpoint`. Resuming needs the same parallel layout. Collective.
        """
        from megatron.core import parallel_state

        target = Path(directory)
        rank = torch.distributed.get_rank()
        if rank == 0:
            target.mkdir(parents=True, exist_ok=True)
            (target / _CHECKPOINT_META).unlink(missing_ok=True)
        torch.distributed.barrier()
        target.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self._model[0].state_dict(),
            "optimizer": self._require_trainable("save_checkpoint").state_dict(),
            "step": self._step,
            "rng": _rng_state(),
        }
        torch.save(state, target / f"rank_{rank:05d}.pt")
        torch.distributed.barrier()
        if rank == 0:
            meta = {
                "format": _CHECKPOINT_FORMAT,
                "step": self._step,
                "world_size": torch.distributed.get_world_size(),
                "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
            }
            (target / _CHECKPOINT_META).write_text(json.dumps(meta))
        torch.distributed.barrier()
        return target

    def load_checkpoint(self, directory: str | Path) -> int:
        """Restore what :meth:`save_checkpoint` wrote; returns the restored step counter.

        Raises:
            FileNotFoundError: ``directory`` has no complete checkpoint (no ``meta.json`` or no
                file for this rank).
            ValueError: the checkpoint was written with another format, world size or
                tensor-parallel size.
        """
        from megatron.core import parallel_state

        source = Path(directory)
        meta_path = source / _CHECKPOINT_META
        rank_path = source / f"rank_{torch.distributed.get_rank():05d}.pt"
        if not meta_path.is_file() or not rank_path.is_file():
            raise FileNotFoundError(
                f"load_checkpoint: {source} has no complete checkpoint ({meta_path.name}, {rank_path.name})"
            )
        meta = json.loads(meta_path.read_text())
        expected = {
            "format": _CHECKPOINT_FORMAT,
            "world_size": torch.distributed.get_world_size(),
            "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
        }
        found = {name: meta.get(name) for name in expected}
        if found != expected:
            raise ValueError(f"load_checkpoint: {source} has {found}; this run expects {expected}")
        state = torch.load(rank_path, map_location="cpu", weights_only=True)
        self._model[0].load_state_dict(state["model"])
        self._require_trainable("load_checkpoint").load_state_dict(state["optimizer"])
        self._step = int(state["step"])
        _set_rng_state(state["rng"])
        return self._step


def chunk_by_bytes(
    pairs: Iterable[tuple[str, torch.Tensor]], max_chunk_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``pairs`` in order, grouped into chunks of at most ``max_chunk_bytes`` bytes (a larger
    tensor forms a chunk of its own)."""
    if max_chunk_bytes < 1:
        raise ValueError(f"export_hf_weight_chunks: max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
    chunk: list[tuple[str, torch.Tensor]] = []
    chunk_bytes = 0
    for name, tensor in pairs:
        size = tensor.numel() * tensor.element_size()
        if chunk and chunk_bytes + size > max_chunk_bytes:
            yield chunk
            chunk, chunk_bytes = [], 0
        chunk.append((name, tensor))
        chunk_bytes += size
    if chunk:
        yield chunk


def _write_safetensors(directory: Path, shards: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
    """Write ``shards`` as HF-named safetensors files (and an index when there are several)."""
    from safetensors.torch import save_file

    written: list[tuple[Path, list[str], int]] = []
    for index, shard in enumerate(shards):
        tensors = {name: tensor.detach().contiguous() for name, tensor in shard}
        path = directory / f"shard-{index}.partial"
        save_file(tensors, str(path), metadata={"format": "pt"})
        written.append((path, list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())))
    if len(written) == 1:
        written[0][0].rename(directory / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for index, (path, names, _) in enumerate(written, start=1):
        filename = f"model-{index:05d}-of-{len(written):05d}.safetensors"
        path.rename(directory / filename)
        weight_map.update(dict.fromkeys(names, filename))
    index_json = {"metadata": {"total_size": sum(size for *_, size in written)}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def _vocab_parallel_logits(module: torch.nn.Module) -> bool:
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


def _from_last_stage(reported: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the last pipeline stage's loss functions reported, on every stage of the pipeline (the
    schedule calls them on the last stage only and returns nothing elsewhere)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return reported
    box: list[Any] = [reported if parallel_state.is_pipeline_last_stage() else None]
    torch.distributed.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]


def _detached(value: torch.Tensor | float) -> torch.Tensor | float:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name in _WEIGHT_INDEXES


def _rng_state() -> dict[str, Any]:
    """The random states a training step draws from.

    Torch's CPU generator, and with CUDA also torch's CUDA generator and Megatron's
    model-parallel CUDA RNG tracker (dropout inside tensor-parallel regions).
    """
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if not cpu_support_needed():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and not cpu_support_needed():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
