"""Trainer halves of vLLM's own GPU engines (``ipc``, ``nccl``) for releases that have none.

vLLM registers trainer engines for its ``ipc`` worker engine from 0.27 and for ``nccl`` from 0.28
(:func:`vllm_video_plugin.compat.has_stock_trainer_engine`). Before, a trainer drives the worker
engine's HTTP calls itself and sends the data with the release's own producers (what the worker
engine's static ``trainer_send_weights`` does); these two engines do exactly that, through the
same ``VLLMWeightSyncClient``, with the payloads of ``compat.ipc_*`` and ``compat.nccl_*``.

One departure: ``ipc`` packs with :func:`packed_ipc_chunks`, not the release's
``packed_ipc_producer``. torch pairs one ``reduce_tensor`` export of a CUDA buffer with one
rebuild-and-release by the consumer (the export sets a shared counter to 1, each release takes one
off, and the producer reclaims a dropped buffer only once it reads 0). Before 0.27 the producer
exports its buffer once and the worker rebuilds and releases it for every chunk, so an export of
``k`` chunks ends at ``1 - k`` and the buffer is never reclaimed: one buffer a refit, the largest
tensor's size or more (0.58 GiB a step on a Qwen2.5-VL-3B; vLLM issue 51258, fixed on the worker's
side from the release that imports each export once). Exported once per chunk, every count ends at 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from torch.multiprocessing.reductions import reduce_tensor
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from rl_bridge.refit.engines import DEFAULT_BUCKET_BYTES
from vllm_video_plugin import compat

__all__ = [
    "IPCLegacyTrainerInitInfo",
    "IPCLegacyTrainerWeightTransferEngine",
    "NCCLLegacyTrainerInitInfo",
    "NCCLLegacyTrainerWeightTransferEngine",
    "PackedChunk",
    "packed_ipc_chunks",
]


@dataclass(frozen=True)
class PackedChunk:
    """One chunk of a packed ``ipc`` export: what ``/update_weights`` announces for it."""

    names: list[str]
    shapes: list[list[int]]
    dtype_names: list[str]
    tensor_sizes: list[int]
    """Bytes of each tensor, packed back to back from the buffer's start."""
    ipc_handle: dict[str, tuple[Any, ...]]
    """GPU UUID -> ``rebuild_cuda_tensor`` arguments of this chunk's own export of the buffer."""


def packed_ipc_chunks(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    gpu_uuid: str,
    buffer_bytes: int,
    device: torch.device | str = "cuda",
    export: Callable[[torch.Tensor], tuple[Any, tuple[Any, ...]]] = reduce_tensor,
) -> Iterator[PackedChunk]:
    """Pack ``tensors`` in order into one ``buffer_bytes`` device buffer, yielding a chunk each time
    the next tensor would not fit and after the last: the packing of vLLM's ``packed_ipc_producer``
    (the same chunks), except that the buffer is exported (``export``, torch's ``reduce_tensor``)
    once per chunk, so that each of the worker's per-chunk rebuilds releases an export of its own
    (see the module docstring). The caller must wait until the worker has read a chunk before it
    resumes the generator, which then overwrites the buffer.

    Raises:
        ValueError: a tensor is larger than the buffer.
    """
    buffer = torch.empty(buffer_bytes, dtype=torch.uint8, device=device)
    names: list[str] = []
    shapes: list[list[int]] = []
    dtype_names: list[str] = []
    sizes: list[int] = []
    used = 0

    def chunk() -> PackedChunk:
        if buffer.is_cuda:  # the copies queued on the stream land before the worker reads
            torch.cuda.current_stream().synchronize()
        _, rebuild_args = export(buffer)
        return PackedChunk(names, shapes, dtype_names, sizes, {gpu_uuid: rebuild_args})

    for name, tensor in tensors:
        flat = tensor.contiguous().view(torch.uint8).view(-1)
        if flat.numel() > buffer_bytes:
            raise ValueError(
                f"ipc refit: {name} is {flat.numel()} bytes, more than the {buffer_bytes}-byte buffer "
                "(rl_bridge.refit.sync.ipc_buffer_bytes sizes it for the export's largest tensor)"
            )
        if used and used + flat.numel() > buffer_bytes:
            yield chunk()
            names, shapes, dtype_names, sizes, used = [], [], [], [], 0
        buffer[used : used + flat.numel()].copy_(flat)
        names.append(name)
        shapes.append(list(tensor.shape))
        dtype_names.append(str(tensor.dtype).removeprefix("torch."))
        sizes.append(flat.numel())
        used += flat.numel()
    if used:
        yield chunk()


def _all_gather_ipc_handle(
    handle: dict[str, tuple[Any, ...]], *, is_sender: bool
) -> dict[str, tuple[Any, ...]]:
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
    of :func:`packed_ipc_chunks` (every rank copies its export into one bucket-sized device
    buffer, exported for IPC once per chunk) the ranks all-gather their buffers' handles and the sender
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
        super().__init__(
            *compat.trainer_engine_config_args("ipc"), client=client, source=source, is_sender=is_sender
        )
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
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            bucket_bytes=init_info.packed_buffer_size_bytes,
        )
        if engine.is_sender:
            client.init_weight_transfer_engine(compat.ipc_worker_init_payload(packed=True))
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        gpu_uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        if self.is_sender:
            self.client.start_weight_update()
        for chunk in packed_ipc_chunks(iter(self.source), gpu_uuid=gpu_uuid, buffer_bytes=self.bucket_bytes):
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
        super().__init__(
            *compat.trainer_engine_config_args("nccl"), client=client, source=source, is_sender=is_sender
        )
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


def _checked(
    pairs: Iterator[tuple[str, torch.Tensor]], meta: list[ParamMeta]
) -> Iterator[tuple[str, torch.Tensor]]:
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
