"""Samples the Megatron policy trains on, and their collation into right-padded micro-batches.

One :class:`PolicySample` is one token sequence (prompt and response of one turn or trajectory)
with the media its placeholder tokens stand for. Per-token fields are aligned with
``input_ids``: position ``t`` refers to token ``input_ids[t]`` as predicted from
``input_ids[:t]``, so position 0 is never a target. :func:`collate` stacks samples into a
:class:`MicroBatch`: token fields right-padded to the longest sample, media tensors concatenated
per model keyword in sample order, then prompt order (videos of different sizes simply contribute
different numbers of patch rows), which is the layout the Qwen2.5-VL forward takes.

Media are :class:`~rl_bridge.processors.ProcessedMedia` objects held by reference: the G samples
of a GRPO group, and the turns that show the same clip, share one object and its tensors until a
micro-batch is collated for the forward. A keyword with a single tensor in the micro-batch is
passed as that tensor itself, so with one sample per micro-batch and one media item nothing is
copied at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rl_bridge.processors.base import ProcessedMedia

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
    media: tuple[ProcessedMedia, ...] = ()
    """The media of the sequence in prompt order: shared objects, referenced and never modified."""
    allowed_tokens: torch.Tensor | None = None
    """``[num_target_tokens, words]`` int32, packed (:mod:`rl_bridge.structured_outputs`): per
    target token in position order, the tokens the rollout engine's structured-outputs grammar
    allowed there; ``None``: decoding was not constrained."""

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
        if not isinstance(self.media, tuple) or not all(isinstance(m, ProcessedMedia) for m in self.media):
            raise ValueError("PolicySample: media must be a tuple of ProcessedMedia")
        allowed = self.allowed_tokens
        if allowed is not None and (
            allowed.dtype != torch.int32 or allowed.dim() != 2 or allowed.size(0) != self.num_target_tokens
        ):
            raise ValueError(
                f"PolicySample: allowed_tokens must be int32 [{self.num_target_tokens}, words], "
                f"got {allowed.dtype} {tuple(allowed.shape)}"
            )

    @property
    def num_target_tokens(self) -> int:
        """Number of trained positions."""
        return int(self.target_mask.sum())


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
    allowed_tokens: torch.Tensor | None = None
    """``[num_target_tokens, words]`` int32 packed masks of the target tokens in ``target_mask``
    order (row-major), all-allowed rows for samples without; ``None`` when no sample has them."""
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    """Model keyword arguments of the samples' media (for Qwen2.5-VL ``pixel_values_videos``,
    ``video_grid_thw``, ``second_per_grid_ts``, ``pixel_values``, ``image_grid_thw``), each present
    only when some sample has media with that keyword."""

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
            allowed_tokens=move(self.allowed_tokens),
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
    placeholder_ids = {"video": media_tokens.video_token_id, "image": media_tokens.image_token_id}
    for kind, token_id in placeholder_ids.items():
        expected = sum(
            item.num_placeholders for item in sample.media if item.placeholder_token_id == token_id
        )
        found = int((sample.input_ids == token_id).sum())
        if found != expected:
            raise ValueError(
                f"collate: sample {index} has {found} {kind} placeholder tokens (id {token_id}), "
                f"but its media need {expected}"
            )
    foreign = {item.placeholder_token_id for item in sample.media} - set(placeholder_ids.values())
    if foreign:
        raise ValueError(
            f"collate: sample {index} has media for placeholder tokens {sorted(foreign)}, which are not "
            f"this checkpoint's video or image tokens {sorted(placeholder_ids.values())}"
        )


def _media_kwargs(samples: Sequence[PolicySample]) -> dict[str, torch.Tensor]:
    """Each model keyword's tensors concatenated along dim 0 in sample, then prompt, order; a
    keyword with a single tensor is passed by reference."""
    parts: dict[str, list[torch.Tensor]] = {}
    keys_of_kind: dict[str, frozenset[str]] = {}
    for index, sample in enumerate(samples):
        for item in sample.media:
            keys = frozenset(item.tensors)
            if keys_of_kind.setdefault(item.kind, keys) != keys:
                raise ValueError(
                    f"collate: sample {index} has a {item.kind} with tensors {sorted(keys)}, an earlier "
                    f"{item.kind} has {sorted(keys_of_kind[item.kind])}"
                )
            for name, tensor in item.tensors.items():
                parts.setdefault(name, []).append(tensor)
    return {name: tensors[0] if len(tensors) == 1 else torch.cat(tensors) for name, tensors in parts.items()}


def collate(samples: Sequence[PolicySample], *, pad_token_id: int, media_tokens: MediaTokens) -> MicroBatch:
    """Stack ``samples`` into a right-padded :class:`MicroBatch`.

    Args:
        samples: at least one sample.
        pad_token_id: token id written at padding positions (never attended to by real positions,
            since attention is causal and padding is on the right); must not be a media
            placeholder.
        media_tokens: the checkpoint's placeholder ids, used to check each sample's placeholder
            count against its media.

    Raises:
        ValueError: no samples, a placeholder pad id, a sample whose placeholder count does not
            match its media, media of one kind with different tensor keywords, or an optional
            per-token field present in some samples only.
    """
    if not samples:
        raise ValueError("collate: no samples")
    if pad_token_id in (media_tokens.video_token_id, media_tokens.image_token_id):
        raise ValueError(f"collate: pad_token_id={pad_token_id} is a media placeholder token")
    for index, sample in enumerate(samples):
        _check_placeholders(index, sample, media_tokens)
    length = max(s.input_ids.numel() for s in samples)
    return MicroBatch(
        input_ids=_pad_stack([s.input_ids.long() for s in samples], length, pad_token_id),
        target_mask=_pad_stack([s.target_mask for s in samples], length, False),
        lengths=torch.tensor([s.input_ids.numel() for s in samples]),
        advantages=torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32),
        loss_weights=torch.tensor([float(s.loss_weight) for s in samples], dtype=torch.float32),
        old_logprobs=_optional_per_token(samples, "old_logprobs", length),
        behaviour_logprobs=_optional_per_token(samples, "behaviour_logprobs", length),
        ref_logprobs=_optional_per_token(samples, "ref_logprobs", length),
        allowed_tokens=_allowed_tokens(samples),
        media=_media_kwargs(samples),
    )


def _allowed_tokens(samples: Sequence[PolicySample]) -> torch.Tensor | None:
    """The samples' packed masks, concatenated; all-allowed rows for a sample without."""
    present = [s.allowed_tokens for s in samples if s.allowed_tokens is not None]
    if not present:
        return None
    words = present[0].size(1)
    if any(mask.size(1) != words for mask in present):
        raise ValueError("collate: allowed_tokens of different widths (vocabularies) in one micro-batch")
    return torch.cat(
        [
            s.allowed_tokens
            if s.allowed_tokens is not None
            else torch.full((s.num_target_tokens, words), -1, dtype=torch.int32)
            for s in samples
        ]
    )
