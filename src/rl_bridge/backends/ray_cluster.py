"""A run's roles as Ray actors: the vLLM servers, the Gym servers and the Megatron policy ranks.

:func:`start_ray_roles` is the ``cluster.backend="ray"`` branch of
:func:`rl_bridge.backends.launch.start_roles`. It connects to ``cluster.ray_address`` (or starts a
local Ray instance), plans the run against the cluster's nodes, GPUs and GPU memory
(:func:`rl_bridge.backends.ray_hardware.ray_cluster_hardware`,
:func:`rl_bridge.placement.plan_placement`: the same replica and rank counts and parallel groups as
the local backend, refused before any actor starts when it does not fit) and creates the plan's
actors, each placed by its :class:`~rl_bridge.recipe.RolePlacement` (logical CPUs, custom resources,
a node id; Ray picks the nodes and GPUs, so the plan's devices are not used):

* one :class:`VLLMServerActor` per vLLM replica starts a server
  (:func:`rl_bridge.backends.vllm_servers.vllm_config`) as a child process of the actor, with the
  replica's GPUs (Ray ``num_gpus`` = its TP size);
* :class:`GymServersActor` starts the task's Gym servers (model server over every replica,
  resources server, agent);
* one :class:`PolicyWorkerActor` per policy rank (one GPU each on a GPU recipe) holds one
  Megatron rank of the policy (and of the reference policy, when the loss needs one), joined by
  torch.distributed (:func:`rl_bridge.megatron.distributed.model_parallel_group`; rank 0's node
  hosts the rendezvous). The driver's handle is :class:`rl_bridge.backends.policy_ranks.RankedPolicy`
  over :func:`ray_transport`: it splits a batch over the data-parallel ranks, so each sample goes
  only to the ranks that train it.

Ray restarts nothing: a vLLM server that dies ends the run (the local backend supervises and
restarts its servers).

Services bind loopback when every client is on their node; a service with a client on another node
binds all interfaces and is addressed by its node's IP (the vLLM server's dev-mode endpoints are
then open to the cluster network). The server processes are watched by a small guardian process
that kills their process groups when the actor's process is gone, however it ended, so no server
outlives its actor. Every call into an actor that fails raises in the driver with the role's
name added as a note (the exception keeps its type, e.g. ``ServiceError``).

The actors read the model directory and the media root, and write logs under the run directory,
by the driver's paths: on several hosts these must be on a shared file system (docs/RAY.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_bridge.backends import policy_ranks
from rl_bridge.backends.handles import Roles, placement_summary
from rl_bridge.backends.vllm_servers import vllm_config
from rl_bridge.grpo import needs_reference

if TYPE_CHECKING:
    import ray

    from rl_bridge.recipe import ClusterSection, ModelSection, Recipe, RolePlacement
    from rl_bridge.services.gym_server import GymServerSpec
    from rl_bridge.services.vllm_server import VLLMServerConfig
    from rl_bridge.tasks import TaskData

__all__ = [
    "GymServersActor",
    "PolicyWorkerActor",
    "VLLMServerActor",
    "guard_process_groups",
    "ray_transport",
    "start_ray_roles",
]

logger = logging.getLogger(__name__)

#: Driver environment variables every actor gets too (offline mode must hold on every node).
FORWARDED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
#: Bind address of a service that clients on other nodes reach.
ALL_INTERFACES = "0.0.0.0"
#: Seconds an actor gets to stop its servers before it is killed.
STOP_TIMEOUT_S = 60.0
#: File under ``<run_dir>/logs`` describing where each role ran (node, process ids, URLs).
PLACEMENT_FILE = "ray_roles.json"

# The guardian: runs with `python -I -c`, argv = owner pid, process group ids. While its parent
# (the owner) lives and a group has members it sleeps; once the owner is gone it SIGTERMs the
# groups, waits up to 10 s, then SIGKILLs what is left. It exits when the groups are gone.
_GUARDIAN = """
import os, signal, sys, time
owner, groups = int(sys.argv[1]), [int(g) for g in sys.argv[2:]]
def alive(group):
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
while os.getppid() == owner and any(map(alive, groups)):
    time.sleep(0.5)
for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
    for group in filter(alive, groups):
        os.killpg(group, sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(map(alive, groups)):
        time.sleep(0.2)
"""


def guard_process_groups(groups: Sequence[int]) -> subprocess.Popen[bytes]:
    """Start a guardian that kills the process groups ``groups`` once this process is gone.

    The guardian runs in its own session (so whatever kills this process's group spares it), polls
    twice a second, and exits by itself when every group is empty. Terminate it after stopping the
    groups normally.
    """
    return subprocess.Popen(
        [sys.executable, "-I", "-c", _GUARDIAN, str(os.getpid()), *map(str, groups)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _node_info() -> dict[str, Any]:
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
    }


def _advertised(url: str, host: str) -> str:
    """``url`` (``http://127.0.0.1:PORT...``) with its host replaced by ``host``."""
    scheme, _, rest = url.partition("://")
    _, _, port_and_path = rest.partition(":")
    return f"{scheme}://{host}:{port_and_path}"


# -- actors (plain classes, wrapped with ray.remote by start_ray_roles) --------------------------------


class VLLMServerActor:
    """Holds the run's vLLM server, a child process of this actor."""

    def __init__(self) -> None:
        self._server: Any = None
        self._guardian: subprocess.Popen[bytes] | None = None

    def node_info(self) -> dict[str, Any]:
        """This actor's Ray node id, node IP and process id."""
        return _node_info()

    def start(self, config: VLLMServerConfig, log_dir: str, *, expose: bool) -> dict[str, Any]:
        """Start the server and wait until it is healthy.

        Args:
            config: the server's options.
            log_dir: directory of ``vllm.log`` on this actor's node.
            expose: bind all interfaces and advertise this node's IP (a client is on another node);
                ``False``: loopback only.

        Returns:
            ``base_url``, ``openai_url``, ``model_name``, ``server_pid`` and ``server_ppid`` (the
            parent of the server process, read from ``/proc``: this actor).
        """
        from rl_bridge.services.vllm_server import start_vllm_server

        if expose:
            config = config.model_copy(update={"extra_args": (*config.extra_args, "--host", ALL_INTERFACES)})
        self._server = start_vllm_server(config, log_dir=log_dir)
        self._guardian = guard_process_groups([self._server.process.pid])
        base_url = self._server.base_url
        if expose:
            base_url = _advertised(base_url, _node_info()["node_ip"])
        return {
            "base_url": base_url,
            "openai_url": f"{base_url}/v1",
            "model_name": self._server.model_name,
            "server_pid": self._server.process.pid,
            "server_ppid": _parent_pid(self._server.process.pid),
        }

    def stop(self) -> None:
        """Stop the server and its guardian (safe to call more than once)."""
        if self._server is not None:
            self._server.stop()
        if self._guardian is not None:
            self._guardian.terminate()
            self._guardian.wait()


class GymServersActor:
    """Holds the task's Gym servers, child processes of this actor."""

    def __init__(self) -> None:
        self._servers: Any = None
        self._guardian: subprocess.Popen[bytes] | None = None

    def node_info(self) -> dict[str, Any]:
        """This actor's Ray node id, node IP and process id."""
        return _node_info()

    def start(
        self,
        specs: list[GymServerSpec],
        agents: tuple[str, ...],
        run_dir: str,
        extra_roots: list[str],
        *,
        expose: bool,
    ) -> dict[str, Any]:
        """Start the servers of ``specs`` and return the agents' URLs and the server process ids.

        Args:
            expose: bind every server to this node's IP (the driver is on another node);
                ``False``: loopback.
        """
        from rl_bridge.services.gym_server import start_gym_servers

        if expose:
            host = _node_info()["node_ip"]
            specs = [dataclasses.replace(s, fields={**s.fields, "host": host}) for s in specs]
        self._servers = start_gym_servers(
            specs, run_dir=Path(run_dir), extra_roots=[Path(r) for r in extra_roots], timeout_s=600
        )
        pids = {name: process.pid for name, process in self._servers.processes.items()}
        self._guardian = guard_process_groups(list(pids.values()))
        return {"agent_url": [self._servers.url(agent) for agent in agents], "server_pids": pids}

    def stop(self) -> None:
        """Stop the servers and their guardian (safe to call more than once)."""
        if self._servers is not None:
            self._servers.stop()
        if self._guardian is not None:
            self._guardian.terminate()
            self._guardian.wait()


class PolicyWorkerActor(policy_ranks.PolicyWorker):
    """One Megatron rank (:class:`rl_bridge.backends.policy_ranks.PolicyWorker`) as a Ray actor."""

    def node_info(self) -> dict[str, Any]:
        """This actor's Ray node id, node IP and process id."""
        return _node_info()

    def rendezvous_port(self) -> int:
        """A free TCP port on this node's IP, for rank 0's torch.distributed store."""
        from rl_bridge.services.process import free_port

        return free_port(_node_info()["node_ip"])


# -- the driver's side ------------------------------------------------------------------------------


def _gather(calls: Sequence[tuple[str, ray.ObjectRef]], *, timeout_s: float | None = None) -> list[Any]:
    """The results of ``(role, ref)`` calls, in order; the first failure is raised at once, with a
    note naming its role.

    Raises:
        TimeoutError: ``timeout_s`` seconds passed before every call returned (the message names
            the roles still running).
    """
    import ray

    roles = {ref: role for role, ref in calls}
    pending = list(roles)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not ready:
            waiting = ", ".join(roles[ref] for ref in pending)
            raise TimeoutError(f"Ray roles did not answer within {timeout_s:.0f} s: {waiting}")
        _get(roles[ready[0]], ready[0])
    return [_get(role, ref) for role, ref in calls]


def _get(role: str, ref: ray.ObjectRef) -> Any:
    import ray

    try:
        return ray.get(ref)
    except Exception as exc:
        exc.add_note(f"raised in Ray role {role!r}")
        raise


def ray_transport(workers: Sequence[ray.actor.ActorHandle]) -> policy_ranks.Transport:
    """The :data:`~rl_bridge.backends.policy_ranks.Transport` of :class:`PolicyWorkerActor` actors (in
    rank order): each rank's call as a Ray task, the first failure raised with its rank named."""

    def call_all(
        which: str, method: str, per_rank_args: Sequence[tuple[Any, ...]], kwargs: dict[str, Any]
    ) -> list[Any]:
        return _gather(
            [
                (f"{which}[rank {rank}]", worker.call.remote(which, method, *args, **kwargs))
                for rank, (worker, args) in enumerate(zip(workers, per_rank_args, strict=True))
            ]
        )

    return call_all


def _actor_options(
    placement: RolePlacement, *, num_gpus: float, env: dict[str, str], name: str
) -> dict[str, Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {
        "num_cpus": placement.num_cpus,
        "num_gpus": num_gpus,
        "resources": dict(placement.resources),
        "runtime_env": {"env_vars": env},
        "max_restarts": 0,
        "name": name,
    }
    if placement.node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(placement.node_id, soft=False)
    return options


def _local_cpus(cluster: ClusterSection, model: ModelSection) -> int:
    """Logical CPUs a local Ray instance needs to place every role of the run (at least 1)."""
    wanted = (
        model.vllm_replicas * cluster.vllm.num_cpus
        + cluster.gym.num_cpus
        + model.policy_ranks * cluster.policy.num_cpus
    )
    return max(1, math.ceil(wanted))


def _connect(cluster: ClusterSection, model: ModelSection, run_dir: Path, stack: ExitStack) -> None:
    """Connect to ``cluster.ray_address`` or start a local Ray instance, unless Ray is initialised
    already; what this function started or connected is shut down by ``stack``."""
    import ray

    if ray.is_initialized():
        return
    common: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,
        "logging_level": logging.WARNING,
    }
    if cluster.ray_address is not None:
        ray.init(address=cluster.ray_address, **common)
        stack.callback(ray.shutdown)
        return
    on_gpus = model.num_gpus > 0
    context = ray.init(num_cpus=_local_cpus(cluster, model), num_gpus=None if on_gpus else 0, **common)
    stack.callback(ray.shutdown)
    logs = run_dir / "logs" / "ray"
    logs.parent.mkdir(parents=True, exist_ok=True)
    logs.unlink(missing_ok=True)
    logs.symlink_to(Path(context.address_info["session_dir"]) / "logs", target_is_directory=True)


def _stop_actor(role: str, actor: ray.actor.ActorHandle) -> None:
    """Ask ``actor`` to stop its servers, then kill it (also when stopping failed or timed out)."""
    import ray

    try:
        ray.get(actor.stop.remote(), timeout=STOP_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - teardown goes on; the guardian reaps the servers
        logger.warning("Ray role %r did not stop cleanly (%s); killing it", role, exc)
    ray.kill(actor, no_restart=True)


def start_ray_roles(recipe: Recipe, data: TaskData, stack: ExitStack) -> Roles:
    """Start the roles of ``recipe``'s plan as Ray actors (see the module docstring); ``stack``
    stops them.

    Where each role ran is written to ``<run_dir>/logs/ray_roles.json``.

    Raises:
        rl_bridge.placement.PlacementError: the recipe's parallel sizes do not fit its model, or the
            run does not fit the cluster's GPUs or their memory.
        TimeoutError: an actor was not placed and started within ``cluster.actor_start_timeout_s``
            (the message names the roles and the cluster's free resources).
        rl_bridge.services.process.ServiceError: a server did not start (noted with its role).
    """
    import ray

    from rl_bridge.backends.ray_hardware import ray_cluster_hardware
    from rl_bridge.megatron.distributed import RankEnvironment
    from rl_bridge.paths import gym_search_roots
    from rl_bridge.placement import plan_placement

    cluster = recipe.cluster
    run_dir = recipe.run_dir.resolve()
    _connect(cluster, recipe.model, run_dir, stack)
    hardware = ray_cluster_hardware(timeout_s=cluster.actor_start_timeout_s)
    plan = plan_placement(recipe, hardware)
    env = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
    on_gpus = plan.placement != "cpu"
    job = ray.get_runtime_context().get_job_id()

    def create(cls: type, role: str, placement: RolePlacement, num_gpus: float) -> ray.actor.ActorHandle:
        actor = (
            ray.remote(cls)
            .options(**_actor_options(placement, num_gpus=num_gpus, env=env, name=f"{role}-{job}"))
            .remote()
        )
        stack.callback(_stop_actor, role, actor)
        return actor

    several = len(plan.vllm) > 1
    replicas = [f"vllm[{r.index}]" if several else "vllm" for r in plan.vllm]
    vllms = [
        create(VLLMServerActor, role, cluster.vllm, float(len(replica.devices)))
        for role, replica in zip(replicas, plan.vllm, strict=True)
    ]
    gym = create(GymServersActor, "gym", cluster.gym, 0.0)
    ranks = [f"policy[rank {rank.rank}]" for rank in plan.policy]
    workers = [create(PolicyWorkerActor, role, cluster.policy, 1.0 if on_gpus else 0.0) for role in ranks]
    actors = dict(zip([*replicas, "gym", *ranks], [*vllms, gym, *workers], strict=True))
    try:
        infos = _gather(
            [(role, actor.node_info.remote()) for role, actor in actors.items()],
            timeout_s=cluster.actor_start_timeout_s,
        )
        nodes = dict(zip(actors, infos, strict=True))
    except TimeoutError as exc:
        exc.add_note(f"free Ray resources: {ray.available_resources()}")
        raise
    driver_node = ray.get_runtime_context().get_node_id()

    # Rendezvous of the policy workers: rank 0's node, a port free there.
    master_port = _gather([(ranks[0], workers[0].rendezvous_port.remote())])[0]
    with_reference = needs_reference(recipe.train.loss)
    setup = [
        (
            role,
            worker.setup.remote(
                RankEnvironment(
                    rank=rank,
                    world_size=len(workers),
                    local_rank=0,  # Ray shows an actor only its own GPU
                    master_addr=nodes[ranks[0]]["node_ip"],
                    master_port=master_port,
                ),
                tensor_parallel=plan.tensor_parallel,
                pipeline_parallel=plan.pipeline_parallel,
                seed=recipe.seed,
                model_dir=str(data.model_dir),
                config=recipe.policy_config(data.token_support(recipe)),
                with_reference=with_reference,
            ),
        )
        for rank, (role, worker) in enumerate(zip(ranks, workers, strict=True))
    ]
    config = vllm_config(recipe, data)
    vllm_refs = [
        (
            role,
            actor.start.remote(
                config,
                str(run_dir / "logs" / role.replace("[", "-").rstrip("]")),
                expose=nodes[role]["node_id"] not in {driver_node, nodes["gym"]["node_id"]},
            ),
        )
        for role, actor in zip(replicas, vllms, strict=True)
    ]
    served = _gather(vllm_refs)
    openai_urls = [replica["openai_url"] for replica in served]
    specs, agents = data.gym_specs(
        recipe, openai_url=openai_urls if several else openai_urls[0], model_name=served[0]["model_name"]
    )
    gym_ref = gym.start.remote(
        specs,
        agents,
        str(run_dir / "logs" / "gym"),
        [str(root) for root in gym_search_roots()],
        expose=nodes["gym"]["node_id"] != driver_node,
    )
    gym_started, *layouts = _gather([("gym", gym_ref), *setup])

    placement = {
        "driver": {"node_id": driver_node, "pid": os.getpid()},
        "hardware": hardware.describe(),
        "roles": nodes,
        "vllm": served if several else served[0],
        "gym": gym_started,
        "policy_layouts": [dataclasses.asdict(layout) | {"device": str(layout.device)} for layout in layouts],
    }
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs" / PLACEMENT_FILE).write_text(json.dumps(placement, indent=2))
    transport = ray_transport(workers)
    return Roles(
        vllm_base_urls=tuple(replica["base_url"] for replica in served),
        agent_url=tuple(gym_started["agent_url"]),
        policy=policy_ranks.RankedPolicy("policy", transport, layouts),
        reference=policy_ranks.RankedPolicy("reference", transport, layouts) if with_reference else None,
        placement=placement_summary(plan, "ray"),
    )


def _parent_pid(pid: int) -> int:
    """The parent process id of ``pid`` (Linux ``/proc``)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])
