"""vLLM side of video GRPO: video loaders, cached-frame manifests, a model loader and refit support.

vLLM imports this package in every one of its processes (API server, engine core, workers)
through the ``vllm.general_plugins`` entry point and calls :func:`register`. Everything here
that is not :func:`register` or a module it imports (``loaders``, ``model_loader``) imports without
vLLM installed.
"""

from __future__ import annotations

import logging
import os

from vllm_video_plugin.contract import VIDEO_LOADER_NAME, SamplingStyle, VideoSamplingContract
from vllm_video_plugin.errors import VideoDecodeError, VideoGRPOError, VideoSamplingError
from vllm_video_plugin.sampling import FrameSample, sample_frames

__all__ = [
    "PLUGIN_NAME",
    "VIDEO_LOADER_NAME",
    "FrameSample",
    "SamplingStyle",
    "VideoDecodeError",
    "VideoGRPOError",
    "VideoSamplingContract",
    "VideoSamplingError",
    "register",
    "registered",
    "sample_frames",
]

#: Name of the entry point in the ``vllm.general_plugins`` group (usable in ``VLLM_PLUGINS``).
PLUGIN_NAME = "video_grpo"

_registered = False


def register() -> None:
    """Register the video loader (``video_grpo``), the model loader (``--load-format video_grpo``),
    the media connector that names inputs in media errors (``VLLM_MEDIA_CONNECTOR=video_grpo``) and
    the CPU weight-transfer engine (``--weight-transfer-config '{"backend": "video_grpo_gloo"}'``).

    On releases whose Qwen2.5-VL processor drops a video's metadata (0.26), also hands it the
    metadata (:mod:`vllm_video_plugin.qwen25vl_time`), so video tokens get the checkpoint's time
    positions, the trainer's.

    Idempotent and cheap (no I/O, no config reads); vLLM calls it once in each process it starts.
    A name already taken in a registry is left alone, never overwritten.

    Raises:
        vllm_video_plugin.compat.UnsupportedVLLMVersion: the installed vLLM is outside the
            releases this package supports (``compat.SUPPORTED_RANGE``); vLLM then stops at start.
    """
    global _registered
    if _registered:
        return
    from vllm_video_plugin import compat

    compat.check_supported()
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.model_executor import model_loader as vllm_model_loaders
    from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    from vllm_video_plugin.connector import CONNECTOR_NAME, VideoGRPOMediaConnector
    from vllm_video_plugin.loaders import VideoGRPOLoader
    from vllm_video_plugin.model_loader import MODEL_LOADER_NAME, VideoGRPOModelLoader

    if VIDEO_LOADER_NAME not in VIDEO_LOADER_REGISTRY.name2class:
        VIDEO_LOADER_REGISTRY.register(VIDEO_LOADER_NAME)(VideoGRPOLoader)
    if CONNECTOR_NAME not in MEDIA_CONNECTOR_REGISTRY.name2class:
        MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR_NAME)(VideoGRPOMediaConnector)
    # vLLM has no public lookup of load formats; registering a taken one would overwrite it.
    if MODEL_LOADER_NAME not in vllm_model_loaders._LOAD_FORMAT_TO_MODEL_LOADER:
        vllm_model_loaders.register_model_loader(MODEL_LOADER_NAME)(VideoGRPOModelLoader)
    # Lazy: the engine module is imported only by a server that selects the backend. The
    # factory refuses a taken name (ValueError), which leaves the registered engine in place.
    try:
        WeightTransferEngineFactory.register_engine(
            "video_grpo_gloo", "vllm_video_plugin.refit_receiver", "GlooWeightTransferEngine"
        )
    except ValueError:
        pass
    if not compat.qwen25vl_processor_passes_video_metadata():  # Qwen2.5-VL's video time positions
        from vllm_video_plugin import qwen25vl_time

        qwen25vl_time.install()
    _registered = True
    logging.getLogger(__name__).info("%s plugin registered in pid %d", PLUGIN_NAME, os.getpid())


def registered() -> bool:
    """Whether :func:`register` has run in this process (used by tests and health checks)."""
    return _registered
