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
  worker on the same GPU reads it through a CUDA IPC handle). vLLM has trainer halves for those
  from 0.27 (``ipc``) and 0.28 (``nccl``); before, :class:`IPCLegacyTrainerWeightTransferEngine`
  and :class:`NCCLLegacyTrainerWeightTransferEngine` speak the older protocol
  (:mod:`vllm_video_plugin.compat`);
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

from vllm_video_plugin import compat
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
    "IPCLegacyTrainerInitInfo",
    "IPCLegacyTrainerWeightTransferEngine",
    "NCCLLegacyTrainerInitInfo",
    "NCCLLegacyTrainerWeightTransferEngine",
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


# The trainer engines below subclass vLLM's TrainerWeightTransferEngine unparameterised: it is
# generic over (config, init info) before vLLM 0.27 and over the init info from 0.27
# (compat.trainer_engine_takes_config), and takes the config first in __init__ before 0.27.


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine):
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
        super().__init__(
            *compat.trainer_engine_config_args(GLOO_BACKEND), client=client, source=source, is_sender=is_sender
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


# -- vLLM's own GPU engines where the release has no trainer half for them ----------------------
#
# vLLM registers trainer engines for its `ipc` worker engine from 0.27 and for `nccl` from 0.28
# (compat.has_stock_trainer_engine). Before, a trainer drives the worker engine's HTTP calls
# itself and sends the data with the release's own producers (what the worker engine's static
# trainer_send_weights does); these two engines do exactly that, through the same
# VLLMWeightSyncClient, with the payloads of compat.ipc_* and compat.nccl_*.


def _all_gather_ipc_handle(handle: dict[str, tuple[Any, ...]], *, is_sender: bool) -> dict[str, tuple[Any, ...]]:
    """Every trainer rank's CUDA IPC handle of its buffer, merged on the sender (GPU UUID ->
    rebuild arguments; each vLLM worker picks the one of its GPU), over the default process group
    as vLLM's ``ipc`` engine does; ``{}`` on the other ranks; this rank's own without a group."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return handle
    gathered: list[dict[str, tuple[Any, ...]] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, handle)
    torch.distributed.barrier()
    torch.cuda.synchronize()
    merged: dict[str, tuple[Any, ...]] = {}
    if is_sender:
        for rank_handle in gathered:
            merged.update(rank_handle or {})
    return merged


def _ipc_post_send_sync() -> None:
    """Every rank waits until the workers have read the shared buffer before it is reused."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
    torch.cuda.ipc_collect()


@dataclass
class IPCLegacyTrainerInitInfo(TrainerInitInfo):
    """:class:`IPCLegacyTrainerWeightTransferEngine`'s init info (vLLM before 0.27)."""

    backend: ClassVar[str] = "ipc"

    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    """The bucket-sized device buffer each rank packs its export into."""


class IPCLegacyTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """The trainer half of vLLM's ``ipc`` engine for releases that have none (before 0.27),
    packed, as vLLM 0.27's ``IPCTrainerWeightTransferEngine`` does it: the sender initialises the
    worker engine (an empty init info), then per update ``/start_weight_update``; for each chunk
    of vLLM's ``packed_ipc_producer`` (every rank copies its export into one bucket-sized device
    buffer, registered for IPC once) the ranks all-gather their buffers' handles and the sender
    posts one ``/update_weights`` (names, dtypes, shapes, ``tensor_sizes``, the handles by GPU
    UUID, ``packed: true``), and every rank waits at a barrier before the buffer is refilled;
    ``/finish_weight_update`` last. This is what 0.26's static
    ``IPCWeightTransferEngine.trainer_send_weights`` does with ``packed=True``, with the HTTP calls
    going through the client (which pickles the handles as that method's ``http`` mode does).
    """

    init_info_cls = IPCLegacyTrainerInitInfo

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool = True, bucket_bytes: int
    ) -> None:
        super().__init__(*compat.trainer_engine_config_args("ipc"), client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes

    @classmethod
    def trainer_init(
        cls,
        init_info: IPCLegacyTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        config: Any = None,
    ) -> Self:
        if source is None:
            raise ValueError("ipc: the trainer engine needs a WeightSource")
        engine = cls(
            client=client, source=source, is_sender=init_info.is_sender, bucket_bytes=init_info.packed_buffer_size_bytes
        )
        if engine.is_sender:
            client.init_weight_transfer_engine(compat.ipc_worker_init_payload(packed=True))
        return engine

    def send_weights(self) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_producer

        assert self.source is not None
        gpu_uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        if self.is_sender:
            self.client.start_weight_update()
        for chunk in packed_ipc_producer(
            iterator=iter(self.source),
            gpu_uuid=gpu_uuid,
            post_iter_func=lambda item: item[1],
            buffer_size_bytes=self.bucket_bytes,
        ):
            handles = _all_gather_ipc_handle(chunk.ipc_handle, is_sender=self.is_sender)
            if self.is_sender:
                self.client.update_weights(
                    compat.ipc_update_payload(
                        names=chunk.names,
                        dtype_names=chunk.dtype_names,
                        shapes=chunk.shapes,
                        ipc_handles=handles,
                        tensor_sizes=chunk.tensor_sizes,
                    )
                )
            _ipc_post_send_sync()
        if self.is_sender:
            self.client.finish_weight_update()
        _ipc_post_send_sync()


@dataclass
class NCCLLegacyTrainerInitInfo(TrainerInitInfo):
    """:class:`NCCLLegacyTrainerWeightTransferEngine`'s init info (vLLM before 0.28)."""

    backend: ClassVar[str] = "nccl"

    master_address: str
    master_port: int
    world_size: int
    """1 (the sender) + every vLLM worker fed."""
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    packed_num_buffers: int = 2
    """vLLM's default: the sender packs the next buffer while the last one is broadcast."""


class NCCLLegacyTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """The trainer half of vLLM's ``nccl`` engine for releases that have none (before 0.28), as
    vLLM 0.28's ``NCCLTrainerWeightTransferEngine`` does it: the sender posts
    ``/init_weight_transfer_engine`` (the rendezvous, workers from rank 1) while it opens its own
    end, rank 0, with the release's ``nccl_common.trainer_init`` (a ``PyNcclCommunicator`` on the
    current CUDA device). Per update every rank reads the source's metadata (a collective for a
    Megatron export); the sender posts ``/start_weight_update``, then ``/update_weights``
    announcing every tensor (names, dtypes, shapes and the packing, ``packed: true``) while it
    broadcasts them with the release's ``packed_nccl_broadcast_producer``, then
    ``/finish_weight_update``; the other ranks only iterate the source (the export's collective).
    """

    init_info_cls = NCCLLegacyTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool = True,
        bucket_bytes: int,
        num_buffers: int,
    ) -> None:
        super().__init__(*compat.trainer_engine_config_args("nccl"), client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.num_buffers = num_buffers
        self.group: Any = None

    @classmethod
    def trainer_init(
        cls,
        init_info: NCCLLegacyTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        config: Any = None,
    ) -> Self:
        if source is None:
            raise ValueError("nccl: the trainer engine needs a WeightSource")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            bucket_bytes=init_info.packed_buffer_size_bytes,
            num_buffers=init_info.packed_num_buffers,
        )
        if not engine.is_sender:
            return engine
        from vllm.distributed.weight_transfer.nccl_common import trainer_init as open_trainer_end

        worker = compat.nccl_worker_init_payload(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            world_size=init_info.world_size,
            packed=True,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            packed_num_buffers=init_info.packed_num_buffers,
        )
        # The workers block in init_weight_transfer_engine until the group forms: join meanwhile.
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(client.init_weight_transfer_engine, worker)
            engine.group = open_trainer_end(
                {
                    "master_address": init_info.master_address,
                    "master_port": init_info.master_port,
                    "world_size": init_info.world_size,
                }
            )
            answer.result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata()  # a collective on every rank for a Megatron export
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        assert self.group is not None, "trainer_init() first"
        update = compat.nccl_update_payload(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
            shapes=[list(m.shape) for m in meta],
            packed=True,
            packed_buffer_size_bytes=self.bucket_bytes,
            packed_num_buffers=self.num_buffers,
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            # The workers receive inside update_weights: it runs while the sender broadcasts.
            answer = pool.submit(self.client.update_weights, update)
            if answer.done():
                answer.result()  # refused before any broadcast: do not wait for a peer that left
            packed_nccl_broadcast_producer(
                iterator=_checked(iter(self.source), meta),
                group=self.group,
                src=0,
                post_iter_func=lambda item: item[1],
                buffer_size_bytes=self.bucket_bytes,
                num_buffers=self.num_buffers,
            )
            answer.result()
        finally:
            pool.shutdown(wait=False)  # a failed broadcast leaves the call blocked in NCCL
        self.client.finish_weight_update()
        torch.cuda.current_stream().synchronize()

    def shutdown(self) -> None:
        self.group = None  # the communicator is released with its last reference, as vLLM does


def _checked(pairs: Iterator[tuple[str, torch.Tensor]], meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's pairs, each checked against the metadata the workers were announced (the
    workers cut their receive buffers from it: a disagreement would hang the broadcast or load
    garbage)."""
    count = 0
    for name, tensor in pairs:
        if count >= len(meta) or (name, tensor.dtype, tuple(tensor.shape)) != (
            meta[count].name,
            meta[count].dtype,
            tuple(meta[count].shape),
        ):
            expected = meta[count] if count < len(meta) else None
            raise ValueError(
                f"weight source disagrees with its metadata at tensor {count}: announced {expected}, "
                f"got {name!r} {tensor.dtype} {tuple(tensor.shape)}"
            )
        count += 1
        yield name, tensor
    if count != len(meta):
        raise ValueError(f"weight source yielded {count} tensors, its metadata announced {len(meta)}")


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
        self.engine: TrainerWeightTransferEngine | None = None

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
        self.engine = _trainer_engine(
            backend,
            client=client,
            source=self.source,
            rank=rank,
            master_address=master_address,
            master_port=master_port,
            world_size=1 + vllm_workers,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
        )

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


def _trainer_engine(
    backend: Backend,
    *,
    client: VLLMWeightSyncClient,
    source: WeightSource,
    rank: int,
    master_address: str,
    master_port: int,
    world_size: int,
    bucket_bytes: int,
    timeout_s: float,
) -> TrainerWeightTransferEngine:
    """A ready trainer engine of ``backend`` for this rank: through vLLM's trainer factory where
    the installed release registers one for it (ours, ``video_grpo_gloo``, always; vLLM's ``ipc``
    from 0.27, ``nccl`` from 0.28), else this module's engine of the older protocol."""
    if backend == GLOO_BACKEND:
        info: TrainerInitInfo = GlooTrainerInitInfo(
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            rank=rank,
        )
    elif backend == "ipc":
        # No rendezvous: every rank shares its buffer's handle, rank 0 ships them all (vLLM's
        # workers pick the one of their GPU). Packed: one bucket-sized buffer per rank.
        if not compat.has_stock_trainer_engine("ipc"):
            return IPCLegacyTrainerWeightTransferEngine.trainer_init(
                IPCLegacyTrainerInitInfo(rank=rank, packed_buffer_size_bytes=bucket_bytes), client=client, source=source
            )
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=bucket_bytes)
    elif backend == "nccl":
        if not compat.has_stock_trainer_engine("nccl"):
            legacy = NCCLLegacyTrainerInitInfo(
                master_address=master_address,
                master_port=master_port,
                world_size=world_size,
                packed_buffer_size_bytes=bucket_bytes,
                rank=rank,
            )
            return NCCLLegacyTrainerWeightTransferEngine.trainer_init(legacy, client=client, source=source)
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            packed_buffer_size_bytes=bucket_bytes,
            rank=rank,
        )
    else:
        raise ValueError(f"unknown weight-transfer backend {backend!r}: one of {GLOO_BACKEND}, nccl, ipc")
    return compat.trainer_factory_init(info, client=client, source=source)
