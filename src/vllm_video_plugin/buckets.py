"""Weight buckets: many named tensors in one byte buffer, for in-memory refits.

The wire format of :mod:`vllm_video_plugin.refit_receiver` without vLLM: a trainer packs its
HF-named tensors, in order, into buffers of at most a bucket size (:func:`pack_buckets`), each
described by a :class:`BucketLayout` (names, dtypes, shapes, byte offsets); the receiver views the
same bytes as the same tensors (:func:`unpack_bucket`). Every tensor starts at a multiple of
:data:`BUCKET_ALIGNMENT` bytes, so any dtype can view it; a tensor larger than the bucket size
travels alone, from its own memory. Imports without vLLM (torch only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final

import torch

__all__ = ["BUCKET_ALIGNMENT", "BucketLayout", "bucket_layout", "pack_buckets", "unpack_bucket"]

BUCKET_ALIGNMENT: Final = 64
"""Every tensor starts at a multiple of this many bytes in a bucket."""


@dataclass(kw_only=True)
class BucketLayout:
    """Which tensors a bucket's bytes hold, and where."""

    names: list[str]
    dtype_names: list[str]
    """``torch`` dtype names (``"float32"``, ``"bfloat16"``, ...)."""
    shapes: list[list[int]]
    offsets: list[int]
    """Byte offset of each tensor in the bucket."""
    nbytes: int
    """The bucket's size in bytes (where its last tensor ends; 0 for an empty bucket)."""

    def __post_init__(self) -> None:
        lengths = {len(self.names), len(self.dtype_names), len(self.shapes), len(self.offsets)}
        if len(lengths) != 1:
            raise ValueError(
                f"update_info: names, dtype_names, shapes and offsets differ in length "
                f"({len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}, {len(self.offsets)})"
            )
        for name, dtype_name, shape, offset in zip(
            self.names, self.dtype_names, self.shapes, self.offsets, strict=True
        ):
            end = offset + _nbytes(shape, _dtype(dtype_name, name))
            if offset % BUCKET_ALIGNMENT or end > self.nbytes:
                raise ValueError(
                    f"update_info: {name} at bytes [{offset}, {end}) is unaligned or outside the "
                    f"bucket of {self.nbytes} bytes"
                )


def _dtype(name: str, tensor: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"update_info: {tensor} has dtype {name!r}, not a torch dtype")
    return dtype


def _nbytes(shape: list[int] | tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _aligned(offset: int) -> int:
    return -(-offset // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT


def bucket_layout(tensors: Iterable[tuple[str, torch.Tensor]]) -> BucketLayout:
    """The layout of a bucket holding ``tensors`` in order (meta tensors will do)."""
    names, dtypes, shapes, offsets = [], [], [], []
    start = end = 0
    for name, tensor in tensors:
        names.append(name)
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        shapes.append(list(tensor.shape))
        offsets.append(start)
        end = start + tensor.numel() * tensor.element_size()
        start = _aligned(end)
    return BucketLayout(names=names, dtype_names=dtypes, shapes=shapes, offsets=offsets, nbytes=end)


def unpack_bucket(buffer: torch.Tensor, layout: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """Views of ``buffer`` (``uint8``, at least ``layout.nbytes`` long) as the bucket's tensors."""
    out = []
    for name, dtype_name, shape, offset in zip(
        layout.names, layout.dtype_names, layout.shapes, layout.offsets, strict=True
    ):
        dtype = _dtype(dtype_name, name)
        raw = buffer[offset : offset + _nbytes(shape, dtype)]
        out.append((name, raw.view(dtype).view(shape)))
    return out


def pack_buckets(
    pairs: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    buffer: Callable[[torch.device], torch.Tensor],
) -> Iterator[tuple[torch.Tensor, BucketLayout]]:
    """``(uint8 bytes, layout)`` per bucket of at most ``bucket_bytes``, the tensors in order.

    ``buffer(device)`` gives the send buffer (``uint8``, at least ``bucket_bytes`` long, on the
    tensors' device); it is reused for the next bucket once the consumer takes the next one, so
    a consumer sends (or copies) a bucket before asking for another. A tensor larger than
    ``bucket_bytes`` is yielded alone, as its own bytes.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    held: list[tuple[str, torch.Tensor]] = []  # names and meta tensors of the packed ones
    send: torch.Tensor | None = None
    end = 0
    for name, tensor in pairs:
        tensor = tensor.detach().contiguous()
        size = tensor.numel() * tensor.element_size()
        if held and (size > bucket_bytes or end + size > bucket_bytes):
            layout = bucket_layout(held)
            yield send[: layout.nbytes], layout  # type: ignore[index]
            held, end = [], 0
        if size > bucket_bytes:
            yield tensor.view(-1).view(torch.uint8), bucket_layout([(name, tensor)])
            continue
        send = buffer(tensor.device)
        send[end : end + size].copy_(tensor.view(-1).view(torch.uint8))
        held.append((name, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")))
        end = _aligned(end + size)
    if held:
        layout = bucket_layout(held)
        yield send[: layout.nbytes], layout  # type: ignore[index]
