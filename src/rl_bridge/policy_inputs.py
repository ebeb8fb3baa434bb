"""From Gym trajectories to what the policy trains on: tokens, targets, vLLM logprobs, shared media.

:class:`PolicyInputBuilder` turns one rollout into a :class:`RolloutInputs`:

1. the trajectory's trainable turns (:func:`rl_bridge.trajectory.parse_trajectory`): vLLM's new
   prompt tokens, generated tokens and logprobs per turn, and the media each turn introduced;
2. each media part processed once per content through a :class:`~rl_bridge.media_batch.MediaStore`
   (frames from the shared sampling code and decode cache, tensors from the family's processor);
3. per turn, the placeholder runs of vLLM's new prompt tokens against the runs the turn's media
   expand to (:func:`~rl_bridge.media_batch.check_placeholders`).

Any failure masks the rollout instead of raising: :attr:`RolloutInputs.mask_reason` says why and
:class:`~rl_bridge.media_batch.MediaMetrics` counts it. Masked rollouts carry no tensors and are
left out of the policy's forward (their loss weight is 0).

Group dedup: the initial prompt's media are processed once per prompt (:meth:`processed_prompt_media`,
before rollout, e.g. for a length filter) and every sample of the group, every turn and every later
sample that shows the same content holds the same tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gym_video_env.hookspecs import MediaSettings
from rl_bridge.media_batch import (
    MediaLoadError,
    MediaLoadReason,
    MediaMetrics,
    MediaStore,
    check_placeholders,
)
from rl_bridge.megatron.batch import PolicySample
from rl_bridge.processors import MediaProcessor, ProcessedMedia
from rl_bridge.structured_outputs import ConstraintError, GrammarMasks
from rl_bridge.trajectory import (
    Trajectory,
    TrajectoryError,
    TrajectoryErrorReason,
    Turn,
    parse_rollout,
    prompt_media,
)
from vllm_video_plugin.cache import DecodeCache
from vllm_video_plugin.decode import DEFAULT_LIMITS, DecodeLimits

__all__ = ["MaskReason", "PolicyInputBuilder", "RolloutInputs", "SequenceInputs", "TrainedTurns"]

MaskReason = (
    TrajectoryErrorReason
    | MediaLoadReason
    | Literal["placeholder_mismatch", "generated_media_token", "constraint_mismatch"]
)
"""Why a sample is masked: a trajectory violation, media that cannot be processed, a turn whose
placeholder tokens disagree with its media, a generated media placeholder token (vLLM embeds a
generated token as text; the policy's model puts media features at every placeholder id, so it
cannot replay the sample), or a generated token the replayed structured-outputs grammar does not
allow (the trainer's grammar is not the one vLLM decoded with)."""

TrainedTurns = Literal["all", "last"]
"""Which model turns of a trajectory are trained (see :class:`PolicyInputBuilder`)."""


@dataclass(frozen=True, eq=False)
class SequenceInputs:
    """One token sequence of a rollout, ready for the policy.

    Token tensors are ``[T]`` over the sequence: every turn's new prompt tokens, then its generated
    tokens, exactly as vLLM saw and generated them.
    """

    token_ids: torch.Tensor
    """``[T]`` int64 token ids."""
    target_mask: torch.Tensor
    """``[T]`` bool: the generated tokens of the sequence's turns."""
    behaviour_logprobs: torch.Tensor
    """``[T]`` float32: vLLM's logprob of each generated token, 0 elsewhere."""
    media: tuple[ProcessedMedia, ...]
    """The media of the sequence's placeholders, in order (shared objects)."""
    allowed_tokens: torch.Tensor | None = None
    """``[targets, words]`` int32 packed masks of the target tokens (position order) under the
    structured-outputs grammar vLLM decoded with; ``None`` without one."""


@dataclass(frozen=True, eq=False)
class RolloutInputs:
    """One rollout, ready for the policy, or masked with the reason.

    A rollout is one token sequence, or several when the conversation was re-tokenised between
    calls (see :mod:`rl_bridge.trajectory`); every sequence carries the rollout's advantage.
    """

    sequences: tuple[SequenceInputs, ...]
    """Empty when masked."""
    trajectory: Trajectory | None
    """The parsed turns; ``None`` when parsing failed."""
    mask_reason: MaskReason | None = None
    """``None`` when the rollout trains; else why it is masked."""
    mask_detail: str | None = None
    """What exactly failed (location and values), when masked."""

    @property
    def masked(self) -> bool:
        return self.mask_reason is not None

    @property
    def loss_weight(self) -> float:
        """1.0, or 0.0 for a masked rollout."""
        return 0.0 if self.masked else 1.0

    @property
    def media(self) -> tuple[ProcessedMedia, ...]:
        """The media of every sequence, in order (a restated clip appears once per sequence)."""
        return tuple(item for sequence in self.sequences for item in sequence.media)

    def to_policy_samples(self, advantage: float) -> list[PolicySample]:
        """One :class:`~rl_bridge.megatron.batch.PolicySample` per sequence with a trained token,
        media referenced; none for a masked rollout (it has no aligned media to run the forward
        with, and weight 0).

        Args:
            advantage: the rollout's advantage, given to each of its sequences.
        """
        return [
            PolicySample(
                input_ids=sequence.token_ids,
                target_mask=sequence.target_mask,
                advantage=advantage,
                behaviour_logprobs=sequence.behaviour_logprobs,
                media=sequence.media,
                allowed_tokens=sequence.allowed_tokens,
            )
            for sequence in self.sequences
            if bool(sequence.target_mask.any())
        ]


def _masked(reason: MaskReason, detail: str, trajectory: Trajectory | None = None) -> RolloutInputs:
    return RolloutInputs(sequences=(), trajectory=trajectory, mask_reason=reason, mask_detail=detail)


class PolicyInputBuilder:
    """Builds :class:`RolloutInputs` for one checkpoint, sharing processed media across rollouts."""

    def __init__(
        self,
        processor: MediaProcessor,
        settings: MediaSettings,
        *,
        decode_cache: DecodeCache | None = None,
        limits: DecodeLimits = DEFAULT_LIMITS,
        trained_turns: TrainedTurns = "all",
        grammars: Sequence[GrammarMasks] = (),
        max_store_bytes: int | None = None,
    ) -> None:
        """
        Args:
            processor: the policy's media processor (:func:`rl_bridge.processors.load_processor`).
            settings: where local media may be (``media_root``); the same root the Gym side uses.
            decode_cache: the frame cache; ``None`` means the process-wide shared one.
            limits: resource bounds per media item (bytes, frame pixels, frame count, decode
                time); media over them mask their sample (``media_unavailable`` for bytes,
                ``media_undecodable`` for the rest).
            trained_turns: which model turns' generated tokens are training targets: ``"all"``
                (every turn carries the trajectory's advantage) or ``"last"`` (only the final
                turn's: the earlier ones stay in the sequence as context). Every turn's media pass
                the placeholder check either way.
            grammars: the structured-outputs grammars the turns were decoded under
                (:class:`~rl_bridge.structured_outputs.GrammarMasks`): turn ``i`` under
                ``grammars[min(i, len(grammars) - 1)]`` (a first turn may have its own). Each
                target token then carries the mask vLLM applied there. Empty: decoding was not
                constrained.
            max_store_bytes: bound on the processed media kept for reuse (:class:`MediaStore`'s
                ``max_bytes``); ``None``: unbounded.
        """
        self.trained_turns = trained_turns
        self.grammars = tuple(grammars)
        self.processor = processor
        self.store = MediaStore(
            processor, settings, decode_cache=decode_cache, limits=limits, max_bytes=max_store_bytes
        )
        self.metrics = MediaMetrics()

    def processed_prompt_media(self, prompt: str | Sequence[Any]) -> tuple[ProcessedMedia, ...]:
        """Process a row's prompt media before rollout; every sample of its group reuses them.

        Args:
            prompt: the row's ``responses_create_params["input"]``.

        Returns:
            The prompt's media in order (their ``num_placeholders`` give the prompt's media tokens,
            for a length filter).

        Raises:
            TrajectoryError, MediaLoadError: a prompt media part is invalid or cannot be processed
                (the row should be dropped before rollout).
        """
        return tuple(self.store.get(part) for part in prompt_media(prompt))

    def build(self, rollout: Mapping[str, Any] | Trajectory) -> RolloutInputs:
        """The inputs of one rollout: a Gym rollout record (``responses_create_params`` and
        ``response``) or an already parsed trajectory. Never raises for bad data: masks it."""
        try:
            trajectory = rollout if isinstance(rollout, Trajectory) else parse_rollout(rollout)
        except TrajectoryError as error:
            return self._count(_masked(error.reason, str(error)))
        placeholders = self.processor.placeholder_token_ids
        for turn in trajectory.turns:
            generated = [i for i, token in enumerate(turn.generation_ids) if token in placeholders]
            if generated:
                token = turn.generation_ids[generated[0]]
                detail = (
                    f"turn {turn.index} (output[{turn.item_index}]) generated the media placeholder token "
                    f"{token} ({len(generated)} time(s), first at generated position {generated[0]}): vLLM "
                    "embedded it as text, the policy's model would read it as a media slot"
                )
                return self._count(_masked("generated_media_token", detail, trajectory))
        processed: dict[int, list[ProcessedMedia]] = {}
        problems: list[tuple[Turn, str]] = []
        for turn in trajectory.turns:
            try:
                processed[turn.index] = [self.store.get(part) for part in turn.new_prompt_media]
            except MediaLoadError as error:
                return self._count(_masked(error.reason, str(error), trajectory))
            problem = check_placeholders(turn.new_prompt_ids, processed[turn.index], placeholders)
            self.metrics.count_turn(problem is None)
            if problem is not None:
                problems.append((turn, problem))
        if problems:
            turn, problem = problems[0]
            detail = f"turn {turn.index} (output[{turn.item_index}]): {problem}"
            return self._count(_masked("placeholder_mismatch", detail, trajectory))
        trained = (
            {turn.index for turn in trajectory.turns}
            if self.trained_turns == "all"
            else {trajectory.turns[-1].index}
        )
        try:
            sequences = tuple(
                _sequence_inputs(turns, processed, trained, self.grammars) for turns in trajectory.sequences
            )
        except ConstraintError as error:
            return self._count(_masked("constraint_mismatch", str(error), trajectory))
        return self._count(RolloutInputs(sequences=sequences, trajectory=trajectory))

    def _count(self, inputs: RolloutInputs) -> RolloutInputs:
        self.metrics.count_sample(inputs.mask_reason)
        return inputs


def _sequence_inputs(
    turns: Sequence[Turn],
    processed: Mapping[int, list[ProcessedMedia]],
    trained: set[int],
    grammars: Sequence[GrammarMasks],
) -> SequenceInputs:
    token_ids = torch.tensor([t for turn in turns for t in (*turn.new_prompt_ids, *turn.generation_ids)])
    target_mask = torch.zeros(len(token_ids), dtype=torch.bool)
    behaviour = torch.zeros(len(token_ids), dtype=torch.float32)
    for turn in turns:
        target_mask[turn.generation_start : turn.end] = turn.index in trained
        behaviour[turn.generation_start : turn.end] = torch.tensor(turn.generation_logprobs)
    media = tuple(item for turn in turns for item in processed[turn.index])
    allowed = None
    if grammars:
        masks = [
            grammars[min(turn.index, len(grammars) - 1)].bitmasks(turn.generation_ids)
            for turn in turns
            if turn.index in trained
        ]
        allowed = torch.cat(masks) if masks else torch.empty(0, grammars[0].words, dtype=torch.int32)
    return SequenceInputs(
        token_ids=token_ids.long(),
        target_mask=target_mask,
        behaviour_logprobs=behaviour,
        media=media,
        allowed_tokens=allowed,
    )
