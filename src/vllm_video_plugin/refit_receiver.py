"""The receiving end of in-memory refit on CPU: a vLLM worker-side weight-transfer engine over
``torch.distributed`` with gloo.

vLLM's RL weight-transfer API (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``) moves a trainer's weights into the running engine
without a file in between; its engines (``nccl``, ``ipc``, ...) need CUDA. This module is the
same protocol on CPU, so the tests and the embedded default run what a GPU cluster runs. Serve
with::

    --weight-transfer-config '{"backend": "video_grpo_gloo"}'

(:func:`vllm_video_plugin.register` registers the engine in every vLLM process). The trainer
side is :class:`rl_bridge.refit.engines.GlooTrainerWeightTransferEngine`.

The wire protocol:

- **Init.** ``init_info`` = :class:`GlooWeightTransferInitInfo`: a rendezvous address and port
  (the trainer's sender hosts the store as rank 0), this server's rank offset and the group's
  world size. Every worker joins as ``rank_offset + its global rank`` (data-parallel index x
  TP x PP + its rank), so one trainer can feed every worker of every replica in one group.
- **Update.** One ``/update_weights`` call per **bucket**: ``update_info`` =
  :class:`GlooWeightTransferUpdateInfo`, the bucket's HF names, dtypes, shapes and byte offsets.
  The worker receives the bucket as one ``uint8`` broadcast from rank 0 into a receive buffer it
  keeps (a fresh one per bucket costs its page faults every time) and hands views of it to the
  model's ``load_weights``; views that vLLM's layerwise reload still holds for a layer not yet
  complete get copies before the buffer is reused. A bucket is at most the trainer's bucket size
  (a larger tensor travels alone), so neither side holds the model twice.
- **Checks.** Each name and shape is checked against the checkpoint the server loaded (its
  safetensors headers, HF names): a name the server does not hold, or another shape, fails the
  update with both named; the trainer's last call (an empty bucket marked ``final``) fails,
  naming them, if a tensor of the checkpoint was not sent. After a failed bucket the worker
  closes the layerwise reload (the model stays whole; layers not reached keep their weights), as
  vLLM ends the update session on an error.

Start and finish run vLLM's layerwise reload (as ``reload_weights`` does), which repacks the
weights for the CPU kernels. Resetting the prefix, encoder and multimodal caches and stamping the
weight version stay with the caller (the trainer's ``rl_bridge.refit.client.RefitClient``).

This module imports vLLM and torch; vLLM imports it when the engine is created.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from vllm_video_plugin import compat
from vllm_video_plugin.buckets import BucketLayout, unpack_bucket
from vllm_video_plugin.errors import VideoGRPOError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = [
    "GLOO_BACKEND",
    "GlooWeightTransferEngine",
    "GlooWeightTransferInitInfo",
    "GlooWeightTransferUpdateInfo",
    "WeightTransferMismatch",
    "checkpoint_shapes",
]

GLOO_BACKEND: Final = "video_grpo_gloo"
"""The ``--weight-transfer-config`` backend name (worker and trainer registries)."""

logger = logging.getLogger(__name__)


class WeightTransferMismatch(VideoGRPOError, ValueError):
    """The trainer sent a name, a shape or a set of parameters the server does not hold."""


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the trainer's gloo group."""

    master_address: str
    master_port: int
    rank_offset: int
    """This server's first rank in the group (the trainer's sender is rank 0)."""
    world_size: int
    timeout_s: float = 600.0
    """How long a collective waits for a peer before failing."""


@dataclass(kw_only=True)
class GlooWeightTransferUpdateInfo(BucketLayout, WeightTransferUpdateInfo):
    """One bucket (:class:`~vllm_video_plugin.buckets.BucketLayout`: which tensors its bytes hold,
    and where), or the update's final call."""

    final: bool = False
    """The update's last call (the trainer sends an empty one): every tensor of the served
    checkpoint must have come by now."""


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]] | None:
    """HF name -> shape of every tensor in the checkpoint's safetensors files (headers only), or
    ``None`` where the directory has none (dummy weights, another format: nothing to check
    against)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def join_group(host: str, port: int, rank: int, world_size: int, *, timeout_s: float) -> ProcessGroup:
    """A gloo group of its own (not the process's default group): vLLM's stateless rendezvous,
    rank 0 hosting the store."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    # Before vLLM 0.32 the group takes vLLM's default timeout (compat.stateless_group_kwargs).
    return stateless_init_torch_distributed_process_group(
        host,
        port,
        rank,
        world_size,
        backend="gloo",
        **compat.stateless_group_kwargs(timedelta(seconds=timeout_s)),
    )


def broadcast(group: ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` in place from the group's rank 0 (the group's own ranks, not the
    default group's)."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _copy_pending_views(buffer: torch.Tensor) -> None:
    """vLLM's layerwise reload keeps the weights of a layer not yet complete (its other tensors
    are in a later bucket) as the arguments it was called with: give those that are views of the
    receive ``buffer`` a copy of their own before the buffer is reused."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    storage = buffer.untyped_storage().data_ptr()
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == storage:
                    bound.arguments[key] = value.clone()


class GlooWeightTransferEngine(
    WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]
):
    """The worker side of :data:`GLOO_BACKEND` (see the module docstring)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: ProcessGroup | None = None
        self.expected = checkpoint_shapes(self.model_config.model)
        """HF name -> shape the server holds (``None``: not known, not checked)."""
        self._received: set[str] = set()
        self._open = False
        """Whether a layerwise reload is in progress (started, not yet finalised)."""
        self._buffer: torch.Tensor | None = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.shutdown()
        self.group = join_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            timeout_s=init_info.timeout_s,
        )
        logger.info(
            "%s: joined the trainer's group at %s:%d as rank %d of %d",
            GLOO_BACKEND,
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._received = set()
        self._open = True
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises an accelerator; the CPU has none.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """Receive one bucket and load it; the ``final`` (empty) one checks that every tensor of
        the checkpoint came. A bucket that fails its check is still received (the trainer's
        broadcast must not wait for a peer that left), then the reload is closed (layers not
        reached keep their weights) and the error raised."""
        if self.group is None:
            raise RuntimeError(f"{GLOO_BACKEND}: update_weights before init_weight_transfer_engine")
        try:
            problem = self._problem(update_info)
            buffer = self._receive_buffer(update_info.nbytes)
            if update_info.nbytes:
                broadcast(self.group, buffer)
            if problem is not None:
                raise WeightTransferMismatch(problem)
            tensors = unpack_bucket(buffer, update_info)
            if self.device.type != "cpu":
                tensors = [(name, tensor.to(self.device)) for name, tensor in tensors]
            if tensors:
                self.model.load_weights(tensors)
                if self.device.type == "cpu":
                    _copy_pending_views(buffer)
            self._received.update(update_info.names)
            if update_info.final and self.expected is not None:
                if missing := sorted(set(self.expected) - self._received):
                    raise WeightTransferMismatch(
                        f"{GLOO_BACKEND}: the update did not send {len(missing)} of the served "
                        f"checkpoint's {len(self.expected)} tensors (those keep their old values): "
                        f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
                    )
        except BaseException:
            self._close()  # vLLM ends the update session on an update error: leave the model whole
            raise

    def _receive_buffer(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of one receive buffer kept across buckets and refits (grown when a
        bucket is larger): a fresh buffer per bucket costs its page faults on every receive."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes]

    def _problem(self, info: GlooWeightTransferUpdateInfo) -> str | None:
        if self.expected is None:
            return None
        for name, shape in zip(info.names, info.shapes, strict=True):
            held = self.expected.get(name)
            if held is None:
                return (
                    f"{GLOO_BACKEND}: the trainer sent {name!r}, which the served checkpoint "
                    f"({self.model_config.model}) does not hold"
                )
            if tuple(shape) != held:
                return (
                    f"{GLOO_BACKEND}: {name} has shape {tuple(shape)} from the trainer, "
                    f"{held} in the served checkpoint"
                )
        return None

    def finish_weight_update(self) -> None:
        self._close()

    def _close(self) -> None:
        """End the layerwise reload once: layers whose weights all came are processed already,
        the others get their kernel tensors back."""
        if self._open:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._open = False
            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self.group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(self.group)
            self.group = None

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """Not used: the trainer's half is :class:`rl_bridge.refit.engines.GlooTrainerWeightTransferEngine`.
        vLLM before 0.28 declares this abstract on every worker engine
        (:func:`~vllm_video_plugin.compat.worker_engine_declares_trainer_send_weights`), so the
        class must define it to be created there."""
        raise NotImplementedError(
            f"{GLOO_BACKEND}: send with rl_bridge.refit.engines.GlooTrainerWeightTransferEngine"
        )
