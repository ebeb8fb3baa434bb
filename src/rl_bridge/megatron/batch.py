"""Samples the Megatron policy trains on, and their collation into right-padded micro-batches.

One :class:`PolicySample` is one token sequence (prompt and response of one turn or trajectory)
with the media its placeholder tokens stand for. Per-token fields are aligned with
``input_ids``: position ``t`` refers to token ``input_ids[t]`` as predicted from
``input_ids[:t]``, so position 0 is never a target. :func:`collate` stacks samples into a
:class:`MicroBatch`: token fields right-padded to the longest sample, media tensors concatenated in
sample order (videos of different sizes simply contribute different numbers of patch rows), which
is the layout the Qwen2.5-VL forward takes.

Media tensors are referenced, never copied, until a micro-batch is collated, so G samples of a
GRPO group may share one video tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["MediaTokens", "MicroBatch", "PolicySample", "collate"]


@dataclass(frozen=True)
class PolicySample:
    """One sequence for the policy: tokens, what to train on, and its media.

    Per-token tensors are ``[T]`` with ``T = len(input_ids)``; their values at positions where
    ``target_mask`` is false are ignored.
    """

    input_ids: torch.Tensor
    """``[T]`` token ids, with the processor's video/image placeholder tokens."""
    target_mask: torch.Tensor
    """``[T]`` bool: positions whose token is trained on (the generated tokens); ``[0]`` must be false."""
    advantage: float = 0.0
    """The sample's advantage (same for all its target tokens)."""
    loss_weight: float = 1.0
    """Weight of the sample in the loss; 0 removes it (e.g. media that failed a check)."""
    old_logprobs: torch.Tensor | None = None
    """``[T]`` log-probabilities of ``input_ids`` under the trainer's policy before this update (the
    proximal policy of the clipped ratio); ``None`` when the loss does not use them."""
    behaviour_logprobs: torch.Tensor | None = None
    """``[T]`` log-probabilities returned by the rollout engine that sampled the tokens (off-policy
    correction, mismatch metrics); ``None`` when unavailable."""
    ref_logprobs: torch.Tensor | None = None
    """``[T]`` log-probabilities under the reference policy (KL penalty); ``None`` without KL."""
    pixel_values_videos: torch.Tensor | None = None
    """``[patches, C * temporal_patch * patch * patch]`` of all this sample's videos, in order."""
    video_grid_thw: torch.Tensor | None = None
    """``[videos, 3]`` (temporal, height, width) patch grid of each video."""
    second_per_grid_ts: torch.Tensor | None = None
    """``[videos]`` seconds per temporal grid step; ``None`` means 1.0 s for every video."""
    pixel_values: torch.Tensor | None = None
    """``[patches, C * temporal_patch * patch * patch]`` of all this sample's images, in order."""
    image_grid_thw: torch.Tensor | None = None
    """``[images, 3]`` patch grid of each image."""

    def __post_init__(self) -> None:
        length = self.input_ids.shape
        if self.input_ids.dim() != 1 or self.input_ids.numel() < 2:
            raise ValueError(f"PolicySample: input_ids must be [T] with T >= 2, got shape {tuple(length)}")
        if self.target_mask.shape != length or self.target_mask.dtype != torch.bool:
            raise ValueError(
                f"PolicySample: target_mask must be a bool tensor of shape {tuple(length)}, "
                f"got {self.target_mask.dtype} {tuple(self.target_mask.shape)}"
            )
        if bool(self.target_mask[0]):
            raise ValueError("PolicySample: target_mask[0] is true, but the first token has no prediction")
        if not self.loss_weight >= 0:
            raise ValueError(f"PolicySample: loss_weight must be >= 0, got {self.loss_weight}")
        for name in ("old_logprobs", "behaviour_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and value.shape != length:
                raise ValueError(
                    f"PolicySample: {name} must have shape {tuple(length)}, got {tuple(value.shape)}"
                )
        _check_media("video", self.pixel_values_videos, self.video_grid_thw)
        _check_media("image", self.pixel_values, self.image_grid_thw)
        videos = 0 if self.video_grid_thw is None else self.video_grid_thw.size(0)
        if self.second_per_grid_ts is not None and self.second_per_grid_ts.shape != (videos,):
            raise ValueError(
                f"PolicySample: second_per_grid_ts must have one entry per video ({videos}), "
                f"got shape {tuple(self.second_per_grid_ts.shape)}"
            )

    @property
    def num_target_tokens(self) -> int:
        """Number of trained positions."""
        return int(self.target_mask.sum())


def _check_media(kind: str, pixels: torch.Tensor | None, grid: torch.Tensor | None) -> None:
    if (pixels is None) != (grid is None):
        raise ValueError(f"PolicySample: {kind} pixels and grid must be given together")
    if grid is None or pixels is None:
        return
    if grid.dim() != 2 or grid.size(1) != 3:
        raise ValueError(f"PolicySample: {kind} grid must be [{kind}s, 3], got shape {tuple(grid.shape)}")
    patches = int(grid.prod(dim=-1).sum())
    if patches != pixels.size(0):
        raise ValueError(
            f"PolicySample: the {kind} grid {grid.tolist()} describes {patches} patches, "
            f"but the pixels have {pixels.size(0)} rows"
        )


@dataclass(frozen=True)
class MediaTokens:
    """How media map to placeholder tokens in a checkpoint's vocabulary."""

    video_token_id: int
    image_token_id: int
    spatial_merge_size: int
    """Patches merged per side into one token: a grid ``(t, h, w)`` takes ``t*h*w / merge**2`` tokens."""


@dataclass(frozen=True)
class MicroBatch:
    """Samples stacked for one forward pass; token tensors are ``[B, S]``, right-padded."""

    input_ids: torch.Tensor
    """``[B, S]`` token ids; padding positions hold ``pad_token_id``."""
    target_mask: torch.Tensor
    """``[B, S]`` bool, false on padding."""
    lengths: torch.Tensor
    """``[B]`` unpadded lengths."""
    advantages: torch.Tensor
    """``[B]`` fp32."""
    loss_weights: torch.Tensor
    """``[B]`` fp32 per-sample loss weights."""
    old_logprobs: torch.Tensor | None
    """``[B, S]`` fp32 (0 on padding); ``None`` when no sample has them."""
    behaviour_logprobs: torch.Tensor | None
    """``[B, S]`` fp32 (0 on padding); ``None`` when no sample has them."""
    ref_logprobs: torch.Tensor | None
    """``[B, S]`` fp32 (0 on padding); ``None`` when no sample has them."""
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    """Model keyword arguments: ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``,
    ``pixel_values``, ``image_grid_thw``, each present only when some sample has that media."""

    @property
    def num_target_tokens(self) -> int:
        """Number of trained positions in the micro-batch."""
        return int(self.target_mask.sum())

    def to(self, device: torch.device) -> MicroBatch:
        """The micro-batch with every tensor on ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return MicroBatch(
            input_ids=self.input_ids.to(device),
            target_mask=self.target_mask.to(device),
            lengths=self.lengths.to(device),
            advantages=self.advantages.to(device),
            loss_weights=self.loss_weights.to(device),
            old_logprobs=move(self.old_logprobs),
            behaviour_logprobs=move(self.behaviour_logprobs),
            ref_logprobs=move(self.ref_logprobs),
            media={name: t.to(device) for name, t in self.media.items()},
        )


def _pad_stack(values: Sequence[torch.Tensor], length: int, fill: float) -> torch.Tensor:
    out = torch.full((len(values), length), fill, dtype=values[0].dtype)
    for row, value in enumerate(values):
        out[row, : value.numel()] = value
    return out


def _optional_per_token(samples: Sequence[PolicySample], name: str, length: int) -> torch.Tensor | None:
    values = [getattr(s, name) for s in samples]
    if all(v is None for v in values):
        return None
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        raise ValueError(f"collate: samples {missing} have no {name}, but others have")
    return _pad_stack([v.float() for v in values], length, 0.0)


def _check_placeholders(index: int, sample: PolicySample, media_tokens: MediaTokens) -> None:
    merge = media_tokens.spatial_merge_size**2
    for kind, token_id, grid in (
        ("video", media_tokens.video_token_id, sample.video_grid_thw),
        ("image", media_tokens.image_token_id, sample.image_grid_thw),
    ):
        expected = 0 if grid is None else int(grid.prod(dim=-1).sum()) // merge
        found = int((sample.input_ids == token_id).sum())
        if found != expected:
            raise ValueError(
                f"collate: sample {index} has {found} {kind} placeholder tokens (id {token_id}), "
                f"but its {kind} grid {None if grid is None else grid.tolist()} needs {expected}"
            )


def collate(samples: Sequence[PolicySample], *, pad_token_id: int, media_tokens: MediaTokens) -> MicroBatch:
    """Stack ``samples`` into a right-padded :class:`MicroBatch`.

    Args:
        samples: at least one sample.
        pad_token_id: token id written at padding positions (never attended to by real positions,
            since attention is causal and padding is on the right); must not be a media
            placeholder.
        media_tokens: the checkpoint's placeholder ids, used to check each sample's placeholder
            count against its media grids.

    Raises:
        ValueError: no samples, a placeholder pad id, a sample whose placeholder count does not
            match its media, or an optional per-token field present in some samples only.
    """
    if not samples:
        raise ValueError("collate: no samples")
    if pad_token_id in (media_tokens.video_token_id, media_tokens.image_token_id):
        raise ValueError(f"collate: pad_token_id={pad_token_id} is a media placeholder token")
    for index, sample in enumerate(samples):
        _check_placeholders(index, sample, media_tokens)
    length = max(s.input_ids.numel() for s in samples)
    media: dict[str, torch.Tensor] = {}
    videos = [s for s in samples if s.video_grid_thw is not None]
    if videos:
        media["pixel_values_videos"] = torch.cat([s.pixel_values_videos for s in videos])  # type: ignore[misc]
        media["video_grid_thw"] = torch.cat([s.video_grid_thw for s in videos])  # type: ignore[misc]
        media["second_per_grid_ts"] = torch.cat(
            [
                s.second_per_grid_ts.float()
                if s.second_per_grid_ts is not None
                else torch.ones(s.video_grid_thw.size(0))  # type: ignore[union-attr]
                for s in videos
            ]
        )
    images = [s for s in samples if s.image_grid_thw is not None]
    if images:
        media["pixel_values"] = torch.cat([s.pixel_values for s in images])  # type: ignore[misc]
        media["image_grid_thw"] = torch.cat([s.image_grid_thw for s in images])  # type: ignore[misc]
    return MicroBatch(
        input_ids=_pad_stack([s.input_ids.long() for s in samples], length, pad_token_id),
        target_mask=_pad_stack([s.target_mask for s in samples], length, False),
        lengths=torch.tensor([s.input_ids.numel() for s in samples]),
        advantages=torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32),
        loss_weights=torch.tensor([float(s.loss_weight) for s in samples], dtype=torch.float32),
        old_logprobs=_optional_per_token(samples, "old_logprobs", length),
        behaviour_logprobs=_optional_per_token(samples, "behaviour_logprobs", length),
        ref_logprobs=_optional_per_token(samples, "ref_logprobs", length),
        media=media,
    )
