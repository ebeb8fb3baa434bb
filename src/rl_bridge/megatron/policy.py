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

This module holds the policy's core, the forward passes and the training step through
megatron-core's schedule; the class composes the rest: its settings (:mod:`.policy_config`), the
loss interface and step metrics (:mod:`.policy_loss`), the optimizer (:mod:`.optimizer`), the HF
export and the vLLM weight connections (:mod:`.hf_export`), and training checkpoints
(:mod:`.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rl_bridge.megatron import checkpoint, hf_export
from rl_bridge.megatron.batch import MediaTokens, MicroBatch, PolicySample, collate
from rl_bridge.megatron.distributed import from_last_stage
from rl_bridge.megatron.logprobs import token_logprobs
from rl_bridge.megatron.model import build_policy, hf_vocab_size, load_bridge, vocab_parallel_logits
from rl_bridge.megatron.optimizer import build_optimizer, fuse_kernels, state_bytes
from rl_bridge.megatron.policy_config import PolicyConfig
from rl_bridge.megatron.policy_loss import PolicyLoss, StepCounts, TrainStepMetrics, reduce_metrics
from rl_bridge.structured_outputs import unpack_bitmask

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.transformer.module import MegatronModule

__all__ = ["MegatronPolicy", "PolicyConfig"]


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
        self._vllm_senders = hf_export.VLLMWeightSenders(self.export_hf_weights)
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
        self._optimizer: MegatronOptimizer | None = (
            build_optimizer(self._model, self.config) if self.config.trainable else None
        )
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
            and vocab_parallel_logits(self._model[0])
            else None
        )
        self._step = 0
        self._device = next(self._model[0].parameters()).device
        self._token_support = (
            torch.tensor(self.config.token_support, dtype=torch.long, device=self._device)
            if self.config.token_support is not None
            else None
        )

    def fuse_kernels(self) -> dict[str, int]:
        """Fuse the elementwise regions (:func:`.fusion.fuse_elementwise`), accumulate the language
        model's weight gradients inside their GEMMs (:func:`.fusion.fuse_weight_gradient_accumulation`)
        and switch torch's Adam to its fused kernel (megatron-core falls back to torch's ``AdamW``
        without Apex or Transformer Engine, in its multi-tensor ``foreach`` form). CUDA only; returns
        what was changed (empty on CPU)."""
        return fuse_kernels(self._model[0], self._optimizer)

    def _require_trainable(self, what: str) -> MegatronOptimizer:
        if self._optimizer is None:
            raise RuntimeError(
                f"MegatronPolicy.{what}: this policy is forward-only (PolicyConfig.trainable=False)"
            )
        return self._optimizer

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the policy's state: ``parameters`` (in the compute dtype),
        ``gradients`` (DDP's gradient buffers), ``optimizer`` (fp32 master weights and Adam's
        moments on the parameters' device; Adam creates its moments at the first step) and
        ``optimizer_host`` (the part of them offloaded to host memory, with the pinned gradient copies
        it steps on: ``PolicyConfig.optimizer_offload_fraction``)."""
        return state_bytes(self._model[0], self._optimizer)

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
        return from_last_stage(reported)

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
            loss_metrics=reduce_metrics(reported, dp_group, self._device),
            logprobs=logprobs,
        )

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
        return hf_export.save_hf_checkpoint(
            self.export_hf_weights, self.hf_path, directory, max_shard_bytes=max_shard_bytes
        )

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
        self._vllm_senders.connect(
            base_url,
            backend=backend,
            bucket_bytes=bucket_bytes,
            vllm_workers=vllm_workers,
            timeout_s=timeout_s,
        )

    def send_weights_to_vllm(self, base_url: str | None = None) -> dict[str, float]:
        """Stream the current weights to the connected server at ``base_url`` (``None``: to every
        connected server in turn, each from its own export stream) (:meth:`connect_vllm` first):
        ``/start_weight_update``, one ``/update_weights`` per bucket, ``/finish_weight_update``.
        Collective. Returns rank 0's figures (``refit/bytes``, ``refit/buckets``,
        ``refit/transfer_s``, summed over the servers); the caller pauses the server and resets
        its caches around it (:meth:`rl_bridge.refit.client.RefitClient.refit_with`)."""
        return self._vllm_senders.send(base_url)

    # -- training checkpoints -----------------------------------------------------------------------

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Save model, optimizer, step counter and RNG state to ``directory`` (created if needed),
        one file per rank and ``meta.json`` last (:mod:`.checkpoint`). Resuming needs the same
        parallel layout. Collective."""
        optimizer = self._require_trainable("save_checkpoint")
        return checkpoint.save_checkpoint(
            directory, module=self._model[0], optimizer=optimizer, step=self._step
        )

    def load_checkpoint(self, directory: str | Path) -> int:
        """Restore what :meth:`save_checkpoint` wrote; returns the restored step counter.

        Raises:
            FileNotFoundError: ``directory`` has no complete checkpoint (no ``meta.json`` or no
                file for this rank).
            ValueError: the checkpoint was written with another format, world size or
                tensor-parallel size.
        """
        optimizer = self._require_trainable("load_checkpoint")
        self._step = checkpoint.load_checkpoint(directory, module=self._model[0], optimizer=optimizer)
        return self._step


def _detached(value: torch.Tensor | float) -> torch.Tensor | float:
    return value.detach() if isinstance(value, torch.Tensor) else value
