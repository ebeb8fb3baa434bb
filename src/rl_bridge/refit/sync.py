"""What a policy rank holds to refit vLLM servers in memory: its weights as a source, and one
trainer engine per server.

The trainer side of vLLM's weight-transfer API: :class:`~rl_bridge.refit.client.RefitClient`
drives the HTTP control plane (it implements vLLM's ``VLLMWeightSyncClient``) while a
trainer-side engine moves the tensors:

- ``video_grpo_gloo`` (CPU): :class:`~rl_bridge.refit.engines.GlooTrainerWeightTransferEngine`,
  the trainer half of :mod:`vllm_video_plugin.refit_receiver`;
- ``nccl`` (GPUs, split placement) and ``ipc`` (GPUs, colocated: each policy rank packs its export
  into one bucket-sized device buffer that vLLM's worker on the same GPU reads through a CUDA IPC
  handle): vLLM's stock engines, or before 0.27 (``ipc``; also later while vLLM's worker still maps
  a packed export per chunk, which strands vLLM's own trainer buffer) and 0.28 (``nccl``)
  :mod:`rl_bridge.refit.legacy_engines` (:mod:`vllm_video_plugin.compat`).

:class:`PolicyWeightSource` is a ``WeightSource`` over a policy's
:meth:`~rl_bridge.megatron.policy.MegatronPolicy.export_hf_weights` stream (tensor-parallel
shards gathered per tensor by Megatron-Bridge, the vision tower and projector included);
:class:`WeightSync` is one rank's connection to one server, re-created when the server restarts.
Every rank of the policy calls :meth:`WeightSync.connect` and :meth:`WeightSync.send` (the export
is a collective); global rank 0 is the sender.
"""

from __future__ import annotations

import math
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Literal

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from rl_bridge.refit.client import RefitClient
from rl_bridge.refit.engines import DEFAULT_BUCKET_BYTES, GlooTrainerInitInfo
from rl_bridge.refit.legacy_engines import (
    IPCLegacyTrainerInitInfo,
    IPCLegacyTrainerWeightTransferEngine,
    NCCLLegacyTrainerInitInfo,
    NCCLLegacyTrainerWeightTransferEngine,
)
from vllm_video_plugin import compat
from vllm_video_plugin.refit_receiver import GLOO_BACKEND

__all__ = ["Backend", "PolicyWeightSource", "WeightSync", "ipc_buffer_bytes", "sender_address"]


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

    def known_bytes(self) -> int | None:
        """The export's size in bytes once :meth:`metadata` has run (``None`` before: no export
        pass is started for it)."""
        if self._meta is None:
            return None
        return sum(map(_nbytes, self._meta))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._export())


Backend = Literal["video_grpo_gloo", "nccl", "ipc"]


def _nbytes(meta: ParamMeta) -> int:
    return math.prod(meta.shape) * meta.dtype.itemsize


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
        (``refit/bytes``, ``refit/buckets``, ``refit/transfer_s``; empty on other ranks). Engines that
        keep no per-send record (vLLM's ``ipc``) report the export's size as ``refit/bytes``."""
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
        elif (size := self.source.known_bytes()) is not None:
            figures["refit/bytes"] = float(size)
        return figures

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def ipc_buffer_bytes(source: WeightSource, bucket_bytes: int) -> int:
    """The size of a rank's packed ``ipc`` buffer: ``bucket_bytes``, or the export's largest tensor
    where that is larger. vLLM's ``packed_ipc_producer`` packs into one buffer and refuses a larger
    tensor (the NCCL packer sends one whole); a Qwen2.5-VL-3B embedding is 594 MiB against the
    default 256 MiB buckets. Reads the source's metadata (one export pass, a collective, cached)."""
    largest = max(map(_nbytes, source.metadata()), default=0)
    return max(bucket_bytes, largest)


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
    from 0.27 where its worker maps each packed export once, ``nccl`` from 0.28), else
    :mod:`.legacy_engines`' engine of the older protocol."""
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
        # workers pick the one of their GPU). Packed: one bucket-sized buffer per rank. vLLM's own
        # trainer engine only where its worker maps each export once (else its buffer leaks).
        bucket_bytes = ipc_buffer_bytes(source, bucket_bytes)
        if not (compat.has_stock_trainer_engine("ipc") and compat.ipc_worker_imports_once()):
            return IPCLegacyTrainerWeightTransferEngine.trainer_init(
                IPCLegacyTrainerInitInfo(rank=rank, packed_buffer_size_bytes=bucket_bytes),
                client=client,
                source=source,
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
