"""The trainer side of in-memory refit, through vLLM's weight-transfer API.

vLLM's API has a worker-side engine in each vLLM worker and a trainer-side engine in the
trainer (``WeightTransferTrainerFactory``); the trainer's sender drives the HTTP control plane
(:class:`~vllm_video_plugin.refit.RefitClient` implements vLLM's ``VLLMWeightSyncClient``) while
its data plane moves the tensors. This module provides:

- :class:`GlooTrainerWeightTransferEngine`, registered as ``video_grpo_gloo`` (the trainer half
  of :mod:`vllm_video_plugin.weight_transfer`): the HF-named tensors streamed into buckets of
  ``bucket_bytes``, each bucket one ``/update_weights`` call and one gloo broadcast; on GPUs the
  same policy methods use vLLM's stock ``nccl`` engine (split placement) or its ``ipc`` engine
  (colocated: each policy rank packs its export into one bucket-sized device buffer and vLLM's
  worker on the same GPU reads it through a CUDA IPC handle);
- :class:`PolicyWeightSource`, a ``WeightSource`` over a policy's
  :meth:`~rl_bridge.megatron.policy.MegatronPolicy.export_hf_weights` stream (tensor-parallel
  shards gathered per tensor by Megatron-Bridge, the vision tower and projector included);
- :class:`WeightSync`, what a policy rank holds: the engine, re-created when the server restarts.

Every rank of the policy calls :meth:`WeightSync.connect` and :meth:`WeightSync.send` (the export
is a collective); global rank 0 is the sender.
"""

from __future__ import annotations

import logging
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

import torch
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from vllm_video_plugin.buckets import BucketLayout, pack_buckets
from vllm_video_plugin.weight_transfer import (
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
    "PolicyWeightSource",
    "TransferStats",
    "WeightSync",
    "register_trainer_engine",
    "sender_address",
]

DEFAULT_BUCKET_BYTES = 256 * 1024**2
"""Bytes per bucket unless the recipe says otherwise (``refit.bucket_mb``)."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferStats:
    """What one :meth:`GlooTrainerWeightTransferEngine.send_weights` moved."""

    tensors: int
    bytes: int
    buckets: int
    seconds: float


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's half of the :data:`~vllm_video_plugin.weight_transfer.GLOO_BACKEND` handshake."""

    backend: ClassVar[str] = GLOO_BACKEND

    master_address: str
    """Where the sender hosts the rendezvous (reachable from every vLLM worker)."""
    master_port: int
    world_size: int
    """1 (the sender) + every vLLM worker fed."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 600.0


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Streams a :class:`WeightSource` to vLLM's :class:`~vllm_video_plugin.weight_transfer.GlooWeightTransferEngine`.

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
        super().__init__(client=client, source=source, is_sender=is_sender)
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
    ) -> Self:
        if source is None:
            raise ValueError(f"{GLOO_BACKEND}: the trainer engine needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, bucket_bytes=init_info.bucket_bytes)
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
                    init_info.master_address, init_info.master_port, 0, init_info.world_size, timeout_s=init_info.timeout_s
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
        final = GlooWeightTransferUpdateInfo(names=[], dtype_names=[], shapes=[], offsets=[], nbytes=0, final=True)
        self.client.update_weights(asdict(final))
        self.client.finish_weight_update()
        self.last = TransferStats(tensors=tensors, bytes=nbytes, buckets=buckets, seconds=time.monotonic() - started)

    def _buckets(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, BucketLayout]]:
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


class PolicyWeightSource(WeightSource):
    """A policy's weights as vLLM's ``WeightSource``: each pass is a fresh
    ``export_hf_weights()`` stream (a collective on every rank of the policy)."""

    def __init__(self, export: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> None:
        self._export = export
        self._meta: list[ParamMeta] | None = None

    def metadata(self) -> list[ParamMeta]:
        """Names, dtypes and shapes, from one export pass on first call (a collective; cached:
        the names and shapes of a policy do not change)."""
        if self._meta is None:
            self._meta = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._export()]
        return self._meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._export())


Backend = Literal["video_grpo_gloo", "nccl", "ipc"]


def sender_address(base_url: str) -> str:
    """This host's address on its route to the server at ``base_url`` (loopback for a local
    server): where the server's workers reach the sender's rendezvous."""
    parsed = urllib.parse.urlsplit(base_url)
    host = parsed.hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, parsed.port or 80))  # no packet: picks the route's interface
        return probe.getsockname()[0]


class WeightSync:
    """One policy rank's connection to one vLLM server (see the module docstring)."""

    def __init__(self, export: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> None:
        self.source = PolicyWeightSource(export)
        self.engine: TrainerWeightTransferEngine[Any] | None = None

    def connect(
        self,
        base_url: str,
        *,
        backend: Backend,
        master_address: str,
        master_port: int,
        vllm_workers: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 600.0,
    ) -> None:
        """Rendezvous with the server's workers (again after a restart: the old group is
        dropped). Every rank calls it; the sender (global rank 0) drives the handshake."""
        from vllm_video_plugin.refit import RefitClient

        self.close()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        client = RefitClient(base_url, timeout_s=timeout_s)
        if backend == GLOO_BACKEND:
            info: TrainerInitInfo = GlooTrainerInitInfo(
                master_address=master_address,
                master_port=master_port,
                world_size=1 + vllm_workers,
                bucket_bytes=bucket_bytes,
                timeout_s=timeout_s,
                rank=rank,
            )
        elif backend == "ipc":
            # No rendezvous: every rank shares its buffer's handle, rank 0 ships them all (vLLM's
            # workers pick the one of their GPU). Packed: one bucket-sized buffer per rank.
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=bucket_bytes)
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(
                master_address=master_address,
                master_port=master_port,
                world_size=1 + vllm_workers,
                packed_buffer_size_bytes=bucket_bytes,
                rank=rank,
            )
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)

    def send(self) -> dict[str, float]:
        """Send the current weights (every rank calls it). Returns the sender's figures
        (``refit/bytes``, ``refit/buckets``, ``refit/transfer_s``; empty on other ranks)."""
        if self.engine is None:
            raise RuntimeError("WeightSync.send before connect()")
        started = time.monotonic()
        self.engine.send_weights()
        last = getattr(self.engine, "last", None)
        if not self.engine.is_sender:
            return {}
        figures = {"refit/transfer_s": time.monotonic() - started}
        if last is not None:
            figures |= {"refit/bytes": float(last.bytes), "refit/buckets": float(last.buckets)}
        return figures

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
