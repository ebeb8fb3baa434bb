"""Turns of a Gym trajectory: vLLM's tokens and logprobs per model call, and the media each call added.

A NeMo Gym rollout holds the request's ``input`` (the prompt) and ``response.output``: every item
the agent produced after the prompt, in order — assistant messages, function calls, tool outputs,
and user messages the agent or the environment injected (observations, media moved out of tool
outputs by :mod:`gym_video_env.handlers.tool_output`). Gym's ``vllm_model`` server marks the last
output item of each model call with vLLM's ``prompt_token_ids``, ``generation_token_ids`` and
``generation_log_probs``; such an item with a non-empty generation is a **trainable turn**.

:func:`parse_trajectory` walks the items once and gives each trainable turn:

- its **new prompt tokens**: the call's prompt minus every token already seen (the previous calls'
  prompts and generations), after checking that the prompt continues them exactly. vLLM's tokens
  are authoritative; a chat template that re-renders earlier turns can re-tokenise a generation
  differently (stock vLLM re-tokenises the whole conversation each call), and such a prompt is
  not a continuation. By default the trajectory is then **split** into token sequences at that
  call: each sequence is exactly vLLM's tokens, and the call that starts one keeps its whole
  prompt, which shows the earlier media again (:attr:`Turn.restated_media`). With
  ``retokenized="error"`` it raises instead;
- its generated tokens and their logprobs (equal lengths, finite);
- the **media introduced since the previous trainable turn**, in order: ``input_video`` and
  ``input_image`` parts of the prompt (for the first turn) and of user, system and developer
  messages. Any number per turn. Videos may be files, ``file://`` or ``data:`` URLs, or cached-frame
  manifests (``frames_manifest``); the part is kept as written and resolved when it is loaded.
  Media inside a ``function_call_output`` (an agent that recorded the tool output as the tool
  returned it, e.g. Gym's stock agents) are moved out by the same relocation the model server
  applied before prompting vLLM (``gym_video_env``'s ``relocate_tool_output_media`` hook: into a
  user message right after the tool output), so they count where vLLM saw them.

Items after the last trainable turn were never sent to the model and are ignored. Every violation
raises :class:`TrajectoryError` with a :attr:`~TrajectoryError.reason` code that callers count and
turn into a masked sample (see :mod:`rl_bridge.policy_inputs`). This module imports neither NeMo
Gym nor torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from gym_video_env.handlers import IMAGE_PART_TYPE, VIDEO_PART_TYPE, MediaRef, media_ref
from gym_video_env.hookspecs import MediaError, MediaSettings
from gym_video_env.request_media import relocate_tool_outputs

__all__ = [
    "MediaKind",
    "MediaPart",
    "Retokenized",
    "Trajectory",
    "TrajectoryError",
    "TrajectoryErrorReason",
    "Turn",
    "parse_rollout",
    "parse_trajectory",
    "prompt_media",
]

Retokenized = Literal["split", "error"]
"""What a call whose prompt does not continue the earlier tokens does: start a new token sequence
(``"split"``) or raise ``not_prefix_continuation`` (``"error"``)."""

MediaKind = Literal["video", "image"]
"""What a media part is: ``"video"`` (an encoded video or a cached-frame manifest) or ``"image"``."""

TrajectoryErrorReason = Literal[
    "malformed",
    "no_trainable_turn",
    "not_prefix_continuation",
    "logprob_length_mismatch",
    "non_finite_logprob",
    "invalid_media",
    "unsupported_content",
    "media_in_tool_output",
]
"""Why a trajectory cannot be trained on (the metric key of a masked sample):

- ``malformed``: an item or token field has the wrong shape or type;
- ``no_trainable_turn``: no item carries a non-empty generation;
- ``not_prefix_continuation``: a call's prompt does not start with everything seen before it
  (raised with ``retokenized="error"`` only);
- ``logprob_length_mismatch``: generation tokens and logprobs differ in length;
- ``non_finite_logprob``: a logprob is NaN or infinite;
- ``invalid_media``: a media part has no source, several, or an unusable URL;
- ``unsupported_content``: a message part the policy cannot reproduce (audio, files...);
- ``media_in_tool_output``: media inside a tool output that no installed media handler relocates
  (the model server could not have sent them to vLLM).
"""

_TOKEN_FIELDS: Final = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
_MEDIA_PART_KINDS: Final[dict[str, MediaKind]] = {VIDEO_PART_TYPE: "video", IMAGE_PART_TYPE: "image"}
_TEXT_PART_TYPES: Final = frozenset({"input_text", "output_text", "text", "refusal"})
# Roles whose message content Gym sends to the model part by part (assistant content is text).
_MEDIA_ROLES: Final = frozenset({"user", "system", "developer"})


class TrajectoryError(ValueError):
    """A trajectory cannot be trained on.

    ``reason`` is a :data:`TrajectoryErrorReason` code; ``location`` names the offending place, e.g.
    ``output[3].prompt_token_ids`` or ``input[0].content[1]``; ``detail`` says what is wrong.
    """

    def __init__(self, reason: TrajectoryErrorReason, location: str, detail: str) -> None:
        super().__init__(f"{location}: {detail} [{reason}]")
        self.reason: TrajectoryErrorReason = reason
        self.location = location
        self.detail = detail

    def __reduce__(self) -> tuple[type[TrajectoryError], tuple[str, str, str]]:
        return (type(self), (self.reason, self.location, self.detail))


@dataclass(frozen=True)
class MediaPart:
    """One media content part, as the trajectory wrote it."""

    kind: MediaKind
    part: Mapping[str, Any]
    """The content part itself, e.g. ``{"type": "input_video", "video_url": "file:///..."}``."""
    ref: MediaRef
    """Where the bytes are (:func:`gym_video_env.handlers.media_ref`)."""
    location: str
    """Where the part is, e.g. ``input[0].content[1]`` or ``output[4].content[0]``."""


@dataclass(frozen=True)
class Turn:
    """One trainable model call."""

    index: int
    """Position among the trainable turns, from 0."""
    item_index: int
    """Position in ``response.output`` of the item carrying the call's tokens."""
    sequence: int
    """The token sequence the turn belongs to: 0, unless the conversation was re-tokenised."""
    prompt_start: int
    """Offset, in tokens, of :attr:`new_prompt_ids` in its token sequence."""
    new_prompt_ids: tuple[int, ...]
    """The call's prompt tokens not seen before in its sequence (vLLM's, placeholders expanded);
    the whole prompt for the first turn of a sequence."""
    generation_ids: tuple[int, ...]
    generation_logprobs: tuple[float, ...]
    """Log-probability of each generated token under the sampling engine."""
    media: tuple[MediaPart, ...]
    """Media introduced since the previous trainable turn, in order."""
    restated_media: tuple[MediaPart, ...] = ()
    """Media of earlier sequences that :attr:`new_prompt_ids` shows again (first turn of a sequence
    after a re-tokenisation; empty otherwise)."""

    @property
    def new_prompt_media(self) -> tuple[MediaPart, ...]:
        """Every media part whose placeholders are in :attr:`new_prompt_ids`, in order."""
        return self.restated_media + self.media

    @property
    def generation_start(self) -> int:
        """Offset, in tokens, of the generated tokens in its token sequence."""
        return self.prompt_start + len(self.new_prompt_ids)

    @property
    def end(self) -> int:
        """Offset just past this turn's generated tokens."""
        return self.generation_start + len(self.generation_ids)


@dataclass(frozen=True)
class Trajectory:
    """The trainable turns of one rollout, in one or more token sequences."""

    turns: tuple[Turn, ...]

    @property
    def sequences(self) -> tuple[tuple[Turn, ...], ...]:
        """The turns grouped by token sequence; a sequence's tokens concatenate to its last call's
        prompt and generation."""
        grouped: dict[int, list[Turn]] = {}
        for turn in self.turns:
            grouped.setdefault(turn.sequence, []).append(turn)
        return tuple(tuple(turns) for turns in grouped.values())

    def token_ids(self, sequence: int = 0) -> list[int]:
        """Every token of a sequence in order: each turn's new prompt, then its generation."""
        ids: list[int] = []
        for turn in self.turns:
            if turn.sequence == sequence:
                ids += turn.new_prompt_ids
                ids += turn.generation_ids
        return ids

    @property
    def media(self) -> tuple[MediaPart, ...]:
        """Every media part the trajectory introduced, in order (restated ones not repeated)."""
        return tuple(part for turn in self.turns for part in turn.media)


def parse_rollout(record: Mapping[str, Any], *, retokenized: Retokenized = "split") -> Trajectory:
    """:func:`parse_trajectory` of a Gym rollout record (a line of Gym's rollouts JSONL, or the
    ``/run`` result): ``record["responses_create_params"]["input"]`` and
    ``record["response"]["output"]``.

    Raises:
        TrajectoryError: as :func:`parse_trajectory`; ``malformed`` when those keys are missing.
    """
    params = record.get("responses_create_params")
    response = record.get("response")
    if not isinstance(params, Mapping) or "input" not in params:
        raise TrajectoryError("malformed", "responses_create_params", "missing, or without 'input'")
    if not isinstance(response, Mapping) or "output" not in response:
        raise TrajectoryError("malformed", "response", "missing, or without 'output'")
    return parse_trajectory(response["output"], prompt=params["input"], retokenized=retokenized)


def parse_trajectory(
    output: Sequence[Mapping[str, Any]],
    *,
    prompt: str | Sequence[Any] | None,
    retokenized: Retokenized = "split",
) -> Trajectory:
    """Split a Gym ``response.output`` into trainable turns.

    Args:
        output: the response's output items, in order.
        prompt: the request's ``input`` that preceded ``output`` (a string or a list of items);
            its media belong to the first turn. ``None`` when ``output`` itself starts with the
            prompt messages.
        retokenized: what a call whose prompt does not continue the tokens seen before does:
            ``"split"`` starts a new token sequence there, ``"error"`` raises
            ``not_prefix_continuation``.

    Raises:
        TrajectoryError: the first violation found, in item order (see
            :data:`TrajectoryErrorReason`).
    """
    if isinstance(output, (str, bytes)) or not isinstance(output, Sequence):
        raise TrajectoryError("malformed", "output", f"must be a list of items, got {type(output).__name__}")
    pending = list(prompt_media(prompt)) if prompt is not None else []
    turns: list[Turn] = []
    seen: list[int] = []
    shown: list[MediaPart] = []  # media of the calls so far
    # An item's media problem matters only if a model call follows it (items after the last
    # trainable turn were never sent), so it is raised when the next trainable turn comes.
    deferred: TrajectoryError | None = None
    for index, item in enumerate(output):
        where = f"output[{index}]"
        if not isinstance(item, Mapping):
            raise TrajectoryError("malformed", where, f"must be an object, got {type(item).__name__}")
        tokens = _token_fields(item, where)
        if tokens is None:
            try:
                pending += _item_media(item, where)
            except TrajectoryError as error:
                deferred = deferred or error
            continue
        prompt_ids, generation_ids, logprobs = tokens
        if not generation_ids:
            # A call that generated nothing trains nothing; its prompt is a prefix of the next one.
            continue
        if deferred is not None:
            raise deferred
        sequence = turns[-1].sequence if turns else 0
        restated: tuple[MediaPart, ...] = ()
        problem = _prefix_problem(seen, prompt_ids)
        if problem is not None:
            if retokenized == "error":
                raise TrajectoryError("not_prefix_continuation", f"{where}.prompt_token_ids", problem)
            sequence, seen, restated = sequence + 1, [], tuple(shown)
        if not seen and not prompt_ids:
            raise TrajectoryError("malformed", f"{where}.prompt_token_ids", "a call has an empty prompt")
        turns.append(
            Turn(
                index=len(turns),
                item_index=index,
                sequence=sequence,
                prompt_start=len(seen),
                new_prompt_ids=tuple(prompt_ids[len(seen) :]),
                generation_ids=tuple(generation_ids),
                generation_logprobs=tuple(logprobs),
                media=tuple(pending),
                restated_media=restated,
            )
        )
        shown += pending
        pending = []
        seen = [*prompt_ids, *generation_ids]
    if not turns:
        raise TrajectoryError(
            "no_trainable_turn", "output", "no item carries a non-empty generation_token_ids"
        )
    return Trajectory(tuple(turns))


def prompt_media(prompt: str | Sequence[Any]) -> tuple[MediaPart, ...]:
    """The media parts of a request's ``input`` (a string or a list of items), in order.

    Raises:
        TrajectoryError: as :func:`parse_trajectory` for media parts.
    """
    if isinstance(prompt, str):
        return ()
    if isinstance(prompt, bytes) or not isinstance(prompt, Sequence):
        raise TrajectoryError(
            "malformed", "input", f"must be a string or a list, got {type(prompt).__name__}"
        )
    return tuple(part for index, item in enumerate(prompt) for part in _item_media(item, f"input[{index}]"))


def _token_fields(item: Mapping[str, Any], where: str) -> tuple[list[int], list[int], list[float]] | None:
    """The item's vLLM token fields, checked; ``None`` when it has none."""
    present = [name for name in _TOKEN_FIELDS if item.get(name) is not None]
    if not present:
        return None
    if len(present) != len(_TOKEN_FIELDS):
        missing = sorted(set(_TOKEN_FIELDS) - set(present))
        raise TrajectoryError(
            "malformed", where, f"has {present} but not {missing}; token fields come together"
        )
    prompt_ids = _token_ids(item["prompt_token_ids"], f"{where}.prompt_token_ids")
    generation_ids = _token_ids(item["generation_token_ids"], f"{where}.generation_token_ids")
    raw = item["generation_log_probs"]
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise TrajectoryError(
            "malformed", f"{where}.generation_log_probs", f"must be a list, got {type(raw).__name__}"
        )
    if len(raw) != len(generation_ids):
        raise TrajectoryError(
            "logprob_length_mismatch",
            where,
            f"{len(generation_ids)} generation_token_ids but {len(raw)} generation_log_probs",
        )
    logprobs: list[float] = []
    for position, value in enumerate(raw):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TrajectoryError(
                "malformed", f"{where}.generation_log_probs[{position}]", f"must be a number, got {value!r}"
            )
        try:
            number = float(value)
        except OverflowError:  # an integer beyond the float range
            number = math.inf
        if not math.isfinite(number):
            raise TrajectoryError(
                "non_finite_logprob", f"{where}.generation_log_probs[{position}]", f"is {value}"
            )
        logprobs.append(number)
    return prompt_ids, generation_ids, logprobs


def _token_ids(value: Any, where: str) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TrajectoryError("malformed", where, f"must be a list of token ids, got {type(value).__name__}")
    for position, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise TrajectoryError(
                "malformed", f"{where}[{position}]", f"must be a token id (int >= 0), got {token!r}"
            )
    return list(value)


def _prefix_problem(seen: list[int], prompt_ids: list[int]) -> str | None:
    """Why ``prompt_ids`` does not start with ``seen``; ``None`` when it does."""
    head = prompt_ids[: len(seen)]
    if head == seen:
        return None
    if len(prompt_ids) < len(seen):
        detail = f"is {len(prompt_ids)} tokens, shorter than the {len(seen)} tokens already seen"
    else:
        first = next(position for position, (a, b) in enumerate(zip(head, seen, strict=True)) if a != b)
        detail = (
            f"differs from the tokens already seen at position {first} (prompt has {prompt_ids[first]}, "
            f"earlier calls had {seen[first]}): the conversation was re-tokenised differently"
        )
    return detail


def _item_media(item: Any, where: str) -> list[MediaPart]:
    """Media parts of one non-trainable item (prompt message, injected message or tool output)."""
    if isinstance(item, str):
        return []
    if not isinstance(item, Mapping):
        raise TrajectoryError("malformed", where, f"must be an object, got {type(item).__name__}")
    kind = item.get("type")
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, list):
            return []
        media_positions = [
            position for position, part in _parts(output, f"{where}.output") if _media_kind(part.get("type"))
        ]
        if not media_positions:
            return []
        relocated = relocate_tool_outputs([dict(item)], MediaSettings())
        if len(relocated) == 1:  # no handler moved them: vLLM never saw them
            raise TrajectoryError(
                "media_in_tool_output",
                f"{where}.output[{media_positions[0]}]",
                "Gym cannot send media inside a tool output to the model and no media handler "
                "relocates them (gym_video_env's relocate_tool_output_media hook)",
            )
        return [part for moved in relocated[1:] for part in _item_media(moved, f"{where}(relocated)")]
    role = item.get("role")
    if kind not in (None, "message") or not isinstance(role, str) or role not in _MEDIA_ROLES:
        return []  # function calls, reasoning, assistant text: no media
    content = item.get("content")
    if content is None or isinstance(content, str):
        return []
    if not isinstance(content, list):
        raise TrajectoryError(
            "malformed", f"{where}.content", f"must be a string or a list, got {type(content).__name__}"
        )
    media: list[MediaPart] = []
    for position, part in _parts(content, f"{where}.content"):
        location = f"{where}.content[{position}]"
        part_type = part.get("type")
        if isinstance(part_type, str) and part_type in _TEXT_PART_TYPES:
            continue
        media_kind = _media_kind(part_type)
        if media_kind is None:
            raise TrajectoryError(
                "unsupported_content",
                location,
                f"part type {part_type!r} is not text, {VIDEO_PART_TYPE} or {IMAGE_PART_TYPE}",
            )
        try:
            ref = media_ref(dict(part))
        except (MediaError, ValueError) as error:  # ValueError: a URL urllib cannot split
            raise TrajectoryError("invalid_media", location, str(error)) from error
        media.append(MediaPart(kind=media_kind, part=part, ref=ref, location=location))
    return media


def _media_kind(part_type: Any) -> MediaKind | None:
    """``"video"`` or ``"image"`` for a media part's ``type``; ``None`` for anything else (any JSON)."""
    return _MEDIA_PART_KINDS.get(part_type) if isinstance(part_type, str) else None


def _parts(parts: list[Any], where: str) -> Iterator[tuple[int, Mapping[str, Any]]]:
    for position, part in enumerate(parts):
        if not isinstance(part, Mapping):
            raise TrajectoryError(
                "malformed", f"{where}[{position}]", f"must be an object, got {type(part).__name__}"
            )
        yield position, part
