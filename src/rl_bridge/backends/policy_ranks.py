"""The policy as one process per Megatron rank, and the driver's handle over the ranks.

A run's placement (:func:`rl_bridge.placement.plan_placement`) gives the policy ``TP x PP x DP``
ranks. With one rank the local backend builds :class:`~rl_bridge.megatron.policy.MegatronPolicy`
in the controller's process. With more, every rank is a :class:`PolicyWorker` in a process of its
own, joined by torch.distributed (gloo on CPU, NCCL on GPUs, each rank on the GPU its plan gives
it), and the controller drives them through :class:`RankedPolicy`:

* the local backend starts the workers as child processes (:class:`LocalPolicyRanks`);
* the Ray backend starts them as actors (:mod:`rl_bridge.backends.ray_cluster`).

Both hand :class:`RankedPolicy` a *transport*: a function that calls one method on every rank,
each rank with its own arguments, and returns the results in rank order. Megatron's methods are
collective, so every call goes to every rank. A batch is split over the data-parallel replicas
(:func:`split_for_data_parallel`): each sample goes only to the ranks of the replica that trains
it (its tensor- and pipeline-parallel ranks all need it). Logprobs come back from each replica's
first rank, in batch order (the last pipeline stage computes them and hands them to the others).

A local rank that raises fails the call at once, with the rank named in a note; one that dies
(its pipe closes) fails it with its exit code. Either way the run is over: the other ranks may be
waiting in a collective, so teardown kills what does not stop within a few seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_bridge.megatron.batch import PolicySample
    from rl_bridge.megatron.distributed import ParallelLayout, RankEnvironment
    from rl_bridge.megatron.policy import PolicyConfig
    from rl_bridge.megatron.policy_loss import PolicyLoss, TrainStepMetrics
    from rl_bridge.placement import PolicyRank

__all__ = [
    "LocalPolicyRanks",
    "PolicyWorker",
    "RankedPolicy",
    "Transport",
    "rank_environment",
    "split_for_data_parallel",
]

logger = logging.getLogger(__name__)

Transport = Callable[[str, str, Sequence[tuple[Any, ...]], dict[str, Any]], list[Any]]
"""``transport(which, method, per_rank_args, kwargs)``: ``getattr(policies[which], method)(*args,
**kwargs)`` on every rank (rank ``r`` with ``per_rank_args[r]``), the results in rank order."""

#: Seconds a local rank gets to leave its process group and exit before it is killed.
STOP_TIMEOUT_S = 30.0


class PolicyWorker:
    """One Megatron rank: the policy (and the frozen reference policy) in a torch.distributed group.

    Without CUDA every call runs inside :func:`rl_bridge.megatron.cpu_support.cpu_execution`.
    """

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._policies: dict[str, Any] = {}

    def setup(
        self,
        environment: RankEnvironment,
        *,
        tensor_parallel: int,
        seed: int,
        model_dir: str,
        config: PolicyConfig,
        with_reference: bool,
        pipeline_parallel: int = 1,
    ) -> ParallelLayout:
        """Join the process group of ``environment`` and build the policy (and the reference).

        Collective: every worker of the group must be in this call at the same time.
        """
        from rl_bridge.megatron.cpu_support import cpu_execution
        from rl_bridge.megatron.distributed import model_parallel_group
        from rl_bridge.megatron.policy import MegatronPolicy

        with cpu_execution():
            layout = self._stack.enter_context(
                model_parallel_group(
                    tensor_parallel=tensor_parallel,
                    pipeline_parallel=pipeline_parallel,
                    seed=seed,
                    environment=environment,
                )
            )
            self._policies["policy"] = MegatronPolicy(model_dir, config)
            if with_reference:
                self._policies["reference"] = MegatronPolicy(
                    model_dir, dataclasses.replace(config, trainable=False)
                )
        return layout

    def policy(self, which: str) -> Any:
        """The :class:`~rl_bridge.megatron.policy.MegatronPolicy` ``which`` (``"policy"`` or
        ``"reference"``), for a caller in this process that keeps
        :func:`~rl_bridge.megatron.cpu_support.cpu_execution` entered itself."""
        return self._policies[which]

    def call(self, which: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``getattr(policy, method)(*args, **kwargs)`` on the policy ``which`` (``"policy"`` or
        ``"reference"``)."""
        from rl_bridge.megatron.cpu_support import cpu_execution

        with cpu_execution():
            return getattr(self._policies[which], method)(*args, **kwargs)

    def stop(self) -> None:
        """Drop the policies and leave the process group (safe to call more than once)."""
        self._policies.clear()
        self._stack.close()


def split_for_data_parallel(batch: Sequence[PolicySample], size: int) -> list[list[PolicySample]]:
    """``batch`` in ``size`` contiguous shares whose lengths differ by at most one.

    A share that would be empty (``len(batch) < size``) holds a copy of ``batch[0]`` with zero loss
    weight: it adds nothing to the loss, and its logprobs are dropped by the caller; a
    data-parallel rank cannot skip a collective step.

    Raises:
        ValueError: ``batch`` is empty or ``size < 1``.
    """
    if not batch or size < 1:
        raise ValueError(
            f"split_for_data_parallel: need a non-empty batch and size >= 1, got {len(batch)} samples, "
            f"size {size}"
        )
    base, extra = divmod(len(batch), size)
    shares: list[list[PolicySample]] = []
    start = 0
    for rank in range(size):
        end = start + base + (rank < extra)
        shares.append(list(batch[start:end]) or [dataclasses.replace(batch[0], loss_weight=0.0)])
        start = end
    return shares


class RankedPolicy:
    """The :class:`~rl_bridge.backends.handles.PolicyHandle` of a policy held by :class:`PolicyWorker` ranks.

    Every call goes to every rank through ``transport``. :meth:`train_step` returns rank 0's
    metrics (already reduced over the data-parallel ranks; ``num_samples`` and token counts include
    the zero-weight fillers of shares that would be empty). Paths are passed as they are: they must
    mean the same on every rank's node.
    """

    def __init__(self, which: str, transport: Transport, layouts: Sequence[ParallelLayout]) -> None:
        self._which = which
        self._transport = transport
        self._layouts = list(layouts)
        self.data_parallel = layouts[0].data_parallel
        self.tensor_parallel = layouts[0].tensor_parallel

    def _call_all(self, method: str, per_rank_args: Sequence[tuple[Any, ...]], **kwargs: Any) -> list[Any]:
        return self._transport(self._which, method, per_rank_args, kwargs)

    def _same(self, *args: Any) -> list[tuple[Any, ...]]:
        return [args] * len(self._layouts)

    def _in_batch_order(
        self, shares: Sequence[Sequence[Any]], per_rank: Sequence[list[Any]], total: int
    ) -> list[Any]:
        """Per-sample results of each replica's first rank (tensor- and pipeline-parallel rank 0;
        every rank of a replica returns the same), in batch order (the zero-weight fillers of empty
        shares dropped)."""
        by_replica = {
            layout.data_parallel_rank: result
            for layout, result in zip(self._layouts, per_rank, strict=True)
            if layout.tensor_parallel_rank == 0 and layout.pipeline_parallel_rank == 0
        }
        out: list[Any] = []
        remaining = total
        for rank in range(self.data_parallel):
            taken = by_replica[rank][: min(len(shares[rank]), remaining)]
            out.extend(taken)
            remaining -= len(taken)
        return out

    def logprobs(self, batch: Sequence[PolicySample]) -> list[Any]:
        """Per-token logprobs of every sample (see :meth:`MegatronPolicy.logprobs`), in batch order."""
        shares = split_for_data_parallel(batch, self.data_parallel)
        per_rank = [(shares[layout.data_parallel_rank],) for layout in self._layouts]
        results = self._call_all("logprobs", per_rank)
        return self._in_batch_order(shares, results, len(batch))

    def train_step(
        self, batch: Sequence[PolicySample], loss_fn: PolicyLoss, *, return_logprobs: bool = False
    ) -> TrainStepMetrics:
        """One optimizer step on ``batch`` over all ranks (see :meth:`MegatronPolicy.train_step`);
        with ``return_logprobs`` the forward's logprobs of every sample, in batch order."""
        shares = split_for_data_parallel(batch, self.data_parallel)
        results = self._call_all(
            "train_step",
            [(shares[layout.data_parallel_rank], loss_fn) for layout in self._layouts],
            return_logprobs=return_logprobs,
        )
        if not return_logprobs:
            return results[0]
        logprobs = self._in_batch_order(shares, [r.logprobs for r in results], len(batch))
        return dataclasses.replace(results[0], logprobs=logprobs)

    def save_hf_checkpoint(self, directory: str | Path) -> Path:
        """Export the weights as an HF checkpoint in ``directory`` (rank 0 writes)."""
        return self._call_all("save_hf_checkpoint", self._same(directory))[0]

    def connect_vllm(self, base_url: str, **options: Any) -> None:
        """Join the weight-transfer group of the vLLM server at ``base_url`` on every rank (rank 0
        sends; see :meth:`MegatronPolicy.connect_vllm`)."""
        self._call_all("connect_vllm", self._same(base_url), **options)

    def send_weights_to_vllm(self, base_url: str | None = None) -> dict[str, float]:
        """Stream the weights to the connected server(s) from rank 0 (every rank exports); rank 0's
        figures."""
        results = self._call_all("send_weights_to_vllm", self._same(base_url))
        return next((figures for figures in results if figures), {})

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Write the training checkpoint (every rank writes its file) and return its directory."""
        return self._call_all("save_checkpoint", self._same(directory))[0]

    def load_checkpoint(self, directory: str | Path) -> int:
        """Restore every rank from ``directory``; returns the restored step."""
        return self._call_all("load_checkpoint", self._same(directory))[0]

    def state_bytes(self) -> list[dict[str, int]]:
        """Each rank's :meth:`MegatronPolicy.state_bytes`, in rank order."""
        return self._call_all("state_bytes", self._same())

    def memory_stats(self, *, reset: bool = False) -> dict[str, float]:
        """The largest of the ranks' :meth:`MegatronPolicy.memory_stats`, figure by figure."""
        results = self._call_all("memory_stats", self._same(), reset=reset)
        return {name: max(r[name] for r in results) for name in results[0]} if results and results[0] else {}

    def release_memory(self) -> float:
        """Every rank's :meth:`MegatronPolicy.release_memory`; the GiB released, summed."""
        return sum(self._call_all("release_memory", self._same()))


# -- local ranks: one child process each -----------------------------------------------------------


def _encode(message: Any) -> bytes:
    # Plain pickle copies tensors into the message: no shared-memory file descriptor per tensor
    # (torch's reductions for multiprocessing would pass one for each of a batch's many tensors).
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _picklable_error(error: BaseException, trace: str) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - whatever it is, the rank's message still gets through
        return RuntimeError(f"{type(error).__name__}: {error}\n{trace}")
    error.add_note(trace)
    return error


def _serve_rank(
    connection: Connection, environment: RankEnvironment, setup: dict[str, Any], threads: int
) -> None:
    """A local rank's process: build the worker, then answer calls until told to stop (``None``)
    or the driver's end of the pipe closes."""
    import torch

    torch.set_num_threads(threads)
    worker = PolicyWorker()
    try:
        message: Any = ("setup", (environment,), setup)
        while message is not None:
            kind, args, kwargs = message
            try:
                result = worker.setup(*args, **kwargs) if kind == "setup" else worker.call(*args, **kwargs)
                reply = ("ok", result)
            except BaseException as error:  # noqa: BLE001 - sent to the driver, which raises it
                reply = ("error", _picklable_error(error, traceback.format_exc()))
            connection.send_bytes(_encode(reply))
            try:
                message = pickle.loads(connection.recv_bytes())
            except EOFError:
                message = None
    finally:
        worker.stop()
        connection.close()


def rank_environment(rank: PolicyRank, world_size: int, port: int) -> RankEnvironment:
    """Where a local rank of the plan joins: its global rank, the GPU the plan gives it (its
    ``LOCAL_RANK``; 0 on CPU), and the TCP store on loopback ``port``."""
    from rl_bridge.megatron.distributed import RankEnvironment

    return RankEnvironment(
        rank=rank.rank,
        world_size=world_size,
        local_rank=rank.device.gpu if rank.device is not None else 0,
        master_addr="127.0.0.1",
        master_port=port,
    )


class LocalPolicyRanks:
    """The policy's ranks as child processes of this host, started from the plan's ranks.

    Rank ``r`` runs in a process of its own (``spawn``: a fresh interpreter, no copy of the
    driver's threads or CUDA state) with ``os.cpu_count() / ranks`` CPU threads; on GPUs it binds
    the GPU the plan gives it. The ranks meet in a TCP store on loopback.

    Use as a context manager, or call :meth:`stop`.
    """

    def __init__(
        self,
        ranks: Sequence[PolicyRank],
        *,
        tensor_parallel: int,
        seed: int,
        model_dir: str | Path,
        config: PolicyConfig,
        with_reference: bool,
        pipeline_parallel: int = 1,
        start_timeout_s: float = 600.0,
    ) -> None:
        from rl_bridge.services.process import free_port

        context = multiprocessing.get_context("spawn")
        port = free_port("127.0.0.1")
        threads = max(1, (os.cpu_count() or 1) // len(ranks))
        setup = {
            "tensor_parallel": tensor_parallel,
            "pipeline_parallel": pipeline_parallel,
            "seed": seed,
            "model_dir": str(model_dir),
            "config": config,
            "with_reference": with_reference,
        }
        self._connections: list[Connection] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._broken = False
        for rank in ranks:
            environment = rank_environment(rank, len(ranks), port)
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_serve_rank,
                args=(theirs, environment, setup, threads),
                name=f"policy-rank-{rank.rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self._connections.append(ours)
            self._processes.append(process)
        try:
            self.layouts: list[ParallelLayout] = self._collect(timeout_s=start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def call(
        self, which: str, method: str, per_rank_args: Sequence[tuple[Any, ...]], kwargs: dict[str, Any]
    ) -> list[Any]:
        """The :data:`Transport` of these ranks."""
        if self._broken:
            raise RuntimeError("the policy's ranks are unusable after an earlier rank failure")
        for connection, args in zip(self._connections, per_rank_args, strict=True):
            connection.send_bytes(_encode(("call", (which, method, *args), kwargs)))
        return self._collect()

    def _collect(self, *, timeout_s: float | None = None) -> list[Any]:
        """Every rank's reply, in rank order; the first failure raises at once."""
        results: dict[int, Any] = {}
        pending = dict(enumerate(self._connections))
        while pending:
            ready = wait(list(pending.values()), timeout=timeout_s)
            if not ready:
                self._broken = True
                raise TimeoutError(f"policy ranks {sorted(pending)} did not answer within {timeout_s:.0f} s")
            for rank, connection in list(pending.items()):
                if connection not in ready:
                    continue
                del pending[rank]
                try:
                    kind, value = pickle.loads(connection.recv_bytes())
                except EOFError:
                    self._broken = True
                    process = self._processes[rank]
                    process.join(5.0)
                    raise RuntimeError(
                        f"policy rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
                    ) from None
                if kind == "error":
                    self._broken = True
                    value.add_note(f"raised in policy rank {rank}")
                    raise value
                results[rank] = value
        return [results[rank] for rank in range(len(self._connections))]

    def stop(self) -> None:
        """Stop every rank: ask, wait up to :data:`STOP_TIMEOUT_S` (none after a failure), then kill."""
        for connection in self._connections:
            try:
                connection.send_bytes(_encode(None))
            except OSError:
                pass
        grace = 2.0 if self._broken else STOP_TIMEOUT_S
        for process in self._processes:
            process.join(grace)
            if process.is_alive():
                logger.warning("policy rank %s did not stop within %.0f s; killing it", process.name, grace)
                process.kill()
                process.join()
        for connection in self._connections:
            connection.close()
        self._connections, self._processes = [], []

    def __enter__(self) -> LocalPolicyRanks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
