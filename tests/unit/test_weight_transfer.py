"""The in-memory refit's wire format and bucketing, and one transfer over a real gloo group.

The bucket layout (:func:`~vllm_video_plugin.buckets.bucket_layout`) and the trainer's
packing (:class:`~rl_bridge.refit.engines.GlooTrainerWeightTransferEngine`) are pure logic, checked
with hypothesis: every tensor comes back bit-exact, in order, aligned, and no bucket is larger
than the bucket size unless it holds one larger tensor alone. The transfer test runs the
trainer engine against a receiver (a second gloo rank, on a thread) through the same broadcast and the same
update infos vLLM's worker gets (the control plane is a queue here; the served-engine path is in
``tests/integration/test_vllm_refit.py``).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import asdict
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_bridge.refit.engines import GlooTrainerWeightTransferEngine
from rl_bridge.refit.sync import PolicyWeightSource
from rl_bridge.services.process import free_port
from vllm_video_plugin.buckets import BUCKET_ALIGNMENT, bucket_layout, unpack_bucket
from vllm_video_plugin.refit_receiver import GlooWeightTransferUpdateInfo, broadcast, join_group

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


@st.composite
def named_tensors(draw: st.DrawFn) -> list[tuple[str, torch.Tensor]]:
    count = draw(st.integers(1, 12))
    out = []
    for index in range(count):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 9), min_size=0, max_size=3))
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        values = torch.randint(0, 200, shape, generator=generator)
        out.append((f"layers.{index}.w", values.to(dtype)))
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


@given(named_tensors())
@settings(max_examples=60, deadline=None)
def test_a_bucket_unpacks_to_its_tensors_bit_exact_and_aligned(
    tensors: list[tuple[str, torch.Tensor]],
) -> None:
    info = bucket_layout(tensors)
    assert all(offset % BUCKET_ALIGNMENT == 0 for offset in info.offsets)
    last_name, last = tensors[-1]
    assert info.nbytes == info.offsets[-1] + last.numel() * last.element_size()
    buffer = torch.zeros(info.nbytes, dtype=torch.uint8)
    for (_, tensor), offset in zip(tensors, info.offsets, strict=True):
        size = tensor.numel() * tensor.element_size()
        buffer[offset : offset + size] = tensor.contiguous().view(-1).view(torch.uint8)
    wire = GlooWeightTransferUpdateInfo(**asdict(info))  # as vLLM parses it from JSON
    unpacked = unpack_bucket(buffer, wire)
    assert [name for name, _ in unpacked] == [name for name, _ in tensors]
    assert all(same(a, b) for (_, a), (_, b) in zip(unpacked, tensors, strict=True))


@given(named_tensors(), st.integers(1, 600))
@settings(max_examples=80, deadline=None)
def test_the_trainer_packs_every_tensor_once_in_order_within_the_bucket_size(
    tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> None:
    engine = GlooTrainerWeightTransferEngine(client=None, bucket_bytes=bucket_bytes)  # type: ignore[arg-type]
    received: list[tuple[str, torch.Tensor]] = []
    for buffer, info in engine._buckets(iter(tensors)):
        assert buffer.dtype == torch.uint8 and buffer.numel() == info.nbytes
        sizes = [t.numel() * t.element_size() for _, t in unpack_bucket(buffer, info)]
        assert info.nbytes <= bucket_bytes or len(info.names) == 1, (info.nbytes, sizes)
        received += [(name, tensor.clone()) for name, tensor in unpack_bucket(buffer, info)]
    assert [name for name, _ in received] == [name for name, _ in tensors]
    assert all(same(a, b) for (_, a), (_, b) in zip(received, tensors, strict=True))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"names": ["a"], "dtype_names": [], "shapes": [[1]], "offsets": [0], "nbytes": 4},
            "differ in length",
        ),
        (
            {"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]], "offsets": [4], "nbytes": 12},
            "unaligned",
        ),
        (
            {"names": ["a"], "dtype_names": ["float32"], "shapes": [[4]], "offsets": [0], "nbytes": 8},
            "outside",
        ),
        (
            {"names": ["a"], "dtype_names": ["nope"], "shapes": [[1]], "offsets": [0], "nbytes": 4},
            "not a torch dtype",
        ),
    ],
)
def test_a_malformed_update_info_is_refused_naming_the_tensor(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GlooWeightTransferUpdateInfo(**fields)


class QueueClient:
    """The control plane of the transfer test: what vLLM's worker would be told, in order."""

    def __init__(self, calls: Any) -> None:
        self.calls = calls

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.put(("init", init_info))

    def start_weight_update(self) -> None:
        self.calls.put(("start", None))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.put(("update", update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.put(("finish", None))


def receive(calls: Any, results: Any) -> None:
    """A worker: joins the group named by the init call, receives each bucket, reports the tensors."""
    got: dict[str, torch.Tensor] = {}
    group = None
    while True:
        kind, info = calls.get(timeout=60)
        if kind == "init":
            group = join_group(
                info["master_address"],
                info["master_port"],
                info["rank_offset"],
                info["world_size"],
                timeout_s=60,
            )
        elif kind == "update":
            parsed = GlooWeightTransferUpdateInfo(**info)
            buffer = torch.empty(parsed.nbytes, dtype=torch.uint8)
            if parsed.nbytes:
                broadcast(group, buffer)
            got.update({name: tensor.clone() for name, tensor in unpack_bucket(buffer, parsed)})
        elif kind == "finish":
            results.put(got)
            return


def test_a_transfer_over_gloo_delivers_every_tensor_bit_exact() -> None:
    from rl_bridge.refit.engines import GlooTrainerInitInfo

    generator = torch.Generator().manual_seed(0)
    weights = {
        "visual.patch_embed.proj.weight": torch.randn(8, 3, 2, 4, 4, generator=generator),
        "visual.merger.mlp.0.weight": torch.randn(16, 32, generator=generator).to(torch.bfloat16),
        "model.embed_tokens.weight": torch.randn(300, 16, generator=generator),  # larger than a bucket
        "model.norm.weight": torch.ones(16),
    }
    calls: queue.Queue[Any] = queue.Queue()
    results: queue.Queue[Any] = queue.Queue()
    worker = threading.Thread(target=receive, args=(calls, results), daemon=True)  # its own gloo rank
    worker.start()
    info = GlooTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=2,
        bucket_bytes=4096,
        timeout_s=60,
        rank=0,
    )
    engine = GlooTrainerWeightTransferEngine.trainer_init(
        info, client=QueueClient(calls), source=PolicyWeightSource(lambda: iter(weights.items()))
    )
    engine.send_weights()
    got = results.get(timeout=60)
    worker.join(timeout=30)
    assert engine.last is not None and engine.last.tensors == len(weights) and engine.last.buckets >= 3
    assert got.keys() == weights.keys()
    assert all(same(got[name], tensor) for name, tensor in weights.items())
    engine.shutdown()


def test_non_sender_ranks_only_run_the_export() -> None:
    exported: list[int] = []

    def export() -> Any:
        exported.append(1)
        return iter([("w", torch.zeros(2))])

    engine = GlooTrainerWeightTransferEngine(
        client=None,
        source=PolicyWeightSource(export),
        is_sender=False,  # type: ignore[arg-type]
    )
    engine.send_weights()  # a client call would fail on None, a broadcast on the missing group
    assert exported == [1]


def test_cuda_ipc_handles_reach_vllms_update_info_pickled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Colocated GPU refits go through vLLM's ``ipc`` engine, whose update infos carry CUDA IPC
    handles (tuples, not JSON): the refit client sends them as vLLM's own HTTP client does,
    pickled into ``ipc_handles_pickled``, and vLLM's update info decodes the same handles."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    from rl_bridge.refit.client import RefitClient

    handles = {"GPU-1234": ("rebuild_cuda_tensor", (7, b"\x00handle", 4096)), "GPU-5678": ("args", (1, 2))}
    update = asdict(
        IPCWeightTransferUpdateInfo(
            names=["a", "b"],
            dtype_names=["bfloat16", "float32"],
            shapes=[[2, 3], [4]],
            ipc_handles=handles,
            tensor_sizes=[12, 16],
        )
    )
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(RefitClient, "_post", lambda self, path, body=None, *, step: sent.append(body))
    client = RefitClient("http://127.0.0.1:1")
    client.update_weights(update)
    client.update_weights([update, update])

    import json

    body = json.loads(json.dumps(sent[0]))["update_info"]  # what the HTTP request carries
    assert "ipc_handles" not in body and isinstance(body["ipc_handles_pickled"], str)
    assert [set(chunk) for chunk in sent[1]["update_info"]] == [set(body)] * 2
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        IPCWeightTransferUpdateInfo(**body)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    decoded = IPCWeightTransferUpdateInfo(**body)
    assert decoded.ipc_handles == handles and decoded.names == ["a", "b"] and decoded.tensor_sizes == [12, 16]

    plain = {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]]}  # gloo and NCCL: unchanged
    client.update_weights(plain)
    assert sent[-1]["update_info"] == plain
