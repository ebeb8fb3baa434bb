"""The decode cache: hits, byte-bounded LRU eviction, key sensitivity, the shared disk tier."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from video_grpo_demo.synthetic import WrittenVideo, indexed_frames, read_frame_index, write_video
from vllm_video_plugin import cache as cache_module
from vllm_video_plugin.cache import DecodeCache, decode_cache_key, shared_decode_cache
from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.decode import FrameBatch, decode_frames
from vllm_video_plugin.errors import VideoDecodeError

pytestmark = pytest.mark.unit

FOUR = VideoSamplingContract(style="uniform", num_frames=4)
SIX = VideoSamplingContract(style="uniform", num_frames=6)
EIGHT = VideoSamplingContract(style="uniform", num_frames=8)


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> WrittenVideo:
    return write_video(
        tmp_path_factory.mktemp("cache") / "clip.mp4", indexed_frames(24, width=64, height=48), fps=8, gop=6
    )


@pytest.fixture(scope="module")
def data(video: WrittenVideo) -> bytes:
    return video.path.read_bytes()


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[VideoSamplingContract]:
    """The contracts the cache decoded with, in order (the real decoder still runs)."""
    calls: list[VideoSamplingContract] = []

    def counting_decode(source: bytes, contract: VideoSamplingContract, **kwargs: object) -> FrameBatch:
        calls.append(contract)
        return decode_frames(source, contract, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cache_module, "decode_frames", counting_decode)
    return calls


def assert_same_batch(left: FrameBatch, right: FrameBatch) -> None:
    np.testing.assert_array_equal(left.data, right.data)
    assert left.indices == right.indices
    assert left.pts_seconds == right.pts_seconds
    assert left.source == right.source
    assert left.sample == right.sample


def test_second_request_is_a_memory_hit(data: bytes, decodes: list[VideoSamplingContract]) -> None:
    cache = DecodeCache()
    first = cache.get_or_decode(data, FOUR)
    second = cache.get_or_decode(data, FOUR)
    assert second is first
    assert decodes == [FOUR]
    assert [read_frame_index(frame) for frame in first.data] == list(first.indices) == [0, 7, 15, 23]
    stats = cache.stats()
    assert (stats.misses, stats.memory_hits, stats.memory_entries) == (1, 1, 1)
    assert stats.memory_bytes == first.nbytes
    assert not first.data.flags.writeable


def test_key_depends_on_bytes_and_contract(data: bytes) -> None:
    assert decode_cache_key(data, FOUR) == decode_cache_key(
        bytes(data), VideoSamplingContract.model_validate({"style": "uniform", "num_frames": 4})
    )
    assert decode_cache_key(data, FOUR) != decode_cache_key(data, SIX)
    assert decode_cache_key(data, FOUR) != decode_cache_key(
        data, FOUR.model_copy(update={"max_pixels": 10_000})
    )
    assert decode_cache_key(data, FOUR) != decode_cache_key(data + b"\0", FOUR)


def test_different_contracts_are_decoded_separately(
    data: bytes, decodes: list[VideoSamplingContract]
) -> None:
    cache = DecodeCache()
    four, six = cache.get_or_decode(data, FOUR), cache.get_or_decode(data, SIX)
    assert decodes == [FOUR, SIX]
    assert len(four.indices) == 4 and len(six.indices) == 6


def test_eviction_by_bytes_is_least_recently_used(data: bytes, decodes: list[VideoSamplingContract]) -> None:
    frame_bytes = 64 * 48 * 3
    cache = DecodeCache(max_bytes=(4 + 6) * frame_bytes)  # room for the 4- and 6-frame entries
    cache.get_or_decode(data, FOUR)
    cache.get_or_decode(data, SIX)
    cache.get_or_decode(data, FOUR)  # FOUR is now the most recently used
    cache.get_or_decode(data, EIGHT)  # 18 frames > 10: SIX goes first, then FOUR... until it fits
    stats = cache.stats()
    assert stats.memory_bytes <= (4 + 6) * frame_bytes
    assert stats.evictions == 2 and stats.memory_entries == 1
    decodes.clear()
    cache.get_or_decode(data, EIGHT)
    assert decodes == []
    cache.get_or_decode(data, FOUR)
    assert decodes == [FOUR]


def test_lru_keeps_the_recent_entry(data: bytes, decodes: list[VideoSamplingContract]) -> None:
    frame_bytes = 64 * 48 * 3
    cache = DecodeCache(max_bytes=(4 + 6 + 4) * frame_bytes - 1)
    other = VideoSamplingContract(style="nemotron_rounded", num_frames=4)
    cache.get_or_decode(data, FOUR)
    cache.get_or_decode(data, SIX)
    cache.get_or_decode(data, FOUR)
    cache.get_or_decode(data, other)  # one byte over the bound: the least recent (SIX) goes
    decodes.clear()
    cache.get_or_decode(data, FOUR)
    cache.get_or_decode(data, other)
    assert decodes == []
    cache.get_or_decode(data, SIX)
    assert decodes == [SIX]


def test_entries_larger_than_memory_are_not_kept(data: bytes, decodes: list[VideoSamplingContract]) -> None:
    cache = DecodeCache(max_bytes=10)
    cache.get_or_decode(data, FOUR)
    cache.get_or_decode(data, FOUR)
    assert decodes == [FOUR, FOUR]
    assert cache.stats().memory_entries == 0


def test_disk_tier_is_shared_between_instances(
    data: bytes, tmp_path: Path, decodes: list[VideoSamplingContract]
) -> None:
    writer = DecodeCache(disk_dir=tmp_path)
    decoded = writer.get_or_decode(data, VideoSamplingContract(style="qwen3_vl"))
    assert len(list(tmp_path.glob("*.frames"))) == 1
    reader = DecodeCache(disk_dir=tmp_path)  # another process's view of the same directory
    loaded = reader.get_or_decode(data, VideoSamplingContract(style="qwen3_vl"))
    assert len(decodes) == 1
    assert reader.stats().disk_hits == 1 and reader.stats().misses == 0
    assert_same_batch(loaded, decoded)
    assert isinstance(loaded.data, np.memmap) and not loaded.data.flags.writeable
    assert reader.get_or_decode(data, VideoSamplingContract(style="qwen3_vl")) is loaded  # now in memory


def test_disk_tier_is_bounded(data: bytes, tmp_path: Path) -> None:
    frame_bytes = 64 * 48 * 3
    cache = DecodeCache(disk_dir=tmp_path, max_disk_bytes=(6 + 8) * frame_bytes + 4096)
    cache.get_or_decode(data, FOUR)
    time.sleep(0.01)  # distinct modification times
    cache.get_or_decode(data, SIX)
    time.sleep(0.01)
    cache.get_or_decode(data, EIGHT)
    names = {path.name for path in tmp_path.glob("*.frames")}
    assert names == {f"{decode_cache_key(data, SIX)}.frames", f"{decode_cache_key(data, EIGHT)}.frames"}
    assert not list(tmp_path.glob(".*.tmp"))


def test_damaged_disk_entry_is_a_miss(
    data: bytes, tmp_path: Path, decodes: list[VideoSamplingContract]
) -> None:
    DecodeCache(disk_dir=tmp_path).get_or_decode(data, FOUR)
    (entry,) = tmp_path.glob("*.frames")
    entry.write_bytes(b"not a cache file")
    batch = DecodeCache(disk_dir=tmp_path).get_or_decode(data, FOUR)
    assert len(decodes) == 2
    assert [read_frame_index(frame) for frame in batch.data] == [0, 7, 15, 23]
    assert entry.read_bytes().startswith(b"VGRPO-FRAMES-1\n")  # rewritten


def test_concurrent_requests_share_one_decode(data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def slow_decode(source: bytes, contract: VideoSamplingContract, **kwargs: object) -> FrameBatch:
        calls.append(contract)
        time.sleep(0.2)
        return decode_frames(source, contract, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cache_module, "decode_frames", slow_decode)
    cache = DecodeCache()
    results: list[FrameBatch] = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.get_or_decode(data, FOUR))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(results) == 4 and all(result is results[0] for result in results)


def test_failures_are_not_cached(decodes: list[VideoSamplingContract]) -> None:
    cache = DecodeCache()
    for _ in range(2):
        with pytest.raises(VideoDecodeError, match="not a readable media container"):
            cache.get_or_decode(b"garbage" * 10, FOUR)
    assert len(decodes) == 2
    assert cache.stats().memory_entries == 0


def test_shared_cache_is_one_per_process() -> None:
    assert shared_decode_cache() is shared_decode_cache()


def test_bad_environment_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache_module.CACHE_BYTES_ENV, "1GB")
    with pytest.raises(
        ValueError, match="VIDEO_GRPO_DECODE_CACHE_BYTES='1GB' is not a whole number of bytes"
    ):
        cache_module._env_bytes(cache_module.CACHE_BYTES_ENV, 0)
