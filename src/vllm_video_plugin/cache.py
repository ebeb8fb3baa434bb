"""Decode once: sampled frames cached by video content and sampling contract.

A video's sampled frames are a pure function of its bytes and the :class:`VideoSamplingContract`,
so :class:`DecodeCache` keys them by the SHA-256 of the bytes plus the contract's canonical JSON.
The G requests of a GRPO group, the trainer's preprocessing and later epochs then share one decode.

Two tiers:

- memory: least-recently-used, bounded by the bytes of the cached frames, shared by the threads of
  a process (vLLM runs loaders on a thread pool); concurrent requests for the same key wait for
  one decode instead of decoding in parallel;
- disk (optional): one file per entry in a directory that several processes may share (the
  trainer and vLLM on one machine), written atomically (temporary file, then rename), bounded in
  bytes by evicting the least recently used files, and read back through a read-only memory map,
  so processes share the frames through the page cache.

Cached arrays are read-only. :func:`shared_decode_cache` gives the process-wide instance, configured
from environment variables (see there).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.decode import (
    DEFAULT_LIMITS,
    DecodeLimits,
    FrameBatch,
    VideoSourceInfo,
    check_limits,
    decode_frames,
)
from vllm_video_plugin.sampling import FrameSample

__all__ = [
    "CACHE_BYTES_ENV",
    "CACHE_DIR_ENV",
    "CACHE_DISK_BYTES_ENV",
    "CacheStats",
    "DecodeCache",
    "decode_cache_key",
    "shared_decode_cache",
]

CACHE_BYTES_ENV: Final = "VIDEO_GRPO_DECODE_CACHE_BYTES"
"""Memory bound of the shared cache in bytes (default 1 GiB; 0 keeps nothing in memory)."""
CACHE_DIR_ENV: Final = "VIDEO_GRPO_DECODE_CACHE_DIR"
"""Directory of the shared cache's disk tier (unset or empty: no disk tier)."""
CACHE_DISK_BYTES_ENV: Final = "VIDEO_GRPO_DECODE_CACHE_DISK_BYTES"
"""Disk bound of the shared cache in bytes (default 16 GiB)."""

_DEFAULT_MEMORY_BYTES: Final = 1 << 30
_DEFAULT_DISK_BYTES: Final = 16 << 30
_KEY_VERSION: Final = b"video-grpo-decode-cache-v1\0"
_MAGIC: Final = b"VGRPO-FRAMES-1\n"
_ALIGN: Final = 64
_SUFFIX: Final = ".frames"

logger = logging.getLogger(__name__)


def decode_cache_key(data: bytes | bytearray | memoryview, contract: VideoSamplingContract) -> str:
    """Cache key (hex) of a video's bytes decoded under ``contract``."""
    digest = hashlib.sha256(_KEY_VERSION)
    digest.update(hashlib.sha256(data).digest())
    digest.update(contract.canonical_json().encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class CacheStats:
    """Counters of one :class:`DecodeCache` since it was created."""

    memory_hits: int
    disk_hits: int
    misses: int
    """Lookups that decoded (a wait on another thread's decode counts as a memory hit)."""
    evictions: int
    """Entries dropped from memory to stay within the byte bound."""
    memory_entries: int
    memory_bytes: int


class DecodeCache:
    """Sampled frames by (video bytes, contract): memory LRU plus an optional shared disk tier.

    Thread-safe. Failed decodes are not cached: every caller waiting on one gets its exception.
    Decode limits apply when decoding; a cached result is returned without re-checking them.
    """

    def __init__(
        self,
        max_bytes: int = _DEFAULT_MEMORY_BYTES,
        *,
        disk_dir: str | os.PathLike[str] | None = None,
        max_disk_bytes: int = _DEFAULT_DISK_BYTES,
    ) -> None:
        """
        Args:
            max_bytes: memory bound, the sum of the cached frame arrays' sizes in bytes; an entry
                larger than this is not kept in memory (0 disables the memory tier).
            disk_dir: directory of the disk tier, created if missing; ``None`` means no disk tier.
            max_disk_bytes: disk bound in bytes; the least recently used files go first.
        """
        if max_bytes < 0 or max_disk_bytes < 0:
            raise ValueError(f"cache bounds must be >= 0 bytes, got {max_bytes} and {max_disk_bytes}")
        self.max_bytes = max_bytes
        self.max_disk_bytes = max_disk_bytes
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, FrameBatch] = OrderedDict()
        self._bytes = 0
        self._in_flight: dict[str, Future[FrameBatch]] = {}
        self._memory_hits = self._disk_hits = self._misses = self._evictions = 0

    # -- public API -------------------------------------------------------------------------------

    def get_or_decode(
        self,
        data: bytes | bytearray | memoryview,
        contract: VideoSamplingContract,
        *,
        limits: DecodeLimits = DEFAULT_LIMITS,
        threads: int = 1,
    ) -> FrameBatch:
        """The frames ``contract`` samples from ``data``: from memory, else disk, else decoded
        (:func:`~vllm_video_plugin.decode.decode_frames`) and stored in both tiers.

        A cached result is checked against ``limits`` too (bytes, frame size, frame count), so a
        stricter caller is refused what a laxer one had decoded.

        Raises:
            VideoDecodeError, VideoSamplingError: as :func:`decode_frames`.
        """
        key = decode_cache_key(data, contract)
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
                self._memory_hits += 1
            pending = self._in_flight.get(key)
            owner = cached is None and pending is None
            if owner:
                pending = self._in_flight[key] = Future()
            elif cached is None:
                self._memory_hits += 1
        if cached is not None:
            check_limits(cached.source, len(data), limits)
            return cached
        if not owner:
            assert pending is not None
            batch = pending.result()
            check_limits(batch.source, len(data), limits)
            return batch
        assert pending is not None
        try:
            batch = self._load(key)
            if batch is None:
                batch = decode_frames(data, contract, limits=limits, threads=threads)
                self._store(key, batch)
                with self._lock:
                    self._misses += 1
            else:
                with self._lock:
                    self._disk_hits += 1
            self._remember(key, batch)
            pending.set_result(batch)
            check_limits(batch.source, len(data), limits)  # a disk hit was decoded by someone else
            return batch
        except BaseException as error:
            pending.set_exception(error)
            raise
        finally:
            with self._lock:
                del self._in_flight[key]

    def get(self, key: str) -> FrameBatch | None:
        """The entry under ``key`` (:func:`decode_cache_key`) from memory or disk, or ``None``."""
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
                self._memory_hits += 1
                return cached
        batch = self._load(key)
        if batch is not None:
            with self._lock:
                self._disk_hits += 1
            self._remember(key, batch)
        return batch

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                memory_hits=self._memory_hits,
                disk_hits=self._disk_hits,
                misses=self._misses,
                evictions=self._evictions,
                memory_entries=len(self._entries),
                memory_bytes=self._bytes,
            )

    def clear_memory(self) -> None:
        """Drop every in-memory entry (the disk tier is kept)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    # -- memory tier ------------------------------------------------------------------------------

    def _remember(self, key: str, batch: FrameBatch) -> None:
        size = batch.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = batch
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._evictions += 1

    # -- disk tier --------------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / f"{key}{_SUFFIX}"

    def _store(self, key: str, batch: FrameBatch) -> None:
        if self.disk_dir is None or batch.nbytes > self.max_disk_bytes:
            return
        header = json.dumps(
            {
                "shape": list(batch.data.shape),
                "indices": list(batch.indices),
                "pts_seconds": list(batch.pts_seconds),
                "source": dataclasses.asdict(batch.source),
                "sample": dataclasses.asdict(batch.sample) if batch.sample is not None else None,
            }
        ).encode()
        prefix = _MAGIC + len(header).to_bytes(8, "little") + header
        prefix += b"\0" * (-len(prefix) % _ALIGN)
        try:
            handle, temporary = tempfile.mkstemp(dir=self.disk_dir, prefix=f".{key}.", suffix=".tmp")
        except OSError as error:
            logger.warning(
                "decode cache: cannot write to %s (%s); keeping %s in memory only", self.disk_dir, error, key
            )
            return
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(prefix)
                file.write(np.ascontiguousarray(batch.data).data)
            os.replace(temporary, self._path(key))
        except OSError as error:
            # A full or read-only disk costs the disk tier, not the request.
            Path(temporary).unlink(missing_ok=True)
            logger.warning("decode cache: cannot write %s to %s (%s)", key, self.disk_dir, error)
            return
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        self._trim_disk()

    def _load(self, key: str) -> FrameBatch | None:
        if self.disk_dir is None:
            return None
        path = self._path(key)
        try:
            with path.open("rb") as file:
                if file.read(len(_MAGIC)) != _MAGIC:
                    raise ValueError("bad magic")
                length = int.from_bytes(file.read(8), "little")
                meta = json.loads(file.read(length))
            offset = len(_MAGIC) + 8 + length
            offset += -offset % _ALIGN
            data = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=tuple(meta["shape"]))
            os.utime(path)  # recently used: evicted last
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, OSError):
            # A damaged or foreign file is a miss; remove it so it is rewritten.
            path.unlink(missing_ok=True)
            return None
        return FrameBatch(
            data=data,
            indices=tuple(meta["indices"]),
            pts_seconds=tuple(meta["pts_seconds"]),
            source=VideoSourceInfo(**meta["source"]),
            sample=_sample_from_json(meta["sample"]),
        )

    def _trim_disk(self) -> None:
        assert self.disk_dir is not None
        files = []
        for entry in os.scandir(self.disk_dir):
            if entry.name.endswith(_SUFFIX):
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # removed by another process meanwhile
                    continue
                files.append((stat.st_mtime_ns, stat.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_disk_bytes:
                break
            Path(path).unlink(missing_ok=True)
            total -= size


def _sample_from_json(value: dict[str, Any] | None) -> FrameSample | None:
    if value is None:
        return None
    for name in ("indices", "timestamps_s", "prompt_timestamps_s"):
        value[name] = tuple(value[name])
    return FrameSample(**value)


_shared: DecodeCache | None = None
_shared_lock = threading.Lock()


def shared_decode_cache() -> DecodeCache:
    """The process-wide cache, created on first use from the environment:

    - ``VIDEO_GRPO_DECODE_CACHE_BYTES``: memory bound in bytes (default 1 GiB);
    - ``VIDEO_GRPO_DECODE_CACHE_DIR``: disk tier directory (default: none); give the trainer and
      vLLM the same directory to share decodes between them;
    - ``VIDEO_GRPO_DECODE_CACHE_DISK_BYTES``: disk bound in bytes (default 16 GiB).
    """
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = DecodeCache(
                _env_bytes(CACHE_BYTES_ENV, _DEFAULT_MEMORY_BYTES),
                disk_dir=os.environ.get(CACHE_DIR_ENV) or None,
                max_disk_bytes=_env_bytes(CACHE_DISK_BYTES_ENV, _DEFAULT_DISK_BYTES),
            )
        return _shared


def _env_bytes(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a whole number of bytes") from None
