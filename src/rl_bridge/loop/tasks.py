"""The training loop's task: its rows, the tiny model, and the Gym servers that serve it.

The rows are ``video_mcqa`` rows built from the synthetic video tasks, like
:func:`gym_video_env.environments.video_mcqa_rows`, with the knobs that make a tiny random model
learnable from reward within minutes (see :class:`~rl_bridge.loop.config.TaskSection`): options in
a canonical order, the instruction of the chosen answer format, and optionally only the colour
clips that show their colour in every frame. :func:`prepare_task` builds everything a run needs
before any server starts (:class:`TaskData`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gym_video_env.environments import mcqa_row
from gym_video_env.grading import BOXED_INSTRUCTION, LETTER_INSTRUCTION
from gym_video_env.synthetic import ClipConfig, make_task_clip
from rl_bridge.loop.config import Recipe, TaskSection

if TYPE_CHECKING:
    from rl_bridge.services.gym_server import GymServerSpec

__all__ = ["MODEL_SERVER", "TaskData", "letter_token_ids", "option_letters", "prepare_task", "task_rows"]

MODEL_SERVER = "policy_model"
RESOURCES_SERVER = "video_mcqa"
AGENT_SERVER = "video_mcqa_agent"

_LETTERS = "ABCDEFGH"


def option_letters(task: TaskSection) -> str:
    """The letters the options of ``task`` are labelled with (``"ABCD"`` for 4 options)."""
    return _LETTERS[: task.num_options]


def task_rows(task: TaskSection, media_root: Path, n: int, *, seed: int, subdir: str) -> list[dict[str, Any]]:
    """Write clips under ``media_root/subdir`` and return ``n`` ``video_mcqa`` rows.

    Row fields besides ``responses_create_params``: ``task_id``, ``task``, ``options`` (letter ->
    text) and ``answer``. With ``task.canonical_options`` the options are sorted by their text and
    relettered, so questions with the same option set always use the same letter for an answer.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"task_rows: n must be >= 1, got {n}")
    config = ClipConfig(
        width=task.width,
        height=task.height,
        num_frames=task.num_frames,
        fps=task.fps,
        num_options=task.num_options,
    )
    instruction = LETTER_INSTRUCTION if task.answer_format == "letter" else BOXED_INSTRUCTION
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
            [record.question, *(f"{letter}. {text}" for letter, text in options.items()), instruction]
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
    """The tiny HF checkpoint the policy starts from."""
    media_root: Path
    """Root of every clip the rows refer to (the servers' allowed media path)."""
    train_rows: list[dict[str, Any]]
    val_rows: list[dict[str, Any]]
    letter_ids: list[int]
    """Token ids of the option letters (sampling is restricted to them when configured)."""

    def gym_specs(
        self, recipe: Recipe, *, openai_url: str, model_name: str
    ) -> tuple[list[GymServerSpec], str]:
        """The Gym servers of the task and the name of the agent server whose ``/run`` rolls out.

        The model server is the project's ``video_vllm_model`` (which sends ``allowed_token_ids``
        with every request when sampling is restricted to the option letters), the resources
        server ``video_mcqa``, the agent Gym's stock ``simple_agent``.
        """
        from rl_bridge.services.gym_server import GymServerSpec, video_model_server_spec

        extra_body = (
            {"allowed_token_ids": list(self.letter_ids)} if recipe.rollout.restrict_to_options else None
        )
        model = video_model_server_spec(
            MODEL_SERVER,
            openai_url=openai_url,
            model=model_name,
            media_root=self.media_root,
            extra_body=extra_body,
        )
        resources = GymServerSpec(
            RESOURCES_SERVER,
            "resources_servers",
            "video_mcqa",
            {"domain": "knowledge", "answer_format": recipe.task.answer_format},
        )
        agent = GymServerSpec(
            AGENT_SERVER,
            "responses_api_agents",
            "simple_agent",
            {"resources_server": resources.ref(), "model_server": model.ref(), "max_steps": 1},
        )
        return [model, resources, agent], AGENT_SERVER


def prepare_task(recipe: Recipe) -> TaskData:
    """Build the tiny model and write the task's clips under ``<run_dir>/media``.

    Deterministic in the recipe's seeds: a resumed run calls it again and gets the same rows.
    """
    from rl_bridge.tiny_models import build_tiny_model

    media_root = recipe.run_dir.resolve() / "media"
    model_dir = build_tiny_model(recipe.model.family, seed=recipe.model.seed, **recipe.model.spec)
    task = recipe.task
    train_rows = task_rows(task, media_root, task.train_rows, seed=task.seed, subdir="train")
    val_rows = task_rows(task, media_root, task.val_rows, seed=task.seed + 1, subdir="val")
    return TaskData(
        model_dir=model_dir,
        media_root=media_root,
        train_rows=train_rows,
        val_rows=val_rows,
        letter_ids=letter_token_ids(model_dir, option_letters(task)),
    )
