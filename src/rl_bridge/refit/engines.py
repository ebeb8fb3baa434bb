"""The trainer half of the ``video_grpo_gloo`` weight transfer (CPU refit), registered with vLLM.

:class:`GlooTrainerWeightTransferEngine` streams the policy's HF-named tensors to the workers'
:class:`~vllm_video_plugin.refit_receiver.GlooWeightTransferEngine`: buckets of ``bucket_bytes``,
each one ``/update_weights`` call (through :class:`~rl_bridge.refit.client.RefitClient`, vLLM's
``VLLMWeightSyncClient``) and one gloo broadcast. Importing this module registers it in vLLM's
``WeightTransferTrainerFactory``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from vllm_video_plugin import compat
from vllm_video_plugin.buckets import BucketLayout, pack_buckets
from vllm_video_plugin.refit_receiver import (
    GLOO_BACKEND,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
    broadcast,
    join_group,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "TransferStats",
    "register_trainer_engine",
]

DEFAULT_BUCKET_BYTES = 256 * 1024**2
"""Bytes per bucket unless the recipe says otherwise (``refit.bucket_mb``)."""


@dataclass(frozen=True)
class TransferStats:
    """What one :meth:`GlooTrainerWeightTransferEngine.send_weights` moved."""

    tensors: int
    bytes: int
    buckets: int
    seconds: float


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's half of the :data:`~vllm_video_plugin.refit_receiver.GLOO_BACKEND` handshake."""

    backend: ClassVar[str] = GLOO_BACKEND

    master_address: str
    """Where the sender hosts the rendezvous (reachable from every vLLM worker)."""
    master_port: int
    world_size: int
    """1 (the sender) + every vLLM worker fed."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 600.0


# The trainer engines (here and in .legacy_engines) subclass vLLM's TrainerWeightTransferEngine
# unparameterised: it is generic over (config, init info) before vLLM 0.27 and over the init info
# from 0.27 (compat.trainer_engine_takes_config), and takes the config first in __init__ before 0.27.


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """Streams a :class:`WeightSource` to the workers'
    :class:`~vllm_video_plugin.refit_receiver.GlooWeightTransferEngine`.

    Bucketing: tensors are copied, in the source's order, into one reused send buffer of
    ``bucket_bytes`` (a larger tensor is sent alone, from its own memory); a full bucket is
    announced with ``/update_weights`` (its names, dtypes, shapes, offsets) and broadcast while
    the workers receive it. The trainer holds at most one bucket plus the tensor in hand.
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        super().__init__(
            *compat.trainer_engine_config_args(GLOO_BACKEND),
            client=client,
            source=source,
            is_sender=is_sender,
        )
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.group: ProcessGroup | None = None
        self.last: TransferStats | None = None
        self._send: torch.Tensor | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        config: Any = None,
    ) -> Self:
        """``config``: vLLM's factory passes a ``WeightTransferConfig`` before 0.27 (unused: the
        backend is this engine's)."""
        if source is None:
            raise ValueError(f"{GLOO_BACKEND}: the trainer engine needs a WeightSource")
        engine = cls(
            client=client, source=source, is_sender=init_info.is_sender, bucket_bytes=init_info.bucket_bytes
        )
        if not engine.is_sender:
            return engine
        worker = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
        )
        # The workers block in init_weight_transfer_engine until the group forms: join meanwhile.
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(client.init_weight_transfer_engine, asdict(worker))
            try:
                engine.group = join_group(
                    init_info.master_address,
                    init_info.master_port,
                    0,
                    init_info.world_size,
                    timeout_s=init_info.timeout_s,
                )
            except Exception:
                if answer.done():
                    answer.result()  # the server's refusal says more than the timeout
                raise
            answer.result()
        return engine

    def send_weights(self) -> None:
        """One full update (start, every bucket, finish); on non-senders only the export's
        collective. :attr:`last` holds what moved."""
        assert self.source is not None
        started = time.monotonic()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        assert self.group is not None, "trainer_init() first"
        self.client.start_weight_update()
        tensors = nbytes = buckets = 0
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = None
            # Pulling the next bucket packs it while the workers load the previous one; a sent
            # bucket's buffer is free once its broadcast returned.
            for bucket, info in self._buckets(iter(self.source)):
                if answer is not None:
                    answer.result()
                answer = pool.submit(self.client.update_weights, asdict(info))
                try:
                    broadcast(self.group, bucket)
                except Exception:
                    if answer.done():
                        answer.result()
                    raise
                tensors += len(info.names)
                nbytes += info.nbytes
                buckets += 1
            if answer is not None:
                answer.result()
        # The empty final call: the workers check that every tensor they hold came.
        final = GlooWeightTransferUpdateInfo(
            names=[], dtype_names=[], shapes=[], offsets=[], nbytes=0, final=True
        )
        self.client.update_weights(asdict(final))
        self.client.finish_weight_update()
        self.last = TransferStats(
            tensors=tensors, bytes=nbytes, buckets=buckets, seconds=time.monotonic() - started
        )

    def _buckets(
        self, pairs: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[torch.Tensor, BucketLayout]]:
        """:func:`~vllm_video_plugin.buckets.pack_buckets` into this engine's send buffer (one,
        on the tensors' device, kept across refits: its pages are touched once)."""

        def buffer(device: torch.device) -> torch.Tensor:
            if self._send is None or self._send.device != device:
                self._send = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
            return self._send

        return pack_buckets(pairs, self.bucket_bytes, buffer)

    def shutdown(self) -> None:
        if self.group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(self.group)
            self.group = None


def register_trainer_engine() -> None:
    """Register :class:`GlooTrainerWeightTransferEngine` in vLLM's trainer factory (idempotent;
    a name already taken is left alone)."""
    try:
        WeightTransferTrainerFactory.register_engine(GLOO_BACKEND, GlooTrainerWeightTransferEngine)
    except ValueError:
        pass


register_trainer_engine()
