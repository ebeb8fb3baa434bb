"""The policy-side media processor interface: sampled frames or an image in, model tensors out.

One implementation per model family turns the frames vLLM's loader sampled (through the shared
sampling code and decode cache) into the tensors the policy's forward takes, resized and normalised
as vLLM's processor for that family does, and says which placeholder tokens the item expands to in
the prompt, so the caller can check them against vLLM's prompt tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import torch
from numpy.typing import NDArray

from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.sampling import FrameSample

__all__ = ["MediaProcessingError", "MediaProcessor", "ProcessedMedia", "ProcessorFamily"]

ProcessorFamily = Literal["qwen2_5_vl", "qwen3_vl", "nemotron_vl"]
"""Model families with a policy-side processor (the checkpoint's ``model_type``, normalised)."""

_KINDS: Final = ("video", "image", "audio")


class MediaProcessingError(ValueError):
    """A media item cannot be turned into policy tensors (e.g. a kind the family's policy does
    not take). ``source`` names the item; ``reason`` says why."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason

    def __reduce__(self) -> tuple[type[MediaProcessingError], tuple[str, str]]:
        return (type(self), (self.source, self.reason))


@dataclass(frozen=True, eq=False)
class ProcessedMedia:
    """One video or image as the policy's forward takes it.

    Shared, never copied: the G samples of a group and every turn that shows the same media hold
    this one object. Its tensors must not be modified in place.
    """

    kind: Literal["video", "image", "audio"]
    """``"audio"``: a video's own audio track (Nemotron Omni with ``use_audio_in_video``)."""
    tensors: Mapping[str, torch.Tensor]
    """Model keyword arguments of this item alone, each with the item on dim 0 (patch rows, frames,
    or one row of a grid), so that a batch's items concatenate along dim 0 per key, in prompt
    order. Keys are the family's (e.g. ``pixel_values_videos``, ``video_grid_thw``,
    ``second_per_grid_ts`` for Qwen2.5-VL)."""
    placeholder_token_id: int
    """The prompt token each of the item's features replaces."""
    placeholder_runs: tuple[int, ...]
    """Lengths of the runs of :attr:`placeholder_token_id` the item expands to, in prompt order
    (Qwen2.5-VL: one run per video; Qwen3-VL: one per temporal patch; Nemotron: one per tubelet)."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"ProcessedMedia: kind must be one of {_KINDS}, got {self.kind!r}")
        if not self.placeholder_runs or min(self.placeholder_runs) < 1:
            raise ValueError(
                f"ProcessedMedia: placeholder_runs must be positive, got {self.placeholder_runs}"
            )

    @property
    def num_placeholders(self) -> int:
        """Placeholder tokens the item takes in the prompt."""
        return sum(self.placeholder_runs)

    @property
    def nbytes(self) -> int:
        """Bytes held by :attr:`tensors`."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors.values())


class MediaProcessor(ABC):
    """Turns sampled frames and images into :class:`ProcessedMedia` for one checkpoint."""

    family: ProcessorFamily
    contract: VideoSamplingContract
    """How videos are sampled: the contract vLLM's loader uses for this checkpoint."""

    @property
    @abstractmethod
    def placeholder_token_ids(self) -> frozenset[int]:
        """Every token id that stands for media features in this family's prompts."""

    @property
    def fingerprint(self) -> str:
        """Identifies what the processor produces (family and contract), for content-keyed caches."""
        return f"{self.family}:{self.contract.fingerprint()}"

    @abstractmethod
    def process_video(self, frames: NDArray[np.uint8], sample: FrameSample) -> ProcessedMedia:
        """The tensors of a video.

        Args:
            frames: the sampled RGB frames, ``(N, H, W, 3)`` uint8, in sample order.
            sample: what the contract sampled (indices and timing of the rows of ``frames``).
        """

    @abstractmethod
    def process_image(self, image: NDArray[np.uint8], *, source: str) -> ProcessedMedia:
        """The tensors of an RGB image ``(H, W, 3)`` uint8; ``source`` names it in errors.

        Raises:
            MediaProcessingError: the family's policy takes no images.
        """

    def process_video_audio(self, data: bytes, *, source: str) -> ProcessedMedia | None:
        """The audio features of an encoded video's own track, as vLLM's processor computes them
        when the video is shown with its audio (``use_audio_in_video``); ``None`` when vLLM would
        show the video without audio (no audio track). ``source`` names the video in errors.

        Raises:
            MediaProcessingError: the family's policy hears no audio (the default).
        """
        raise MediaProcessingError(source, f"{self.family} policies take no audio")
