"""The trainer's refit on every supported vLLM release, in the parts that run without a GPU.

On vLLM 0.26 (and 0.27 for ``nccl``) vLLM has no trainer half for its ``ipc`` and ``nccl``
engines, so :mod:`rl_bridge.refit.sync` drives them itself
(:class:`~rl_bridge.refit.legacy_engines.IPCLegacyTrainerWeightTransferEngine`,
:class:`~rl_bridge.refit.legacy_engines.NCCLLegacyTrainerWeightTransferEngine`). Their data planes need CUDA;
here vLLM's producers are replaced by recorders and the control plane by a fake client, so the
order of the HTTP calls, their payloads for the release and the rank roles are checked. Against a
server without weight versions (vLLM 0.26) the refit client keeps the version itself. The ``ipc``
packer runs here on a CPU buffer with its export recorded: one export per chunk, the only pairing
with 0.26's per-chunk rebuild that lets the trainer reclaim the buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rl_bridge.refit import legacy_engines, sync
from rl_bridge.refit.client import RefitClient
from rl_bridge.refit.legacy_engines import (
    IPCLegacyTrainerInitInfo,
    IPCLegacyTrainerWeightTransferEngine,
    NCCLLegacyTrainerInitInfo,
    NCCLLegacyTrainerWeightTransferEngine,
    packed_ipc_chunks,
)
from rl_bridge.refit.sync import PolicyWeightSource
from vllm_video_plugin import compat

pytestmark = pytest.mark.unit

INSTALLED = compat.installed_version()

WEIGHTS = [
    ("model.embed_tokens.weight", torch.ones(4, 2)),
    ("model.norm.weight", torch.zeros(2, dtype=torch.bfloat16)),
]


class Client:
    """vLLM's weight-sync control plane, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", init_info))

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


@pytest.fixture(params=["0.26.0", "0.32.0"])
def release(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The payload builders and the trainer-engine base as the given release has them (the
    installed vLLM's classes are used: only the payloads and the base's arguments differ)."""
    version = request.param
    installed = compat.installed_version()
    base_args = compat.trainer_engine_config_args
    monkeypatch.setattr(compat, "installed_version", lambda: version)
    monkeypatch.setattr(
        compat, "trainer_engine_config_args", lambda backend, version=None: base_args(backend, installed)
    )
    return version


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="GPU-0"))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(synchronize=lambda: None))


def test_the_legacy_ipc_engine_drives_the_update_with_the_releases_payloads(
    release: str, no_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def producer(tensors: Iterator[tuple[str, torch.Tensor]], *, gpu_uuid: str, buffer_bytes: int):  # type: ignore[no-untyped-def]
        assert buffer_bytes == 1 << 20
        for name, tensor in tensors:  # one chunk per tensor here
            yield SimpleNamespace(
                names=[name],
                dtype_names=[str(tensor.dtype).split(".")[-1]],
                shapes=[list(tensor.shape)],
                tensor_sizes=[tensor.numel() * tensor.element_size()],
                ipc_handle={gpu_uuid: ("rebuild", name)},
            )

    monkeypatch.setattr(legacy_engines, "packed_ipc_chunks", producer)
    client = Client()
    engine = IPCLegacyTrainerWeightTransferEngine.trainer_init(
        IPCLegacyTrainerInitInfo(rank=0, packed_buffer_size_bytes=1 << 20),
        client=client,  # type: ignore[arg-type]
        source=PolicyWeightSource(lambda: iter(WEIGHTS)),
    )
    engine.send_weights()
    kinds = [kind for kind, _ in client.calls]
    assert kinds == ["init", "start", "update", "update", "finish"]
    assert client.calls[0][1] == ({} if release == "0.26.0" else {"packed": True})
    first = client.calls[2][1]
    expected = {
        "names": ["model.embed_tokens.weight"],
        "dtype_names": ["float32"],
        "shapes": [[4, 2]],
        "ipc_handles": {"GPU-0": ("rebuild", "model.embed_tokens.weight")},
        "tensor_sizes": [32],
    }
    assert first == (expected | {"packed": True} if release == "0.26.0" else expected)


def test_a_non_sender_ipc_rank_packs_its_buffer_and_calls_nothing(
    release: str, no_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed: list[str] = []

    def producer(tensors: Iterator[tuple[str, torch.Tensor]], **kwargs: Any):  # type: ignore[no-untyped-def]
        for name, _ in tensors:
            packed.append(name)
            yield SimpleNamespace(names=[name], dtype_names=[], shapes=[], tensor_sizes=[], ipc_handle={})

    monkeypatch.setattr(legacy_engines, "packed_ipc_chunks", producer)
    client = Client()
    engine = IPCLegacyTrainerWeightTransferEngine.trainer_init(
        IPCLegacyTrainerInitInfo(rank=1),
        client=client,
        source=PolicyWeightSource(lambda: iter(WEIGHTS)),  # type: ignore[arg-type]
    )
    engine.send_weights()
    assert client.calls == [] and packed == [name for name, _ in WEIGHTS]


def test_the_ipc_packer_packs_in_order_and_exports_the_buffer_once_per_chunk() -> None:
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    tensors = dict(
        a=torch.arange(6, dtype=torch.float32),  # 24 bytes
        b=torch.full((2, 3), 7, dtype=torch.bfloat16),  # 12
        c=torch.arange(8, dtype=torch.int64),  # 64: the whole buffer
        d=torch.tensor([1.5]),  # 4
    )
    exported: list[tuple[int, torch.Tensor]] = []  # (buffer address, its bytes when exported)

    def export(buffer: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
        exported.append((buffer.data_ptr(), buffer.clone()))
        return None, ("export", len(exported))

    chunks = []
    packer = packed_ipc_chunks(
        tensors.items(), gpu_uuid="GPU-0", buffer_bytes=64, device="cpu", export=export
    )
    for chunk in packer:
        assert chunk.ipc_handle == {"GPU-0": ("export", len(exported))}  # this chunk's own export
        received = unpack_tensor(  # what vLLM's worker reads from it
            exported[-1][1][: sum(chunk.tensor_sizes)],
            chunk.names,
            chunk.shapes,
            [getattr(torch, name) for name in chunk.dtype_names],
            chunk.tensor_sizes,
        )
        for name, tensor in received:
            assert torch.equal(tensor, tensors[name]), name
        chunks.append((chunk.names, chunk.tensor_sizes))
    assert chunks == [(["a", "b"], [24, 12]), (["c"], [64]), (["d"], [4])]
    assert len(exported) == 3 and len({address for address, _ in exported}) == 1  # one buffer


def test_the_ipc_packer_refuses_a_tensor_larger_than_its_buffer() -> None:
    with pytest.raises(ValueError, match=r"big is 80 bytes, more than the 64-byte buffer"):
        list(
            packed_ipc_chunks(
                [("small", torch.zeros(2)), ("big", torch.zeros(20))],
                gpu_uuid="GPU-0",
                buffer_bytes=64,
                device="cpu",
                export=lambda buffer: (None, ()),
            )
        )


def test_the_legacy_nccl_engine_announces_every_tensor_while_it_broadcasts(
    release: str, no_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor

    opened: list[dict[str, Any]] = []
    broadcast: list[str] = []
    monkeypatch.setattr(
        nccl_common, "trainer_init", lambda info: opened.append(info) or "group", raising=False
    )

    def producer(
        iterator: Iterator[tuple[str, torch.Tensor]],
        group: Any,
        src: int,
        post_iter_func: Any,
        buffer_size_bytes: int,
        num_buffers: int,
    ) -> None:  # noqa: E501
        assert (group, src, buffer_size_bytes, num_buffers) == ("group", 0, 1 << 20, 2)
        broadcast.extend(name for name, _ in iterator)

    monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_producer", producer)
    client = Client()
    info = NCCLLegacyTrainerInitInfo(
        master_address="10.0.0.1", master_port=29500, world_size=3, packed_buffer_size_bytes=1 << 20, rank=0
    )
    engine = NCCLLegacyTrainerWeightTransferEngine.trainer_init(
        info,
        client=client,
        source=PolicyWeightSource(lambda: iter(WEIGHTS)),  # type: ignore[arg-type]
    )
    assert opened == [{"master_address": "10.0.0.1", "master_port": 29500, "world_size": 3}]
    engine.send_weights()
    assert [kind for kind, _ in client.calls] == ["init", "start", "update", "finish"]
    packing = {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}
    rendezvous = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3}
    meta = {"names": [n for n, _ in WEIGHTS], "dtype_names": ["float32", "bfloat16"], "shapes": [[4, 2], [2]]}
    if release == "0.26.0":
        assert client.calls[0][1] == rendezvous and client.calls[2][1] == meta | packing
    else:
        assert client.calls[0][1] == rendezvous | packing and client.calls[2][1] == meta
    assert broadcast == meta["names"]


def test_the_legacy_nccl_engine_refuses_a_source_that_disagrees_with_its_metadata(
    release: str, no_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.weight_transfer import nccl_common, packed_tensor

    monkeypatch.setattr(nccl_common, "trainer_init", lambda info: "group", raising=False)
    monkeypatch.setattr(
        packed_tensor, "packed_nccl_broadcast_producer", lambda iterator, **kwargs: [None for _ in iterator]
    )
    passes = iter([WEIGHTS, list(reversed(WEIGHTS))])  # the second export comes in another order
    info = NCCLLegacyTrainerInitInfo(master_address="h", master_port=1, world_size=2, rank=0)
    engine = NCCLLegacyTrainerWeightTransferEngine.trainer_init(
        info,
        client=Client(),
        source=PolicyWeightSource(lambda: iter(next(passes))),  # type: ignore[arg-type]
    )
    with pytest.raises(ValueError, match="disagrees with its metadata at tensor 0"):
        engine.send_weights()


def engine_args() -> dict[str, Any]:
    """``sync._trainer_engine``'s keyword arguments for one sender and one vLLM worker."""
    return {
        "client": Client(),
        "source": PolicyWeightSource(lambda: iter(WEIGHTS)),
        "rank": 0,
        "master_address": "h",
        "master_port": 1,
        "world_size": 2,
        "bucket_bytes": 1 << 20,
        "timeout_s": 5.0,
    }


@pytest.mark.parametrize(
    "release", sorted({"0.26.0", INSTALLED})
)  # stock init infos: the installed release's
def test_weight_sync_picks_vllms_trainer_engine_where_the_release_has_one(
    release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "installed_version", lambda: release)
    made: list[Any] = []
    monkeypatch.setattr(compat, "trainer_factory_init", lambda info, **kwargs: made.append(info) or "stock")
    monkeypatch.setattr(
        IPCLegacyTrainerWeightTransferEngine,
        "trainer_init",
        classmethod(lambda cls, info, **kw: "ipc-legacy"),
    )
    monkeypatch.setattr(
        NCCLLegacyTrainerWeightTransferEngine,
        "trainer_init",
        classmethod(lambda cls, info, **kw: "nccl-legacy"),
    )
    engines = {
        backend: sync._trainer_engine(backend, **engine_args())
        for backend in ("video_grpo_gloo", "ipc", "nccl")
    }
    if release == "0.26.0":
        assert engines == {"video_grpo_gloo": "stock", "ipc": "ipc-legacy", "nccl": "nccl-legacy"}
    else:
        assert engines == {"video_grpo_gloo": "stock", "ipc": "stock", "nccl": "stock"}
        assert [type(info).__name__ for info in made] == [
            "GlooTrainerInitInfo",
            "IPCTrainerInitInfo",
            "NCCLTrainerInitInfo",
        ]


def test_ipc_keeps_the_per_chunk_exporter_where_the_worker_maps_per_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release with vLLM's trainer engine but a worker without ``PackedBufferImporter`` (vLLM PR
    51259) would strand vLLM's once-exported buffer every refit: this package's engine is used."""
    from vllm.distributed.weight_transfer import packed_tensor

    monkeypatch.setattr(compat, "has_stock_trainer_engine", lambda backend, version=None: True)
    monkeypatch.setattr(compat, "trainer_factory_init", lambda info, **kwargs: "stock")
    monkeypatch.setattr(
        IPCLegacyTrainerWeightTransferEngine, "trainer_init", classmethod(lambda cls, info, **kw: "ours")
    )
    if hasattr(packed_tensor, "PackedBufferImporter"):
        assert sync._trainer_engine("ipc", **engine_args()) == "stock"
        monkeypatch.delattr(packed_tensor, "PackedBufferImporter")
    assert sync._trainer_engine("ipc", **engine_args()) == "ours"


@pytest.mark.parametrize("release", sorted({"0.26.0", INSTALLED}))
def test_the_ipc_buffer_holds_the_largest_tensor_of_the_export(
    release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's packed_ipc_producer refuses a tensor larger than its one buffer (a Qwen2.5-VL-3B
    embedding, 594 MiB, against 256 MiB buckets stopped the first H200 run at its first refit)."""
    monkeypatch.setattr(compat, "installed_version", lambda: release)
    sizes: list[int] = []
    record = lambda info, **kw: sizes.append(info.packed_buffer_size_bytes)  # noqa: E731
    monkeypatch.setattr(compat, "trainer_factory_init", record)
    monkeypatch.setattr(
        IPCLegacyTrainerWeightTransferEngine, "trainer_init", classmethod(lambda cls, info, **_: record(info))
    )
    embedding = ("model.embed_tokens.weight", torch.zeros(1000, 300, dtype=torch.bfloat16))  # 600,000 B
    for weights, expected in ((WEIGHTS, 1 << 16), ([*WEIGHTS, embedding], 600_000)):
        sync._trainer_engine(
            "ipc", client=Client(), source=PolicyWeightSource(lambda weights=weights: iter(weights)), rank=0,
            master_address="h", master_port=1, world_size=2, bucket_bytes=1 << 16, timeout_s=5.0,
        )  # fmt: skip
        assert sizes.pop() == expected


class VersionlessServer:
    """A vLLM 0.26 server's answers to the refit client: no weight-version routes."""

    def __init__(self) -> None:
        self.started = 1000.0
        self.posts: list[str] = []

    def __call__(self, client: RefitClient, method: str, path: str, body: Any, *, step: str) -> Any:
        if path == "/version":
            return {"version": "0.26.0"}
        if path == "/metrics":
            return f"# HELP process_start_time_seconds ...\nprocess_start_time_seconds {self.started}\n"
        assert path not in ("/update_weight_version", "/weight_info", "/shutdown_weight_transfer_engine"), (
            path
        )
        self.posts.append(path.split("?")[0])
        return {}


def test_against_a_server_without_weight_versions_the_client_keeps_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server = VersionlessServer()
    monkeypatch.setattr(RefitClient, "_request", lambda self, *args, **kwargs: server(self, *args, **kwargs))
    client = RefitClient("http://127.0.0.1:1")
    assert client.weight_version() == "default"
    result = client.refit_with(lambda: None, version="step-1")
    assert (result.weight_version, result.version_kept_by) == ("step-1", "client")
    assert "keeps no weight versions" in caplog.text
    client.update_weight_version("step-2")  # a step that trained nothing
    assert client.weight_version() == "step-2"
    client.finish_weight_update("step-3")
    assert client.weight_version() == "step-3"
    client.shutdown_weight_transfer_engine()  # no such route: nothing to do
    assert server.posts == [
        "/pause",
        "/reset_prefix_cache",
        "/reset_encoder_cache",
        "/reset_mm_cache",
        "/resume",
        "/finish_weight_update",
    ]
    server.started = 2000.0  # restarted: it serves its checkpoint again
    assert client.weight_version() == "default"
    client.update_weight_version("step-3")
    assert client.weight_version() == "step-3"


def test_against_a_server_with_weight_versions_the_server_keeps_them(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []

    def answer(client: RefitClient, method: str, path: str, body: Any, *, step: str) -> Any:
        calls.append((path, body))
        if path == "/version":
            return {"version": "0.32.0"}
        if path == "/weight_info":
            return {"weight_version": "from-server"}
        return {}

    monkeypatch.setattr(RefitClient, "_request", answer)
    client = RefitClient("http://127.0.0.1:1")
    client.update_weight_version("step-1")
    assert client.weight_version() == "from-server"
    assert ("/update_weight_version", {"new_version": "step-1"}) in calls


def test_send_reports_the_exports_bytes_where_the_engine_keeps_no_record() -> None:
    """vLLM's ``ipc`` engines keep no per-send record: the refit's bytes are the export's size."""

    class Recordless:
        is_sender = True

        def send_weights(self) -> None:
            pass

    weight_sync = sync.WeightSync(lambda: iter(WEIGHTS))
    weight_sync.engine = Recordless()
    assert "refit/bytes" not in weight_sync.send()  # no export pass is started for the figure
    weight_sync.source.metadata()
    assert weight_sync.send()["refit/bytes"] == sum(t.numel() * t.element_size() for _, t in WEIGHTS)
