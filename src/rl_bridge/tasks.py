"""The training loop's task: the policy checkpoint, the rows, and the Gym servers that serve them.

Three environments (:attr:`~rl_bridge.recipe.TaskSection.environment`):

- ``mcqa``: one clip in the prompt and a multiple-choice question (``video_mcqa``);
- ``segments``: multi-turn ``video_segments`` rows served by ``video_tools_agent``: the prompt has
  no video and the environment returns one segment's clip after each model turn, so a trajectory
  shows ``num_segments`` clips, each in a later turn, and the last answer is graded;
- ``agentic``: ``video_segments`` rows whose question names one segment, served by
  ``video_tools_agent`` without an observation route: the model must call ``watch_segment`` (a
  tool call vLLM's parser turns into a Gym ``function_call``) for the named segment, see its clip
  in the next turn, and answer; every call costs ``task.tool_call_cost``. With
  ``rollout.constrain_actions`` every model turn is decoded under a structured-outputs choice of
  the valid actions (:func:`action_choices`).

:func:`prepare_task` builds everything a run needs before any server starts (:class:`TaskData`):
the rows come from the ``video_grpo.tasks`` entry point named by the environment, and with
``model.path: null`` the checkpoint from the ``video_grpo.models`` entry point named by the model
family (:mod:`rl_bridge.registry`; this distribution's demo registers both).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gym_video_env.environments import WATCH_SEGMENT_TOOL_NAME
from rl_bridge import registry
from rl_bridge.recipe import ModelSection, Recipe, TaskSection

if TYPE_CHECKING:
    from rl_bridge.services.gym_server import GymServerSpec

__all__ = [
    "MODEL_SERVER",
    "TaskData",
    "action_choices",
    "hermes_tool_call",
    "turn_choices",
    "letter_token_ids",
    "option_letters",
    "prepare_task",
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
#: Resources servers that keep no state per episode (their ``/seed_session`` is Gym's, which does
#: nothing): the agent does not call it.
_STATELESS_RESOURCES: Final[frozenset[str]] = frozenset({"video_mcqa"})
# The observation route of video_segments that returns the next unseen segment's clip.
_NEXT_SEGMENT_ROUTE: Final = "/next_segment"

_LETTERS = "ABCDEFGH"


def option_letters(task: TaskSection) -> str:
    """The letters the options of ``task`` are labelled with (``"ABCD"`` for 4 options)."""
    return _LETTERS[: task.num_options]


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
    """The HF checkpoint the policy starts from (built locally, or ``model.path``)."""
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
    ) -> tuple[list[GymServerSpec], tuple[str, ...]]:
        """The Gym servers of the task and the names of the agent servers whose ``/run`` rolls out
        (one, or ``rollout.gym_workers`` replicas, ``collect_rollouts`` dealing a batch's prompts
        out over them evenly, each group to one).

        ``openai_url``: the vLLM server's OpenAI endpoint, or each replica's (the model server
        spreads sessions over them; with ``rollout.coalesce_window_ms`` or
        ``rollout.declare_groups``, groups: each group's samples on the server its prompt hashes
        to).

        With ``rollout.gym_workers`` above 1 the agent, the resources server and the model server
        run as that many replicas of one process each (``task_agent``, ``task_agent_1``, ...;
        ``policy_model``, ``policy_model_1``, ...), agent replica ``i`` calling resources and
        model replica ``i``; the rollout client deals a batch's prompts out over the agent replicas
        (``rl_bridge.rollout.spread_prompts``), so a group's samples stay in one process of each
        server all the way, and its first turns reach the model server together. (uvicorn workers
        sharing a port take connections whichever is free: a group's samples would wait in
        different queues.) With ``rollout.spread_group_samples`` every agent replica lists every
        model replica, and a group's samples take several agent and resources replicas, each
        request naming the group's model replica.

        The model server is the project's ``video_vllm_model`` (which sends ``allowed_token_ids``
        with every request when sampling is restricted to the option letters; media in tool
        outputs are relocated into the next user message). The agent is ``video_tools_agent``,
        which answers a row the model server refuses (a video that does not decode) with that
        4xx, so the rollout counts it as a content failure instead of retrying it. ``mcqa``: the
        resources server ``video_mcqa``, one model call (the agent is then Gym's
        ``simple_agent``, less the call to ``/seed_session``: the server keeps no state per
        episode). ``segments``: ``video_segments``, the agent asking ``/next_segment`` for the
        next clip after every model turn: ``num_segments + 1`` model calls, the clips in
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
        model_fields: dict[str, Any] = {}
        if recipe.rollout.coalesce_window_ms > 0:
            model_fields["coalesce_window_ms"] = recipe.rollout.coalesce_window_ms
            model_fields["coalesce_max_n"] = recipe.rollout.group_size  # a full group goes at once
            model_fields["coalesce_max_wait_ms"] = recipe.rollout.coalesce_max_wait_ms
        if recipe.rollout.coalesces_groups:
            model_fields["route_by_prompt"] = True  # a group meets on one vLLM server
        workers = recipe.rollout.gym_workers
        # Every server as `workers` replicas, one process each, a row's whole path through replica
        # i (the client picks i by the prompt): uvicorn workers on one port would split a group
        # between processes, and the model server could not coalesce it.
        models = [
            video_model_server_spec(
                _replica(MODEL_SERVER, replica),
                openai_url=openai_url,
                model=model_name,
                media_root=self.media_root,
                extra_body=extra_body,
                **model_fields,
            )
            for replica in range(workers)
        ]
        name = _RESOURCES[task.environment]
        resources_fields: dict[str, Any] = {
            "domain": "knowledge" if task.environment == "mcqa" else "agent",
            "answer_format": task.answer_format,
        }
        agent_fields: dict[str, Any] = {
            "max_steps": task.max_model_calls,
            "policy_fault_reward": recipe.rollout.policy_fault_reward,
            "seed_session": name not in _STATELESS_RESOURCES,
        }
        if task.environment == "agentic":
            resources_fields["tool_call_cost"] = task.tool_call_cost
            if recipe.rollout.first_turn_tool_call:  # the model server merges metadata.extra_body
                first = choice_request_body(turn_choices(recipe)[0])
                agent_fields["first_call_params"] = {"metadata": {"extra_body": json.dumps(first)}}
        elif task.environment == "segments":
            agent_fields["observation_route"] = _NEXT_SEGMENT_ROUTE
        resources = [
            GymServerSpec(_replica(name, i), "resources_servers", name, resources_fields)
            for i in range(workers)
        ]
        if recipe.rollout.spread_group_samples:  # every agent reaches every model replica, by index
            every = {"model_server": models[0].ref(), "model_servers": [model.ref() for model in models[1:]]}
            routes = [every] * workers
        else:
            routes = [{"model_server": models[i].ref()} for i in range(workers)]
        agents = [
            GymServerSpec(
                _replica(AGENT_SERVER, i),
                "responses_api_agents",
                "video_tools_agent",
                {"resources_server": resources[i].ref(), **routes[i], **agent_fields},
            )
            for i in range(workers)
        ]
        return [*models, *resources, *agents], tuple(agent.name for agent in agents)


def _replica(name: str, index: int) -> str:
    """The name of a Gym server's replica ``index`` (the first keeps the server's name)."""
    return name if index == 0 else f"{name}_{index}"


def checkpoint_dir(model: ModelSection) -> Path:
    """The policy's starting checkpoint: when ``model.path`` is ``None``, the model of
    ``model.family`` built (or found in a cache) by its ``video_grpo.models`` entry point; else
    ``model.path`` as a directory, or as a hub id fetched into (or found in) the Hugging Face
    cache (``HF_HUB_OFFLINE=1``: the cache only).

    Raises:
        rl_bridge.registry.MissingEntryPoint: ``model.path`` is ``None`` and no entry point
            builds ``model.family``.
        huggingface_hub.errors.HFValidationError, OSError: ``model.path`` is neither a directory
            nor a hub id that can be fetched.
    """
    if model.path is None:
        return registry.local_model(model.family).build(seed=model.seed, **model.spec)
    local = Path(model.path).expanduser()
    if local.is_dir():
        return local.resolve()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model.path))


def prepare_task(recipe: Recipe) -> TaskData:
    """Get the checkpoint and write the task's media and rows under ``<run_dir>/media`` (the
    ``video_grpo.tasks`` entry point named by ``task.environment``).

    Deterministic in the recipe's seeds: a resumed run calls it again and gets the same rows.
    The loops check the hardware (:meth:`~rl_bridge.recipe.Recipe.require_hardware`) first.
    """
    media_root = recipe.run_dir.resolve() / "media"
    model_dir = checkpoint_dir(recipe.model)
    logger.info("checkpoint %s", model_dir)
    task = recipe.task
    train_rows, val_rows = registry.task_rows(task.environment)(task, media_root)
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
