"""The policy's weights under their Hugging Face names: written as a checkpoint directory vLLM
and transformers load, or streamed to running vLLM servers.

The tensors come from :meth:`~rl_bridge.megatron.policy.MegatronPolicy.export_hf_weights`
(Megatron-Bridge gathers the tensor-parallel shards and splits fused projections), a collective
stream every rank of the model iterates to the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rl_bridge.refit.sync import WeightSync

__all__ = ["VLLMWeightSenders", "chunk_by_bytes", "save_hf_checkpoint", "write_safetensors"]

Export = Callable[..., Iterator[tuple[str, torch.Tensor]]]
"""``export_hf_weights(*, cpu=True)``: one pass over ``(hf_name, tensor)``."""

# Files of an HF checkpoint that hold weights; everything else (config, tokenizer, processor,
# chat template, generation config, remote code) is copied next to exported weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def chunk_by_bytes(
    pairs: Iterable[tuple[str, torch.Tensor]], max_chunk_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``pairs`` in order, grouped into chunks of at most ``max_chunk_bytes`` bytes (a larger
    tensor forms a chunk of its own)."""
    if max_chunk_bytes < 1:
        raise ValueError(f"chunk_by_bytes: max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
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


def write_safetensors(directory: Path, shards: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
    """Write ``shards`` as HF-named safetensors files in ``directory``: ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` when there are
    several. One shard is held at a time."""
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


def save_hf_checkpoint(export: Export, hf_path: Path, directory: str | Path, *, max_shard_bytes: int) -> Path:
    """:meth:`~rl_bridge.megatron.policy.MegatronPolicy.save_hf_checkpoint`: the weights of
    ``export`` and every non-weight file of the source checkpoint ``hf_path``, assembled next to
    ``directory`` and renamed into place (a reader never sees a partial checkpoint). Collective:
    every rank exports, rank 0 alone writes.

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
        for _ in export():
            pass
        torch.distributed.barrier()
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_safetensors(staging, chunk_by_bytes(export(), max_shard_bytes))
        for source in sorted(hf_path.iterdir()):
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


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name in _WEIGHT_INDEXES


class VLLMWeightSenders:
    """This rank's weight-transfer connections to vLLM servers, one per server (its base URL),
    each a :class:`~rl_bridge.refit.sync.WeightSync` over ``export``."""

    def __init__(self, export: Export) -> None:
        self._export = export
        self._syncs: dict[str, WeightSync] = {}

    def connect(
        self, base_url: str, *, backend: str, bucket_bytes: int, vllm_workers: int, timeout_s: float
    ) -> None:
        """Join the server's weight-transfer group (again after a restart: the old one is closed).
        Collective; global rank 0 sends, from the address on its route to the server."""
        from rl_bridge.refit.sync import WeightSync, sender_address
        from rl_bridge.services.process import free_port
        from vllm_video_plugin.refit_receiver import GLOO_BACKEND

        old = self._syncs.pop(base_url, None)
        if old is not None:
            old.close()
        # gloo sends from host memory; NCCL and CUDA IPC from the device, where the export stays.
        on_cpu = backend == GLOO_BACKEND
        sync = WeightSync(lambda: self._export(cpu=on_cpu))
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
        self._syncs[base_url] = sync

    def send(self, base_url: str | None = None) -> dict[str, float]:
        """Send to the server at ``base_url`` (``None``: to every connected server in turn, each
        from its own export stream); rank 0's figures, summed over the servers."""
        if base_url is not None and base_url not in self._syncs:
            raise RuntimeError(f"send_weights_to_vllm({base_url!r}) before connect_vllm({base_url!r})")
        if not self._syncs:
            raise RuntimeError("send_weights_to_vllm before connect_vllm")
        targets = [base_url] if base_url is not None else list(self._syncs)
        figures: dict[str, float] = {}
        for url in targets:
            for name, value in self._syncs[url].send().items():
                figures[name] = figures.get(name, 0.0) + value
        return figures
