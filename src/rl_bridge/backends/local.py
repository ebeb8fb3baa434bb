"""A run's roles on this host: each vLLM replica as a subprocess pinned to its GPUs
(``CUDA_VISIBLE_DEVICES``), the Gym servers as subprocesses with one model server over every
replica (Gym's ``base_url`` list: each session sticks to one replica), and the policy in this
process when it has one rank, else one process per rank
(:class:`rl_bridge.backends.policy_ranks.LocalPolicyRanks`, gloo on CPU). How many of each role run,
and on which devices, is the run's plan (:func:`rl_bridge.placement.plan_placement`) for this host.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING

from rl_bridge.backends.handles import PolicyHandle, Roles, placement_summary
from rl_bridge.backends.vllm_servers import replica_server, vllm_config
from rl_bridge.grpo import needs_reference
from rl_bridge.services.supervisor import RestartPolicy, ServiceSupervisor

if TYPE_CHECKING:
    from rl_bridge.placement import Plan
    from rl_bridge.recipe import Recipe
    from rl_bridge.tasks import TaskData

__all__ = ["start_local_roles"]

logger = logging.getLogger(__name__)


def start_local_roles(recipe: Recipe, data: TaskData, stack: ExitStack) -> Roles:
    """Start the run's plan on this host (see the module docstring); ``stack`` stops it all.

    vLLM loads while the Gym servers and the policy start (they need its URLs, not its answers):
    the run waits for the slowest of them rather than for their sum. Colocated on GPUs, the policy
    starts once vLLM is up, so that vLLM's memory profiling sees only its own allocations.

    Raises:
        rl_bridge.placement.PlacementError: the plan does not fit this host.
        rl_bridge.services.process.ServiceError: a server did not start.
    """
    from rl_bridge.paths import gym_search_roots
    from rl_bridge.placement import Hardware, plan_placement
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
    specs, agents = data.gym_specs(
        recipe, openai_url=openai_urls if several else openai_urls[0], model_name=servers[0].model_name
    )
    gym = stack.enter_context(
        start_gym_servers(
            specs, run_dir=run_dir / "logs" / "gym", extra_roots=gym_search_roots(), timeout_s=600
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
        agent_url=tuple(gym.url(agent) for agent in agents),
        policy=policy,
        reference=reference,
        vllm_supervisor=supervisor,
        placement=placement_summary(plan, "local"),
    )


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
