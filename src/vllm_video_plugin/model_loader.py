"""A ``--load-format`` model loader that checks the sampling contract against the checkpoint.

Serve with::

    --load-format video_grpo
    --model-loader-extra-config '{"video_contract": <contract fields or its media-io block>, ...}'

Weights load exactly as vLLM's default loader loads them (the other keys of the extra config go to
it). Before any weight is read, the contract is fitted to the checkpoint's processor
(:func:`~vllm_video_plugin.geometry.fit_contract`): its vision geometry, what the processor reads
besides the frames (the video's bytes, with ``use_audio_in_video`` server-wide) and the times it
writes. When ``--media-io-kwargs`` selects this package's video loader server-wide, that block is
checked too: it must hold the same contract, and its ``keep_video_bytes`` must suit the processor.
On a contradiction the loader raises, so the server stops at start-up with one line naming both
values; the adaptations made are logged. vLLM's
``reload_weights(weights_path=DIR)`` (refit, see :mod:`rl_bridge.refit.client`) goes through this
loader too: a trainer-exported directory (safetensors with HF names plus its ``config.json``) is
checked the same way before its weights replace the served ones.

This module imports vLLM; :func:`vllm_video_plugin.register` imports it inside vLLM's processes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any, Final

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import DefaultModelLoader

from vllm_video_plugin.contract import KEEP_VIDEO_BYTES_OPTION, VIDEO_LOADER_NAME, VideoSamplingContract
from vllm_video_plugin.geometry import (
    CONTRACT_CONFIG_KEY,
    fit_contract,
    read_processor_config,
    vision_geometry,
)
from vllm_video_plugin.loaders import DECODE_LIMITS_OPTION, MEDIA_ROOT_OPTION

__all__ = ["MODEL_LOADER_NAME", "VideoGRPOModelLoader"]

MODEL_LOADER_NAME: Final = "video_grpo"
"""The ``--load-format`` name of :class:`VideoGRPOModelLoader`."""

logger = logging.getLogger(__name__)


def _contract_from_extra_config(extra: Mapping[str, Any]) -> VideoSamplingContract:
    raw = extra.get(CONTRACT_CONFIG_KEY)
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"--load-format {MODEL_LOADER_NAME} needs the sampling contract: --model-loader-extra-config "
            f'\'{{"{CONTRACT_CONFIG_KEY}": {{"style": ..., ...}}}}\' (got {CONTRACT_CONFIG_KEY}={raw!r})'
        )
    return VideoSamplingContract.from_media_io_kwargs(dict(raw))


def _served_video_block(media_io_kwargs: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The server-wide ``"video"`` block of ``--media-io-kwargs`` when it selects this package's
    loader (by ``video_backend``, or ``VLLM_VIDEO_LOADER_BACKEND``), else ``None``."""
    block = dict((media_io_kwargs or {}).get("video") or {})
    backend = block.get("video_backend") or os.environ.get("VLLM_VIDEO_LOADER_BACKEND")
    return block if backend == VIDEO_LOADER_NAME else None


def _check_served_contract(block: Mapping[str, Any], checked: VideoSamplingContract) -> None:
    """Raise when the server-wide block samples with another contract than the one checked."""
    fields = {
        key: value
        for key, value in block.items()
        if key not in (MEDIA_ROOT_OPTION, DECODE_LIMITS_OPTION, KEEP_VIDEO_BYTES_OPTION)
    }
    served = VideoSamplingContract.from_media_io_kwargs(fields)
    if served != checked:
        raise ValueError(
            f"--media-io-kwargs samples video with the contract {served.canonical_json()}, but "
            f"--model-loader-extra-config {CONTRACT_CONFIG_KEY} is {checked.canonical_json()}: give both "
            "the same contract"
        )


class VideoGRPOModelLoader(DefaultModelLoader):
    """vLLM's default loader plus the contract-versus-checkpoint check (see the module docstring)."""

    def __init__(self, load_config: LoadConfig) -> None:
        """
        Raises:
            ValueError: the extra config has no valid contract under ``video_contract`` (the
                message names the problem), or keys the default loader rejects.
        """
        extra = dict(load_config.model_loader_extra_config or {})
        self.contract = _contract_from_extra_config(extra)
        del extra[CONTRACT_CONFIG_KEY]
        # The default loader rejects unknown extra keys and load formats: hand it the rest.
        super().__init__(
            dataclasses.replace(load_config, load_format="auto", model_loader_extra_config=extra)
        )

    def get_all_weights(
        self, model_config: ModelConfig, model: nn.Module
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """The default loader's weights, after checking the contract against the directory read.

        The check runs when this is called, not when the weights are iterated: vLLM's in-place
        reload prepares the model for new weights between the two, and a refused directory must
        leave the served weights untouched.

        ``model_config.model`` is the served checkpoint at start-up, and the trainer's export
        directory after ``reload_weights(weights_path=...)``. Its ``config.json`` gives the
        geometry (the served config when the directory has none), its processor files and
        ``--mm-processor-kwargs`` the pixel budget (and ``use_audio_in_video``).

        Raises:
            ValueError: the contract contradicts the directory's geometry or processor, or the
                server-wide video block contradicts the contract or the processor (one line, both
                values named).
        """
        directory = Path(model_config.model)
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else model_config.hf_config
        mm_config = model_config.multimodal_config
        processor_kwargs = dict((mm_config.mm_processor_kwargs if mm_config is not None else None) or {})
        geometry = vision_geometry(
            config, read_processor_config(directory), processor_overrides=processor_kwargs
        )
        served = _served_video_block(mm_config.media_io_kwargs if mm_config is not None else None)
        if served is not None:
            _check_served_contract(served, self.contract)
        fit = fit_contract(
            self.contract,
            geometry,
            checkpoint=str(directory),
            # A server-wide block is what every request's loader gets (unset: the bytes do not travel).
            keep_video_bytes=None if served is None else served.get(KEEP_VIDEO_BYTES_OPTION) is True,
            audio_in_video=bool(processor_kwargs.get("use_audio_in_video")),
        )
        logger.info("video sampling contract matches the vision geometry of %s", directory)
        for adaptation in fit.adaptations:
            logger.info("video sampling contract adapted to %s: %s", directory, adaptation)
        return super().get_all_weights(model_config, model)
