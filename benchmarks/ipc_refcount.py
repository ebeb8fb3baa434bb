"""CUDA IPC check: does the trainer get its packed refit buffer back after each refit?

torch pairs one ``reduce_tensor`` export of a CUDA buffer with one rebuild-and-release by the
consumer; the producer's ``torch.cuda.ipc_collect`` frees a dropped buffer only once every export
of it has been released. vLLM 0.26's ``ipc`` worker rebuilds and releases the trainer's buffer once
per chunk of a refit. This runs, with torch alone (no vLLM: the consumer does what 0.26's
``packed_ipc_consumer`` does to the buffer), a few "refits" of a buffer the size of a
Qwen2.5-VL-3B embedding in chunks, and prints the producer's memory still allocated after each:

- ``export once``: vLLM 0.26's ``packed_ipc_producer`` (one export, its arguments sent with every
  chunk);
- ``export per chunk``: ``rl_bridge.refit.legacy_engines.packed_ipc_chunks`` (one export a chunk);
- ``single chunk``: a refit that fits one chunk (the tiny model's), for reference.

Needs one CUDA GPU and torch. ``python benchmarks/ipc_refcount.py --json OUT/ipc_refcount.json``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

MIB = 1024**2


def consumer(connection: Any) -> None:
    """vLLM 0.26's worker, as far as the buffer goes: rebuild, copy out, release, per chunk."""
    torch.cuda.init()
    while (args := connection.recv()) is not None:
        args = list(args)
        args[6] = torch.cuda.current_device()
        packed = rebuild_cuda_tensor(*args)
        packed[: 1 << 20].clone()
        del packed
        connection.send("read")


def refits(mode: str, *, chunks: int, rounds: int, buffer_mib: int) -> list[float]:
    """MiB the producer still holds after each refit (``ipc_collect`` done), over its start."""
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    worker = context.Process(target=consumer, args=(theirs,))
    worker.start()
    start = torch.cuda.memory_allocated()
    held = []
    for _ in range(rounds):
        buffer = torch.empty(buffer_mib * MIB, dtype=torch.uint8, device="cuda")
        once = reduce_tensor(buffer)[1] if mode == "export once" else None
        for chunk in range(chunks):
            buffer[: 1 << 20].fill_(chunk)
            torch.cuda.synchronize()
            ours.send(once if once is not None else reduce_tensor(buffer)[1])
            ours.recv()
            torch.cuda.ipc_collect()
        del buffer, once
        torch.cuda.ipc_collect()
        held.append((torch.cuda.memory_allocated() - start) / MIB)
    ours.send(None)
    worker.join()
    return held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buffer-mib", type=int, default=594, help="a Qwen2.5-VL-3B embedding's size")
    parser.add_argument("--chunks", type=int, default=13, help="a 7.5 GB export in such buffers")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shape = {"rounds": args.rounds, "buffer_mib": args.buffer_mib}
    runs = {
        "export once": refits("export once", chunks=args.chunks, **shape),
        "export per chunk": refits("export per chunk", chunks=args.chunks, **shape),
        "single chunk": refits("export once", chunks=1, **shape),
    }
    where = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    print(f"{where}: {args.rounds} refits of {args.chunks} chunks through a {args.buffer_mib} MiB buffer")
    for name, held in runs.items():
        print(f"{name:<18} MiB still held after each refit: {[round(mib) for mib in held]}")
    if args.json:
        record = {
            "command": "python benchmarks/ipc_refcount.py " + " ".join(sys.argv[1:]),
            "where": where,
            "configuration": vars(args) | {"json": None},
            "mib_held_after_each_refit": runs,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
