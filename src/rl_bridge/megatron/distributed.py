"""torch.distributed and Megatron's parallel state for one process per rank, as torchrun starts them.

:func:`model_parallel_group` is what a policy worker enters before it builds
:class:`~rl_bridge.megatron.policy.MegatronPolicy`::

    # torchrun --nproc-per-node 2 -m my_trainer     (or: python -m torch.distributed.run ...)
    with cpu_execution(), model_parallel_group(tensor_parallel=2, seed=0) as layout:
        policy = MegatronPolicy(hf_dir)

It reads the rendezvous that torchrun exports (:class:`RankEnvironment`), initialises the default
process group (NCCL with CUDA, gloo without), binds the process to GPU ``LOCAL_RANK``, sets up
megatron-core's parallel state with the requested tensor- and pipeline-parallel sizes
(data-parallel size = world size / (tensor x pipeline); no context parallelism) and seeds Megatron's
model-parallel CUDA RNG tracker. Everything is torn down on exit.
:func:`.cpu_support.single_process_group` is the world-size-1 case of the same function, for
code that runs without a launcher (tests, the embedded CPU demo).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ParallelLayout", "RankEnvironment", "from_last_stage", "model_parallel_group"]

_BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class RankEnvironment:
    """Where this process sits in the job and how the ranks meet (torchrun's environment variables)."""

    rank: int
    """Global rank, ``RANK``."""
    world_size: int
    """Number of processes in the job, ``WORLD_SIZE``."""
    local_rank: int
    """Rank on this host, ``LOCAL_RANK``: the GPU index the process uses."""
    master_addr: str | None
    """Host of the TCP store the ranks meet in, ``MASTER_ADDR``; ``None`` for a single process,
    which needs no rendezvous (an in-process store)."""
    master_port: int | None
    """Port of that TCP store, ``MASTER_PORT``; ``None`` exactly when ``master_addr`` is."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size or self.local_rank < 0:
            raise ValueError(
                f"RankEnvironment: rank {self.rank} is not in [0, world size {self.world_size}) "
                f"or local rank {self.local_rank} is negative"
            )
        if (self.master_addr is None) != (self.master_port is None):
            raise ValueError("RankEnvironment: master_addr and master_port must be both set or both None")
        if self.master_addr is None and self.world_size != 1:
            raise ValueError(
                f"RankEnvironment: world size {self.world_size} needs master_addr and master_port"
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"RankEnvironment: master_port {self.master_port} is not in [1, 65535]")

    @classmethod
    def single_process(cls) -> RankEnvironment:
        """Rank 0 of 1 on local GPU 0 (when there is one), without a rendezvous."""
        return cls(rank=0, world_size=1, local_rank=0, master_addr=None, master_port=None)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RankEnvironment:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.

        Args:
            environ: the variables; ``None`` means ``os.environ``.

        Raises:
            RuntimeError: a variable is missing (the process was not started by torchrun).
            ValueError: a variable is not an integer where one is needed, or the values are
                inconsistent.
        """
        environ = os.environ if environ is None else environ
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        missing = [name for name in names if name not in environ]
        if missing:
            raise RuntimeError(
                f"RankEnvironment: {', '.join(missing)} not set; start the process with torchrun "
                "(python -m torch.distributed.run --nproc-per-node N ...)"
            )
        integers = {}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            try:
                integers[name] = int(environ[name])
            except ValueError:
                raise ValueError(f"RankEnvironment: {name}={environ[name]!r} is not an integer") from None
        return cls(
            rank=integers["RANK"],
            world_size=integers["WORLD_SIZE"],
            local_rank=integers["LOCAL_RANK"],
            master_addr=environ["MASTER_ADDR"],
            master_port=integers["MASTER_PORT"],
        )


@dataclass(frozen=True)
class ParallelLayout:
    """The layout :func:`model_parallel_group` set up, as seen from this rank."""

    rank: int
    world_size: int
    tensor_parallel: int
    """Tensor-parallel size: ranks that share each layer of one model replica."""
    data_parallel: int
    """Data-parallel size: model replicas, ``world_size // (tensor_parallel * pipeline_parallel)``."""
    tensor_parallel_rank: int
    data_parallel_rank: int
    device: torch.device
    """Where this rank's model lives: ``cuda:LOCAL_RANK`` with CUDA, else ``cpu``."""
    backend: str
    pipeline_parallel: int = 1
    """Pipeline-parallel size: stages (consecutive layer ranges) of one model replica."""
    pipeline_parallel_rank: int = 0


@contextmanager
def model_parallel_group(
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    seed: int = 0,
    backend: str | None = None,
    environment: RankEnvironment | None = None,
) -> Iterator[ParallelLayout]:
    """torch.distributed plus Megatron's parallel state for the duration of the block.

    Args:
        tensor_parallel: tensor-parallel size; must divide the world size. Consecutive global
            ranks form a tensor-parallel group (megatron-core's default order), so with one
            process per GPU a model replica stays on one host.
        pipeline_parallel: pipeline-parallel size; ``tensor_parallel * pipeline_parallel`` must
            divide the world size. Stage ``p`` of data-parallel replica ``d`` is the
            tensor-parallel group of ranks ``tp + TP * (d + DP * p)`` (megatron-core's order).
        seed: seed of Megatron's model-parallel CUDA RNG tracker (dropout and initialisation
            inside tensor-parallel regions), set with ``model_parallel_cuda_manual_seed``; used
            only when CUDA is available (on CPU :func:`.cpu_support.cpu_execution` installs the
            no-op tracker, so dropout draws from torch's CPU generator). Torch's default
            generators are not touched.
        backend: ``"nccl"`` or ``"gloo"``; ``None`` picks NCCL when CUDA is available, else gloo.
        environment: this process's place in the job; ``None`` reads torchrun's variables
            (:meth:`RankEnvironment.from_environ`). :meth:`RankEnvironment.single_process` runs
            world size 1 without a launcher, also inside a torchrun worker (after that worker's
            own group is gone).

    Yields:
        This rank's :class:`ParallelLayout`.

    On exit the parallel state and the process group are destroyed, also after an exception.

    Raises:
        RuntimeError: torch.distributed is already initialised in this process, the torchrun
            variables are missing, or ``LOCAL_RANK`` names a GPU this host does not have.
        ValueError: ``tensor_parallel * pipeline_parallel`` does not divide the world size, or an
            unknown backend.
    """
    if torch.distributed.is_initialized():
        raise RuntimeError(
            "model_parallel_group: torch.distributed is already initialised in this process "
            f"(backend {torch.distributed.get_backend()}, world size {torch.distributed.get_world_size()})"
        )
    env = RankEnvironment.from_environ() if environment is None else environment
    if tensor_parallel < 1 or pipeline_parallel < 1 or env.world_size % (tensor_parallel * pipeline_parallel):
        raise ValueError(
            f"model_parallel_group: tensor_parallel={tensor_parallel} "
            f"x pipeline_parallel={pipeline_parallel} "
            f"does not divide the world size {env.world_size}"
        )
    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend not in _BACKENDS:
        raise ValueError(f"model_parallel_group: backend={backend!r}; expected one of {_BACKENDS}")
    if backend == "nccl" and not use_cuda:
        raise ValueError("model_parallel_group: backend='nccl' needs CUDA, which is not available")
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mcore_tensor_parallel

    if use_cuda:
        if env.local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"model_parallel_group: LOCAL_RANK={env.local_rank}, but this host has "
                f"{torch.cuda.device_count()} GPU(s)"
            )
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    if env.master_addr is None:
        # An in-process store: nothing to meet, and no port that a torchrun agent's
        # TORCHELASTIC_USE_AGENT_STORE would make this process wait for as a client.
        torch.distributed.init_process_group(
            backend=backend, store=torch.distributed.HashStore(), rank=0, world_size=1
        )
    else:
        torch.distributed.init_process_group(
            backend=backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
        )
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel
        )
        if use_cuda:
            mcore_tensor_parallel.model_parallel_cuda_manual_seed(seed)
        yield ParallelLayout(
            rank=env.rank,
            world_size=env.world_size,
            tensor_parallel=tensor_parallel,
            data_parallel=env.world_size // (tensor_parallel * pipeline_parallel),
            tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
            data_parallel_rank=parallel_state.get_data_parallel_rank(),
            device=device,
            backend=backend,
            pipeline_parallel=pipeline_parallel,
            pipeline_parallel_rank=parallel_state.get_pipeline_model_parallel_rank(),
        )
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def from_last_stage(reported: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the last pipeline stage's loss functions reported, on every stage of the pipeline (the
    schedule calls them on the last stage only and returns nothing elsewhere)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return reported
    box: list[Any] = [reported if parallel_state.is_pipeline_last_stage() else None]
    torch.distributed.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]
