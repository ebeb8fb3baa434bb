"""The typed training recipe: YAML files plus dotted command-line overrides, unknown keys rejected.

A recipe is a :class:`Recipe`; every section and field has a default, so an empty file (or no file)
is the embedded tiny CPU run. Overrides are ``section.field=value`` strings whose value is parsed as
YAML (``train.learning_rate=1e-3``, ``model.spec.text_num_layers=1``, ``task.name=count``)::

    recipe = load_recipe("recipes/tiny_cpu_sync.yaml", ["train.steps=5"])
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from gym_video_env.grading import AnswerFormat
from rl_bridge.grpo import GRPOLossConfig

if TYPE_CHECKING:
    from rl_bridge.megatron.policy import PolicyConfig

__all__ = [
    "AsyncSection",
    "ClusterSection",
    "ModelSection",
    "Recipe",
    "RolloutSection",
    "TaskSection",
    "TrainSection",
    "ValidationSection",
    "apply_overrides",
    "load_recipe",
]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSection(_Section):
    """The policy checkpoint: a tiny random-weight model built locally."""

    family: Literal["qwen2_5_vl"] = "qwen2_5_vl"
    """Tiny model family (the one Megatron-Bridge trains without Transformer Engine)."""
    seed: int = 0
    """Seed of the random weight initialisation."""
    spec: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the family's spec fields (``rl_bridge.tiny_models.Qwen25VLSpec``)."""


class TaskSection(_Section):
    """The synthetic multiple-choice video task (``gym_video_env.synthetic``)."""

    name: Literal["colour", "count", "order"] = "colour"
    train_rows: PositiveInt = 256
    """Distinct training questions (clips); steps cycle through them in a fresh order each pass."""
    val_rows: PositiveInt = 48
    """Held-out questions (clips of another seed) for validation."""
    seed: NonNegativeInt = 0
    """Seed of the training clips; the held-out clips use ``seed + 1``."""
    num_options: int = Field(6, ge=2, le=6)
    """Options per question, lettered from A."""
    canonical_options: bool = True
    """List the options in a fixed order (the task's option pool order) instead of shuffled, so
    each letter always means the same answer: the model then learns clip -> letter directly."""
    whole_clip_only: bool = True
    """Colour task: keep only clips that show the colour in every frame (drop those that show it in
    the last one or two frames only, which frame sampling at the processor's fps can skip)."""
    answer_format: AnswerFormat = "letter"
    """``"letter"``: the answer is one option letter (pair with ``rollout.restrict_to_options``);
    ``"boxed"``: ``\\boxed{X}`` in free text."""
    num_frames: int = Field(8, ge=5)
    fps: PositiveFloat = 4.0
    width: int = Field(56, ge=32)
    height: int = Field(56, ge=32)


class RolloutSection(_Section):
    """Sampling with vLLM through the Gym agent."""

    prompts_per_step: PositiveInt = 32
    group_size: int = Field(8, ge=2)
    """Samples per prompt (G)."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature; keep 1.0 (vLLM reports raw logprobs, the trainer's are at 1.0)."""
    max_output_tokens: PositiveInt = 1
    restrict_to_options: bool = True
    """Sample only the option-letter tokens (vLLM ``allowed_token_ids``, sent by the model server
    on every request); vLLM's raw logprobs stay full-vocabulary ones."""
    max_in_flight: PositiveInt = 16
    max_attempts: PositiveInt = 3
    timeout_s: PositiveFloat = 300.0


class TrainSection(_Section):
    """The Megatron policy update."""

    steps: PositiveInt = 10
    learning_rate: PositiveFloat = 3e-4
    micro_batch_size: PositiveInt = 64
    weight_decay: float = Field(0.0, ge=0.0)
    loss: GRPOLossConfig = Field(default_factory=GRPOLossConfig)
    checkpoint_at_end: bool = True
    """Write a training checkpoint (model, optimizer, step) and an HF export at the end."""


class ValidationSection(_Section):
    """Held-out evaluation with greedy decoding."""

    every: NonNegativeInt = 2
    """Validate after every ``every`` steps (and before the first and after the last); 0: never."""
    target_accuracy: float = Field(0.9, ge=0.0, le=1.0)
    """The summary reports the first step whose validation accuracy reached this."""
    stop_at_target: bool = False
    """End the run once validation accuracy reaches ``target_accuracy``."""


class AsyncSection(_Section):
    """Async GRPO (``mode: async``): a collector fills a replay buffer with complete groups while
    the trainer trains on them (:mod:`rl_bridge.loop.async_grpo`).

    A group's *age* is the number of weight versions (training steps) between the weights it was
    dispatched with and the weights it is trained on.
    """

    max_age: PositiveInt = 1
    """Oldest group the trainer consumes, in weight versions; older ones are evicted, counted and
    their rows generated again with the current weights."""
    buffer_groups: PositiveInt = 64
    """Most groups buffered or being generated at once (at least ``rollout.prompts_per_step``);
    the collector waits while the buffer is full."""
    epochs: PositiveInt | None = None
    """Passes over the training rows, each in a fresh seeded order; the run ends cleanly once
    they are used up and the buffer is drained. ``None``: unbounded (``train.steps`` ends the
    run)."""
    checkpoint_every: NonNegativeInt = 0
    """Write a resumable checkpoint (policy, buffer, data position, weight version) every this
    many steps; 0: only at the end. ``video-grpo train --resume`` continues from the latest."""
    refit_pause_mode: Literal["keep", "wait"] = "keep"
    """What vLLM does with requests running during a refit: ``"keep"`` freezes them and they
    continue on the new weights (vLLM's in-flight update); ``"wait"`` lets them finish first
    (new requests queue meanwhile)."""


class ClusterSection(_Section):
    """Where the roles (vLLM server, Gym servers, policy workers) run."""

    backend: Literal["local", "ray"] = "local"
    """``"local"``: subprocesses and the policy in the controller's process on this host;
    ``"ray"``: Ray actors (see :mod:`rl_bridge.loop.ray_roles`)."""
    ray_address: str | None = None
    """Address of a running Ray cluster (``"auto"``, ``"ray://host:10001"``); ``None`` with
    ``backend="ray"``: start a local Ray instance for the run."""


class Recipe(_Section):
    """A whole training run."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    run_dir: Path = Path("runs/tiny_cpu_sync")
    """Logs, TensorBoard events, curves, checkpoints; created if missing."""
    seed: int = 0
    """Seed of the step order and of vLLM's sampling."""
    mode: Literal["sync", "async"] = "sync"
    """``"sync"``: generate, then train, each step (:mod:`rl_bridge.loop.sync`); ``"async"``:
    generate into a replay buffer while training (:mod:`rl_bridge.loop.async_grpo`)."""
    model: ModelSection = Field(default_factory=ModelSection)
    task: TaskSection = Field(default_factory=TaskSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    train: TrainSection = Field(default_factory=TrainSection)
    validation: ValidationSection = Field(default_factory=ValidationSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    async_: AsyncSection = Field(default_factory=AsyncSection, alias="async")
    """Async GRPO settings (used with ``mode: async``); the YAML key is ``async``."""

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if self.task.answer_format == "letter" and self.rollout.max_output_tokens != 1:
            raise ValueError(
                "task.answer_format='letter' grades the whole answer as one letter: "
                f"set rollout.max_output_tokens=1 (got {self.rollout.max_output_tokens})"
            )
        if self.rollout.restrict_to_options and self.task.answer_format != "letter":
            raise ValueError("rollout.restrict_to_options needs task.answer_format='letter'")
        if self.async_.buffer_groups < self.rollout.prompts_per_step:
            raise ValueError(
                f"async.buffer_groups={self.async_.buffer_groups} cannot hold one step's "
                f"rollout.prompts_per_step={self.rollout.prompts_per_step} groups"
            )
        return self

    def policy_config(self) -> PolicyConfig:
        """The Megatron policy's settings for this recipe (logprobs at temperature 1.0, the
        temperature vLLM's raw logprobs are reported at)."""
        from rl_bridge.megatron.policy import PolicyConfig

        return PolicyConfig(
            learning_rate=self.train.learning_rate,
            weight_decay=self.train.weight_decay,
            micro_batch_size=self.train.micro_batch_size,
            temperature=1.0,
        )


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` with each ``dotted.key=value`` override set (value parsed as YAML).

    Raises:
        ValueError: an override without ``=`` or with an empty key, or one that descends into a
            value that is not a mapping.
    """
    out: dict[str, Any] = _deep_copy(data)
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key.strip() or any(not part for part in key.split(".")):
            raise ValueError(f"override {override!r} is not of the form dotted.key=value")
        *parents, leaf = key.strip().split(".")
        node = out
        for depth, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parents[: depth + 1])
                raise ValueError(f"override {override!r}: {where} is {child!r}, not a section")
            node = child
        node[leaf] = yaml.safe_load(raw)
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def load_recipe(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Recipe:
    """The recipe in YAML file ``path`` (``None``: the defaults) with ``overrides`` applied.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a YAML mapping, or an override is malformed.
        pydantic.ValidationError: an unknown key or an invalid value (the message names its location).
    """
    data: Any = {}
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"recipe {path}: the top level must be a mapping, got {type(data).__name__}")
    return Recipe.model_validate(apply_overrides(data, overrides))
