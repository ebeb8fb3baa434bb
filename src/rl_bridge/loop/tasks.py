"""The training loop's task: its rows, the policy checkpoint, and the Gym servers that serve it.

Two environments (:attr:`~rl_bridge.recipe.TaskSection.environment`):

- ``mcqa``: ``video_mcqa`` rows built from the synthetic video tasks, like
  :func:`gym_video_env.environments.video_mcqa_rows`, with the knobs that make a tiny random model
  learnable from reward within minutes (see :class:`~rl_bridge.recipe.TaskSection`): options
  in a canonical order, the instruction of the chosen answer format, and optionally only the
  colour clips that show their colour in every frame. Optionally a fraction of the training rows
  carry bad media, which the run must mask and count;
- ``segments``: multi-turn ``video_segments`` rows
  (:func:`gym_video_env.environments.video_segments_rows`) served by ``video_tools_agent``: the
  prompt has no video and the environment returns one segment's clip after each model turn, so a
  trajectory shows ``num_segments`` clips, each in a later turn, and the last answer is graded;
- ``agentic``: ``video_segments`` rows whose question names one segment
  (:func:`gym_video_env.environments.video_segment_question_rows`), served by
  ``video_tools_agent`` without an observation route: the model must call ``watch_segment`` (a
  tool call vLLM's parser turns into a Gym ``function_call``) for the named segment, see its clip
  in the next turn, and answer; every call costs ``task.tool_call_cost``. With
  ``rollout.constrain_actions`` every model turn is decoded under a structured-outputs choice of
  the valid actions (:func:`action_choices`).

:func:`prepare_task` builds everything a run needs before any server starts (:class:`TaskData`).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gym_video_env.environments import (
    WATCH_SEGMENT_TOOL_NAME,
    mcqa_row,
    video_last_segment_rows,
    video_segment_question_rows,
    video_segments_rows,
)
from gym_video_env.grading import BOXED_INSTRUCTION, LETTER_INSTRUCTION
from gym_video_env.synthetic import ClipConfig, make_task_clip
from rl_bridge.recipe import ModelSection, Recipe, TaskSection

if TYPE_CHECKING:
    from rl_bridge.services.gym_server import GymServerSpec

__all__ = [
    "MEDIA_FAULT_KEY",
    "MODEL_SERVER",
    "TaskData",
    "action_choices",
    "hermes_tool_call",
    "turn_choices",
    "letter_token_ids",
    "option_letters",
    "prepare_task",
    "task_rows",
    "with_bad_media",
]

logger = logging.getLogger(__name__)

MODEL_SERVER = "policy_model"
AGENT_SERVER = "task_agent"
# Per environment: the resources server directory (also its instance name).
_RESOURCES: Final[dict[str, str]] = {
    "mcqa": "video_mcqa",
    "segments": "video_segments",
    "agentic": "video_segments",
}
# The observation route of video_segments that returns the next unseen segment's clip.
_NEXT_SEGMENT_ROUTE: Final = "/next_segment"

MEDIA_FAULT_KEY: Final = "media_fault"
"""Row field of a row whose clip was replaced by bad media: the bad-input case id
(:mod:`gym_video_env.synthetic.bad_inputs`), e.g. ``"truncated"`` or ``"missing_file"``."""
_MISSING_FILE: Final = "missing_file"
# The cases bad rows take first, so that a few bad rows already mix the common kinds of damage.
_FAULT_ORDER: Final = ("truncated", "not_a_video", _MISSING_FILE, "zero_length", "corrupt_middle")

_LETTERS = "ABCDEFGH"


def option_letters(task: TaskSection) -> str:
    """The letters the options of ``task`` are labelled with (``"ABCD"`` for 4 options)."""
    return _LETTERS[: task.num_options]


def _clip_config(task: TaskSection) -> ClipConfig:
    return ClipConfig(
        width=task.width,
        height=task.height,
        num_frames=task.num_frames,
        fps=task.fps,
        num_options=task.num_options,
    )


def _instruction(task: TaskSection) -> str:
    return LETTER_INSTRUCTION if task.answer_format == "letter" else BOXED_INSTRUCTION


def hermes_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the Qwen chat templates write it and vLLM's ``hermes`` parser reads it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def action_choices(task: TaskSection, *, calls_only: bool = False) -> list[str]:
    """The valid actions of one ``agentic`` model turn: an option letter, or one ``watch_segment``
    call for a segment in range, written exactly as the chat template re-renders it (so the next
    turn's prompt continues the generated tokens when they took the template's tokenisation).
    ``calls_only``: the calls alone (a first turn that must act)."""
    calls = [
        hermes_tool_call(WATCH_SEGMENT_TOOL_NAME, {"segment": k}) for k in range(1, task.num_segments + 1)
    ]
    return calls if calls_only else [*option_letters(task), *calls]


def demonstration(task: TaskSection, row: Mapping[str, Any]) -> str:
    """The demonstrated first action of an ``agentic`` row (``warm_start``): the call of the
    segment its question names, as :func:`action_choices` writes it.

    Raises:
        ValueError: the row names no segment (not an ``agentic`` row).
    """
    if row.get("named_segment") is None:
        raise ValueError(
            f"row {row.get('task_id')!r} names no segment: only agentic rows have demonstrations"
        )
    return hermes_tool_call(WATCH_SEGMENT_TOOL_NAME, {"segment": int(row["named_segment"])})


def turn_choices(recipe: Recipe) -> list[list[str]]:
    """The structured-outputs choice of each model turn under ``rollout.constrain_actions``: turn
    ``i`` is decoded under ``turn_choices[min(i, len - 1)]`` (the first turn calls only with
    ``rollout.first_turn_tool_call``); empty without a constraint."""
    if not recipe.rollout.constrain_actions:
        return []
    full = action_choices(recipe.task)
    return (
        [action_choices(recipe.task, calls_only=True), full]
        if recipe.rollout.first_turn_tool_call
        else [full]
    )


def task_rows(
    task: TaskSection, media_root: Path, n: int, *, seed: int, subdir: str, held_out: bool = False
) -> list[dict[str, Any]]:
    """Write clips under ``media_root/subdir`` and return ``n`` rows of ``task.environment``.

    ``mcqa`` rows (:func:`gym_video_env.environments.mcqa_row`) carry ``task_id``, ``task``,
    ``options`` (letter -> text) and ``answer``; with ``task.canonical_options`` the options are
    sorted by their text and relettered, so questions with the same option set always use the
    same letter for an answer. ``segments`` rows
    (:func:`gym_video_env.environments.video_segments_rows`) carry ``task_id``, ``segments``,
    ``options`` and ``answer``; they keep the ``watch_segment`` tool with ``tool_choice: "none"``
    (the loop's vLLM runs without a tool-call parser), so each clip arrives through the
    environment's ``/next_segment`` observation after a model turn. ``agentic`` rows
    (:func:`gym_video_env.environments.video_segment_question_rows`): the question names one
    segment; ``held_out`` rows never show its clip in the prompt and always have segments of
    distinct colours (``task.shown_segment_fraction`` and ``task.same_colour_fraction`` apply to
    training rows only).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"task_rows: n must be >= 1, got {n}")
    if task.environment == "segments":
        return _segments_rows(task, media_root, n, seed=seed, subdir=subdir)
    if task.environment == "agentic":
        return video_segment_question_rows(
            media_root,
            n,
            seed=seed,
            num_segments=task.num_segments,
            num_options=task.num_options,
            config=_clip_config(task),
            instruction=_instruction(task),
            shown_fraction=0.0 if held_out else task.shown_segment_fraction,
            same_colour_fraction=0.0 if held_out else task.same_colour_fraction,
            subdir=subdir,
        )
    return _mcqa_rows(task, media_root, n, seed=seed, subdir=subdir)


def _mcqa_rows(
    task: TaskSection, media_root: Path, n: int, *, seed: int, subdir: str
) -> list[dict[str, Any]]:
    config = _clip_config(task)
    rows: list[dict[str, Any]] = []
    index = 0
    while len(rows) < n:
        record = make_task_clip(task.name, media_root / subdir, seed=seed, index=index, config=config)
        index += 1
        if task.name == "colour" and task.whole_clip_only and record.metadata["tail_only"]:
            (media_root / subdir / record.video).unlink()
            continue
        texts = list(record.options.values())
        if task.canonical_options:
            texts = sorted(texts)
        options = dict(zip(_LETTERS, texts, strict=False))
        answer = next(letter for letter, text in options.items() if text == record.answer_text)
        prompt = "\n".join(
            [record.question, *(f"{letter}. {text}" for letter, text in options.items()), _instruction(task)]
        )
        rows.append(
            mcqa_row(
                video_url=f"{subdir}/{record.video}",
                prompt=prompt,
                task_id=record.id,
                task=record.task,
                options=options,
                answer=answer,
            )
        )
    return rows


def _segments_rows(
    task: TaskSection, media_root: Path, n: int, *, seed: int, subdir: str
) -> list[dict[str, Any]]:
    if task.segments_question == "last":
        rows = video_last_segment_rows(
            media_root,
            n,
            seed=seed,
            num_segments=task.num_segments,
            num_options=task.num_options,
            config=_clip_config(task),
            later_clips=task.later_clips,
            earlier_colours=task.earlier_colours,
            still_segments=task.still_segments,
            subdir=subdir,
        )
    else:
        rows = video_segments_rows(
            media_root,
            n,
            seed=seed,
            num_segments=task.num_segments,
            num_options=task.num_options,
            config=_clip_config(task),
            canonical_options=task.canonical_options,
            whole_clips=task.whole_clip_only,
            subdir=subdir,
        )
    instruction = _instruction(task)
    for row in rows:
        params = row["responses_create_params"]
        params["tool_choice"] = "none"
        if instruction != BOXED_INSTRUCTION:
            (text_part,) = params["input"][0]["content"]
            question = text_part["text"].removesuffix(BOXED_INSTRUCTION)
            if question == text_part["text"]:
                raise ValueError(
                    f"segments row {row['task_id']}: the prompt does not end with the boxed instruction"
                )
            text_part["text"] = question + instruction
    return rows


def with_bad_media(
    rows: list[dict[str, Any]], fraction: float, media_root: Path, *, seed: int, subdir: str = "bad"
) -> list[dict[str, Any]]:
    """``rows`` with ``round(fraction * len(rows))`` of them, chosen with ``seed``, pointing at bad media.

    The choice draws from ``random.Random(f"{seed}/bad_rows")``, a stream of its own: the loops
    order the rows with ``random.Random(recipe.seed)`` (sync) or ``f"{seed}/{pass}"`` (async), and
    with a shared integer seed the first pass of the sync order would visit exactly the chosen rows
    first (``Random.sample`` and ``shuffle`` then ``pop`` draw the same indices).

    The bad files are the corpus of :func:`gym_video_env.synthetic.bad_inputs.write_bad_inputs`
    (written under ``media_root/subdir``) whose video every layer refuses (truncated, zero-length,
    audio-only, no decodable frame, over the pixel budget, unknown codec, not a video), plus a
    reference to a file that does not exist; the chosen rows take them in turn (truncated, not a
    video, missing, zero-length and corrupt first). A bad row keeps its question, options and
    answer; its ``task_id`` gets the case as suffix and :data:`MEDIA_FAULT_KEY` names the case.

    Raises:
        ValueError: ``fraction`` is not in ``[0, 1)``, or a chosen row has no ``input_video`` part.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"with_bad_media: fraction must be in [0, 1), got {fraction}")
    count = round(fraction * len(rows))
    if count == 0:
        return list(rows)
    from gym_video_env.synthetic.bad_inputs import write_bad_inputs

    root = media_root / subdir
    corpus = write_bad_inputs(root, media_root.parent / f"{media_root.name}-{subdir}-outside")
    faults = [
        (case.id, case.path.relative_to(media_root).as_posix())
        for case in corpus
        if case.path is not None
        and case.path.parent == root / "videos"
        and case.expected.get("gym_server") == "error"
        and case.expected.get("trainer") == "error"
    ]
    faults.append((_MISSING_FILE, f"{subdir}/videos/{_MISSING_FILE}.mp4"))
    rank = {case: position for position, case in enumerate(_FAULT_ORDER)}
    faults.sort(key=lambda fault: rank.get(fault[0], len(rank)))
    chosen = sorted(random.Random(f"{seed}/bad_rows").sample(range(len(rows)), count))
    out = list(rows)
    for turn, index in enumerate(chosen):
        case, reference = faults[turn % len(faults)]
        out[index] = _replace_video(rows[index], reference, case)
    return out


def _replace_video(row: dict[str, Any], reference: str, case: str) -> dict[str, Any]:
    """A copy of ``row`` whose ``input_video`` parts point at ``reference``, marked with ``case``."""
    replaced = 0
    messages = []
    for message in row["responses_create_params"]["input"]:
        content = []
        for part in message["content"]:
            if part.get("type") == "input_video":
                part = {"type": "input_video", "video_url": reference}
                replaced += 1
            content.append(part)
        messages.append({**message, "content": content})
    if not replaced:
        raise ValueError(f"row {row.get('task_id')!r} has no input_video part to replace")
    return {
        **row,
        "responses_create_params": {**row["responses_create_params"], "input": messages},
        "task_id": f"{row['task_id']}-{case}",
        MEDIA_FAULT_KEY: case,
    }


def letter_token_ids(model_dir: Path, letters: str) -> list[int]:
    """The token id of each option letter in ``model_dir``'s tokenizer.

    Raises:
        ValueError: a letter is not exactly one token.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = []
    for letter in letters:
        encoded = tokenizer.encode(letter, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"option letter {letter!r} is {len(encoded)} tokens {encoded} in {model_dir}, not one"
            )
        ids.append(encoded[0])
    return ids


@dataclass(frozen=True)
class TaskData:
    """What a run needs before its servers start: the model, the media and the rows."""

    model_dir: Path
    """The HF checkpoint the policy starts from (the tiny model, or ``model.path``)."""
    media_root: Path
    """Root of every clip the rows refer to (the servers' allowed media path)."""
    train_rows: list[dict[str, Any]]
    val_rows: list[dict[str, Any]]
    letter_ids: list[int]
    """Token ids of the option letters (sampling is restricted to them when configured)."""
    action_tokens: list[int] | None = None
    """With ``rollout.canonical_actions``: the tokens that spell every action one way
    (:func:`~rl_bridge.structured_outputs.canonical_action_tokens`)."""

    def token_support(self, recipe: Recipe) -> list[int] | None:
        """The tokens vLLM samples from: the option letters with ``rollout.restrict_to_options``,
        the actions' tokens with ``rollout.canonical_actions``, else ``None`` (the whole
        vocabulary). The policy's logprobs run over the same tokens."""
        if recipe.rollout.canonical_actions:
            return list(self.action_tokens or ())
        return list(self.letter_ids) if recipe.rollout.restrict_to_options else None

    def gym_specs(
        self, recipe: Recipe, *, openai_url: str | Sequence[str], model_name: str
    ) -> tuple[list[GymServerSpec], str]:
        """The Gym servers of the task and the name of the agent server whose ``/run`` rolls out.

        ``openai_url``: the vLLM server's OpenAI endpoint, or each replica's (the model server
        spreads sessions over them).

        The model server is the project's ``video_vllm_model`` (which sends ``allowed_token_ids``
        with every request when sampling is restricted to the option letters; media in tool
        outputs are relocated into the next user message). The agent is ``video_tools_agent``,
        which answers a row the model server refuses (a video that does not decode) with that
        4xx, so the rollout counts it as a content failure instead of retrying it. ``mcqa``: the
        resources server ``video_mcqa``, one model call (the agent is then Gym's
        ``simple_agent``). ``segments``: ``video_segments``, the agent asking ``/next_segment``
        for the next clip after every model turn: ``num_segments + 1`` model calls, the clips in
        between. ``agentic``: ``video_segments`` with ``tool_call_cost`` and no observation route:
        a turn that calls ``watch_segment`` gets the clip in the next turn, a turn that answers
        ends the episode (``num_segments + 1`` model calls at most); with
        ``rollout.constrain_actions`` the model server sends the structured-outputs choice of
        :func:`action_choices` with every request. Both grade the final answer in ``task.answer_format``.
        """
        from rl_bridge.services.gym_server import GymServerSpec, video_model_server_spec
        from rl_bridge.structured_outputs import choice_request_body

        task = recipe.task
        support = self.token_support(recipe)
        extra_body: dict[str, Any] | None = {"allowed_token_ids": support} if support is not None else None
        if recipe.rollout.constrain_actions:
            extra_body = choice_request_body(action_choices(task))
            if support is not None:  # canonical_actions: one spelling per action
                extra_body["allowed_token_ids"] = support
        model = video_model_server_spec(
            MODEL_SERVER,
            openai_url=openai_url,
            model=model_name,
            media_root=self.media_root,
            extra_body=extra_body,
        )
        name = _RESOURCES[task.environment]
        resources_fields: dict[str, Any] = {
            "domain": "knowledge" if task.environment == "mcqa" else "agent",
            "answer_format": task.answer_format,
        }
        agent_fields: dict[str, Any] = {
            "max_steps": task.max_model_calls,
            "policy_fault_reward": recipe.rollout.policy_fault_reward,
        }
        if task.environment == "agentic":
            resources_fields["tool_call_cost"] = task.tool_call_cost
            if recipe.rollout.first_turn_tool_call:  # the model server merges metadata.extra_body
                first = choice_request_body(turn_choices(recipe)[0])
                agent_fields["first_call_params"] = {"metadata": {"extra_body": json.dumps(first)}}
        elif task.environment == "segments":
            agent_fields["observation_route"] = _NEXT_SEGMENT_ROUTE
        resources = GymServerSpec(name, "resources_servers", name, resources_fields)
        agent = GymServerSpec(
            AGENT_SERVER,
            "responses_api_agents",
            "video_tools_agent",
            {"resources_server": resources.ref(), "model_server": model.ref(), **agent_fields},
        )
        return [model, resources, agent], AGENT_SERVER


def checkpoint_dir(model: ModelSection) -> Path:
    """The policy's starting checkpoint: the tiny model (built, or found in the cache) when
    ``model.path`` is ``None``; else ``model.path`` as a directory, or as a hub id fetched into
    (or found in) the Hugging Face cache (``HF_HUB_OFFLINE=1``: the cache only).

    Raises:
        huggingface_hub.errors.HFValidationError, OSError: ``model.path`` is neither a directory
            nor a hub id that can be fetched.
    """
    if model.path is None:
        from rl_bridge.tiny_models import build_tiny_model

        return build_tiny_model(model.family, seed=model.seed, **model.spec)
    local = Path(model.path).expanduser()
    if local.is_dir():
        return local.resolve()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model.path))


def prepare_task(recipe: Recipe) -> TaskData:
    """Get the checkpoint and write the task's clips under ``<run_dir>/media``.

    Deterministic in the recipe's seeds: a resumed run calls it again and gets the same rows.
    The loops check the hardware (:meth:`~rl_bridge.recipe.Recipe.require_hardware`) first.
    """
    media_root = recipe.run_dir.resolve() / "media"
    model_dir = checkpoint_dir(recipe.model)
    logger.info("checkpoint %s", model_dir)
    task = recipe.task
    train_rows = task_rows(task, media_root, task.train_rows, seed=task.seed, subdir="train")
    if task.bad_row_fraction:
        train_rows = with_bad_media(train_rows, task.bad_row_fraction, media_root, seed=task.seed)
    val_rows = task_rows(task, media_root, task.val_rows, seed=task.seed + 1, subdir="val", held_out=True)
    logger.info(
        "task %s (%s): %d training and %d held-out rows, clips in %s",
        task.name,
        task.environment,
        len(train_rows),
        len(val_rows),
        media_root,
    )
    action_tokens = None
    if recipe.rollout.canonical_actions:
        from rl_bridge.structured_outputs import canonical_action_tokens

        action_tokens = canonical_action_tokens(model_dir, action_choices(task))
    return TaskData(
        model_dir=model_dir,
        media_root=media_root,
        train_rows=train_rows,
        val_rows=val_rows,
        letter_ids=letter_token_ids(model_dir, option_letters(task)),
        action_tokens=action_tokens,
    )
