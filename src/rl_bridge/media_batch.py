"""Media of a training batch: processed once per content, checked against vLLM's placeholders.

- :class:`MediaStore` loads a trajectory's media parts (local files confined to a media root,
  ``file://`` and ``data:`` URLs, cached-frame manifests and bundles), samples videos with the
  processor's contract through the shared decode cache, and processes each distinct content once:
  the G samples of a group and every turn that shows the same clip get the same
  :class:`~rl_bridge.processors.ProcessedMedia` object (one tensor, referenced, never copied).
- :func:`check_placeholders` compares the placeholder runs of one turn's new prompt tokens (vLLM's,
  authoritative) with the runs the turn's processed media expand to.
- :class:`MediaMetrics` counts samples, masked samples by reason, and checked turns.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import urllib.parse
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
from numpy.typing import NDArray
from PIL import Image, UnidentifiedImageError

from gym_video_env.handlers import resolve_local_media
from gym_video_env.hookspecs import MediaError, MediaSettings
from rl_bridge.processors import MediaProcessingError, MediaProcessor, ProcessedMedia
from rl_bridge.trajectory import MediaPart
from vllm_video_plugin.cache import DecodeCache, shared_decode_cache
from vllm_video_plugin.decode import DEFAULT_LIMITS, DecodeLimits
from vllm_video_plugin.errors import VideoGRPOError
from vllm_video_plugin.inputs import input_name
from vllm_video_plugin.manifest import load_manifest_frames, sniff_media

__all__ = [
    "MediaLoadError",
    "MediaLoadReason",
    "MediaMetrics",
    "MediaStore",
    "StoreStats",
    "check_placeholders",
    "placeholder_runs",
]

MediaLoadReason = Literal["media_unavailable", "media_undecodable", "unsupported_media"]
"""Why a media part could not be processed: its bytes cannot be read (missing file, outside the
media root, remote URL); they cannot be decoded or sampled; or the policy's family takes no media
of that kind."""

_IMAGE_FORMATS: Final = ("PNG", "JPEG", "WEBP", "BMP", "GIF")


class MediaLoadError(ValueError):
    """A media part cannot be turned into policy tensors.

    ``reason`` is a :data:`MediaLoadReason`; ``location`` names the part in the trajectory;
    ``detail`` says what went wrong.
    """

    def __init__(self, reason: MediaLoadReason, location: str, detail: str) -> None:
        super().__init__(f"{location}: {detail} [{reason}]")
        self.reason: MediaLoadReason = reason
        self.location = location
        self.detail = detail

    def __reduce__(self) -> tuple[type[MediaLoadError], tuple[str, str, str]]:
        return (type(self), (self.reason, self.location, self.detail))


@dataclass(frozen=True)
class StoreStats:
    """Counters of one :class:`MediaStore`."""

    requests: int
    """Media parts asked for."""
    processed: int
    """Parts that were loaded and processed (the rest were served from the store)."""
    unique_bytes: int
    """Bytes of the processed tensors held, each distinct content once."""
    evicted: int = 0
    """Entries dropped to stay within the store's byte bound (least recently used first)."""


class MediaStore:
    """Processed media by content: each distinct media content is processed once per store.

    The key is the SHA-256 of the media bytes, the media kind and the processor's fingerprint;
    a local file's key is remembered by path, size and modification time, so a file shared by many
    samples is read once. Use one store for the samples that should share tensors (a training
    step, or a group). With ``max_bytes`` the store holds at most that many bytes of tensors,
    dropping the least recently used entries first (a run's store then stays bounded however long
    it runs; samples keep the tensors they already hold); without it entries live as long as the
    store. Not thread-safe.
    """

    def __init__(
        self,
        processor: MediaProcessor,
        settings: MediaSettings,
        *,
        decode_cache: DecodeCache | None = None,
        limits: DecodeLimits = DEFAULT_LIMITS,
        max_bytes: int | None = None,
    ) -> None:
        """
        Args:
            processor: the policy's media processor (its contract samples the videos).
            settings: where local media may be (``media_root``: files, ``file://`` URLs and the
                frames of JSON manifests must resolve inside it); remote URLs are never fetched.
            decode_cache: where sampled frames are cached; ``None`` means the process-wide
                :func:`~vllm_video_plugin.cache.shared_decode_cache` (shared with vLLM's loader
                when both use the same disk tier).
            limits: decode limits (input size, frame size, frame count, time).
            max_bytes: bound on the bytes of tensors held (least recently used dropped first; the
                newest entry always stays); ``None``: unbounded.
        """
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"MediaStore: max_bytes must be positive, got {max_bytes}")
        self.processor = processor
        self.settings = settings
        self.decode_cache = decode_cache
        self.limits = limits
        self.max_bytes = max_bytes
        self._by_key: OrderedDict[str, ProcessedMedia] = OrderedDict()
        self._file_keys: dict[tuple[str, int, int], str] = {}
        self._files_of: dict[str, list[tuple[str, int, int]]] = {}
        self._requests = 0
        self._processed = 0
        self._bytes = 0
        self._evicted = 0

    def get(self, part: MediaPart) -> ProcessedMedia:
        """The processed tensors of ``part``, processing its content on first use.

        Raises:
            MediaLoadError: the bytes cannot be read, decoded, sampled or processed.
        """
        self._requests += 1
        file_id, data = self._read(part)
        if file_id is not None and file_id in self._file_keys:
            key = self._file_keys[file_id]
            self._by_key.move_to_end(key)
            return self._by_key[key]
        assert data is not None
        digest = hashlib.sha256(data).hexdigest()
        key = f"{part.kind}:{self.processor.fingerprint}:{digest}"
        processed = self._by_key.get(key)
        if processed is None:
            processed = self._process(part, data)
            self._by_key[key] = processed
            self._processed += 1
            self._bytes += processed.nbytes
        else:
            self._by_key.move_to_end(key)
        if file_id is not None:  # only once processed: a file that failed fails again, with its reason
            self._file_keys[file_id] = key
            self._files_of.setdefault(key, []).append(file_id)
        self._evict()
        return processed

    def _evict(self) -> None:
        """Drop least recently used entries (and the file identities naming them) until the store
        is within ``max_bytes``; the newest entry stays."""
        if self.max_bytes is None or self._bytes <= self.max_bytes:
            return
        while self._bytes > self.max_bytes and len(self._by_key) > 1:
            key, media = self._by_key.popitem(last=False)
            self._bytes -= media.nbytes
            self._evicted += 1
            for file_id in self._files_of.pop(key, ()):
                del self._file_keys[file_id]

    def stats(self) -> StoreStats:
        return StoreStats(
            requests=self._requests,
            processed=self._processed,
            unique_bytes=self._bytes,
            evicted=self._evicted,
        )

    def _read(self, part: MediaPart) -> tuple[tuple[str, int, int] | None, bytes | None]:
        """``(file identity, None)`` for a file already keyed, else its identity (``None`` for
        inline data) and bytes."""
        ref = part.ref
        if ref.kind == "remote":
            raise MediaLoadError(
                "media_unavailable",
                part.location,
                f"remote URL {ref.value[:80]!r}: the trainer does not fetch media",
            )
        if ref.kind == "data":
            data = _data_url_bytes(ref.value, part.location)
            if len(data) > self.limits.max_input_bytes:
                raise MediaLoadError(
                    "media_unavailable",
                    part.location,
                    f"the data: URL holds {len(data)} bytes, over the limit of {self.limits.max_input_bytes}",
                )
            return None, data
        try:
            path = resolve_local_media(ref.value, self.settings)
            stat = path.stat()
        except (MediaError, OSError) as error:
            raise MediaLoadError("media_unavailable", part.location, str(error)) from error
        identity = (os.fspath(path), stat.st_size, stat.st_mtime_ns)
        if identity in self._file_keys:
            return identity, None
        if stat.st_size > self.limits.max_input_bytes:
            raise MediaLoadError(
                "media_unavailable",
                part.location,
                f"{path} is {stat.st_size} bytes, over the limit of {self.limits.max_input_bytes}",
            )
        return identity, path.read_bytes()

    def _process(self, part: MediaPart, data: bytes) -> ProcessedMedia:
        try:
            if part.kind == "image":
                return self.processor.process_image(
                    _image_array(data, part.location, self.limits), source=part.location
                )
            if sniff_media(data) == "video":
                cache = self.decode_cache if self.decode_cache is not None else shared_decode_cache()
                batch = cache.get_or_decode(data, self.processor.contract, limits=self.limits)
                assert batch.sample is not None  # decoded by contract
                return self.processor.process_video(batch.data, batch.sample)
            root = self.settings.media_root
            frames = load_manifest_frames(data, self.processor.contract, media_root=root, limits=self.limits)
            return self.processor.process_video(frames.data, frames.sample)
        except MediaProcessingError as error:
            raise MediaLoadError("unsupported_media", part.location, error.reason) from error
        except VideoGRPOError as error:
            # The decoders name the content (<bytes sha256:...>); name the input beside it.
            name = input_name(part.ref.value, media_root=self.settings.media_root)
            raise MediaLoadError("media_undecodable", part.location, f"{name} {error}") from error


def _data_url_bytes(url: str, location: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaLoadError("media_unavailable", location, "malformed data URL: no ',' before the payload")
    try:
        if header.lower().endswith(";base64"):
            return base64.b64decode("".join(payload.split()), validate=True)
        return urllib.parse.unquote_to_bytes(payload)
    except ValueError as error:
        raise MediaLoadError(
            "media_unavailable", location, f"invalid base64 in data URL ({error})"
        ) from error


def _image_array(data: bytes, location: str, limits: DecodeLimits) -> NDArray[np.uint8]:
    """RGB ``(H, W, 3)`` uint8 of an encoded image, as vLLM loads images (Pillow, converted to RGB)."""
    try:
        with Image.open(io.BytesIO(data), formats=_IMAGE_FORMATS) as image:
            width, height = image.size
            if width * height > limits.max_frame_pixels:
                raise MediaLoadError(
                    "media_undecodable",
                    location,
                    f"the image is {width}x{height}, over the limit of {limits.max_frame_pixels} pixels",
                )
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as error:
        raise MediaLoadError("media_undecodable", location, f"not a readable image ({error})") from error


def placeholder_runs(token_ids: Sequence[int], placeholder_ids: frozenset[int]) -> list[tuple[int, int]]:
    """Maximal runs of one placeholder token in ``token_ids``, as ``(token id, length)``, in order."""
    runs: list[tuple[int, int]] = []
    previous = None
    for token in token_ids:
        if token in placeholder_ids:
            if token == previous:
                runs[-1] = (token, runs[-1][1] + 1)
            else:
                runs.append((token, 1))
            previous = token
        else:
            previous = None
    return runs


def check_placeholders(
    new_prompt_ids: Sequence[int], media: Sequence[ProcessedMedia], placeholder_ids: frozenset[int]
) -> str | None:
    """Compare one turn's placeholders with its media; ``None`` when they agree, else what differs.

    The runs of placeholder tokens in ``new_prompt_ids`` must equal, in order, the runs each item of
    ``media`` expands to: same token, same length. So a missing, extra, reordered or differently
    sized clip is caught, not only a different total.
    """
    found = placeholder_runs(new_prompt_ids, placeholder_ids)
    expected = [(item.placeholder_token_id, length) for item in media for length in item.placeholder_runs]
    if found == expected:
        return None
    return (
        f"vLLM's prompt has {sum(n for _, n in found)} placeholder tokens in {len(found)} runs "
        f"{_describe(found)}, the turn's {len(media)} media expand to {sum(n for _, n in expected)} "
        f"in {len(expected)} runs {_describe(expected)}"
    )


def _describe(runs: list[tuple[int, int]], limit: int = 8) -> str:
    shown = ", ".join(f"{length}x{token}" for token, length in runs[:limit])
    return f"[{shown}{', ...' if len(runs) > limit else ''}]"


class MediaMetrics:
    """Counts of the samples built, the masked ones by reason, and the turns checked."""

    def __init__(self) -> None:
        self.samples = 0
        self.masked: Counter[str] = Counter()
        self.turns_checked = 0
        self.turns_passed = 0

    def count_sample(self, mask_reason: str | None) -> None:
        self.samples += 1
        if mask_reason is not None:
            self.masked[mask_reason] += 1

    def count_turn(self, passed: bool) -> None:
        self.turns_checked += 1
        self.turns_passed += int(passed)

    def as_dict(self) -> dict[str, float]:
        """Metrics under ``media/``: ``samples``, ``masked_samples``, ``masked/<reason>``,
        ``placeholder_turns_checked``, ``placeholder_turns_passed``, ``placeholder_pass_rate``
        (1.0 when no turn was checked)."""
        out: dict[str, float] = {
            "media/samples": self.samples,
            "media/masked_samples": sum(self.masked.values()),
            "media/placeholder_turns_checked": self.turns_checked,
            "media/placeholder_turns_passed": self.turns_passed,
            "media/placeholder_pass_rate": self.turns_passed / self.turns_checked
            if self.turns_checked
            else 1.0,
        }
        out.update({f"media/masked/{reason}": count for reason, count in sorted(self.masked.items())})
        return out
