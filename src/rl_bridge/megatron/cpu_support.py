"""Run megatron-core on a host without CUDA (tests and the embedded CPU demo).

megatron-core 0.19 assumes CUDA in many places: ``torch.cuda.current_device()`` when building
rotary embeddings and attention buffers, ``torch.cuda.current_stream()`` in DDP's gradient
reduction, the CUDA RNG tracker's ``fork()`` around dropout,
``torch.zeros(..., device="cuda")`` in the pipeline schedules, ``torch.tensor(..., device="cuda")``
and ``Tensor.cuda()`` in the optimizer, and assertions on ``torch.cuda.FloatTensor`` in gradient
clipping and the distributed optimizer. This module holds the adjustments that make the model
build, forward, backward, schedule and optimizer step (gradient clipping included) run on CPU, with
world size 1 or several gloo ranks:

* :func:`cpu_execution`, held for as long as Megatron code runs:
  ``torch.cuda.current_device()`` returns ``"cpu"``; ``torch.cuda.current_stream()`` returns
  the CPU stream (whose event waits are no-ops) and ``torch.cuda.synchronize()`` the CPU's
  (the pipeline schedules' point-to-point exchange); Megatron's RNG tracker is the no-op
  inference tracker (dropout then draws from torch's default CPU generator, which is exact for
  tensor-parallel size 1 and for models without dropout, such as Qwen2.5-VL; with TP > 1 every rank
  would draw the same dropout mask where Megatron draws one per rank); and a
  :class:`~torch.overrides.TorchFunctionMode` creates tensors asked for on ``device="cuda"`` on the
  CPU and makes ``Tensor.cuda()`` return the tensor itself (the schedules, the optimizer, DDP
  buffers, and the causal mask of the local ``DotProductAttention``), and ``Tensor.type()`` names
  a CPU tensor's CUDA type (gradient clipping asserts its gradients are CUDA tensors by that name,
  and the distributed optimizer its parameters; gloo has the reduce-scatter and all-gather it
  needs).
* :func:`single_process_group`: torch.distributed with world size 1 (an in-process store) and
  Megatron's parallel state with TP = PP = 1 (the launcher-free case of
  :func:`.distributed.model_parallel_group`, which runs one process per rank under torchrun).

Every adjustment is a no-op when ``torch.cuda.is_available()`` is true, and every one is undone
when its context exits. The device and RNG-tracker patches are process-wide while active; the
tensor-creation mode applies to the thread that entered :func:`cpu_execution`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "cpu_execution",
    "cpu_execution_active",
    "cpu_support_needed",
    "single_process_group",
]


def cpu_support_needed() -> bool:
    """Whether megatron-core needs this module's adjustments: true exactly when CUDA is unavailable."""
    return not torch.cuda.is_available()


def _cpu_current_device() -> str:
    """Replacement for ``torch.cuda.current_device`` while :func:`cpu_execution` is active."""
    return "cpu"


def _cpu_synchronize(device: object = None) -> None:
    """Replacement for ``torch.cuda.synchronize`` while :func:`cpu_execution` is active (a function of
    its own: torch.compile keys its handlers by function, and ``torch.cpu.synchronize`` has one)."""
    torch.cpu.synchronize()


def cpu_execution_active() -> bool:
    """Whether :func:`cpu_execution` is applied right now (always ``False`` when CUDA is available)."""
    return torch.cuda.current_device is _cpu_current_device


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":", 1)[0] == "cuda"


class _CudaTensorsOnCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` keyword arguments to the CPU, makes ``Tensor.cuda()`` a no-op, and
    names a CPU tensor's type as its CUDA type (``Tensor.type()`` with no argument), which the
    distributed optimizer checks its parameters against."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            name = func(*args)  # already rewritten by an enclosing cpu_execution() when nested
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextmanager
def cpu_execution() -> Iterator[bool]:
    """Let megatron-core build and run models on the CPU for the duration of the block.

    Yields:
        ``True`` when the adjustments are applied (no CUDA), ``False`` when CUDA is available and
        nothing was changed.

    Inside the block ``torch.cuda.current_device()`` returns ``"cpu"``,
    ``torch.cuda.current_stream()`` returns ``torch.cpu.current_stream()``,
    ``torch.cuda.synchronize()`` waits for the CPU (the pipeline schedules' point-to-point exchange
    calls it),
    ``megatron.core.tensor_parallel.random`` holds the no-op RNG tracker
    (``initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)``), and, in this thread,
    ``device="cuda"`` tensor creation goes to the CPU and ``Tensor.cuda()`` is a no-op. On exit all
    of them are restored to what they were, including a tracker that existed before. Nesting is
    allowed.
    """
    if not cpu_support_needed():
        yield False
        return
    from megatron.core.tensor_parallel import random as mcore_random

    saved_current_device = torch.cuda.current_device
    saved_current_stream = torch.cuda.current_stream
    saved_synchronize = torch.cuda.synchronize
    saved_tracker = mcore_random._CUDA_RNG_STATE_TRACKER
    saved_tracker_initialized = mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.current_stream = torch.cpu.current_stream
    torch.cuda.synchronize = _cpu_synchronize
    try:
        mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        with _CudaTensorsOnCpu():
            yield True
    finally:
        torch.cuda.current_device = saved_current_device
        torch.cuda.current_stream = saved_current_stream
        torch.cuda.synchronize = saved_synchronize
        mcore_random._CUDA_RNG_STATE_TRACKER = saved_tracker
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_tracker_initialized


@contextmanager
def single_process_group(*, seed: int = 0) -> Iterator[None]:
    """torch.distributed with world size 1 and Megatron's parallel state with TP = PP = 1.

    The world-size-1 case of :func:`.distributed.model_parallel_group`, for code that runs without
    a launcher: rank 0 of 1 with an in-process store (no port), gloo on a host without CUDA and
    NCCL on device 0 otherwise.

    Args:
        seed: seed of Megatron's model-parallel CUDA RNG states; used only when CUDA is available
            (on CPU, :func:`cpu_execution` installs the no-op tracker instead).

    On exit the parallel state and the process group are destroyed.

    Raises:
        RuntimeError: torch.distributed is already initialised in this process.
    """
    from rl_bridge.megatron.distributed import RankEnvironment, model_parallel_group

    with model_parallel_group(tensor_parallel=1, seed=seed, environment=RankEnvironment.single_process()):
        yield
