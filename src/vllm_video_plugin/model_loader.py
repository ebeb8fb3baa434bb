"""A ``--load-format`` model loader that checks the sampling contract against the checkpoint.

Serve with::

    --load-format video_grpo
    --model-loader-extra-config '{"video_contract": <contract fields or its media-io block>, ...}'

Weights load exactly as vLLM's default loader loads them (the other keys of the extra config go to
it). Before any weight is read, the contract is checked against the vision geometry of the
directory being read (:func:`~vllm_video_plugin.geometry.check_geometry`): on a mismatch the loader
raises, so the server stops at start-up with a message naming both values. vLLM's
``reload_weights(weights_path=DIR)`` (refit, see :mod:`vllm_video_plugin.refit`) goes through this
loader too: a trainer-exported directory (safetensors with HF names plus its ``config.json``) is
checked the same way before its weights replace the served ones.

This module imports vLLM; :func:`vllm_video_plugin.register` imports it inside vLLM's processes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any, Final

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import DefaultModelLoader

from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.geometry import (
    CONTRACT_CONFIG_KEY,
    check_geometry,
    read_processor_config,
    vision_geometry,
)

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
        ``--mm-processor-kwargs`` the pixel budget.

        Raises:
            ValueError: the contract contradicts the directory's geometry (both values named).
        """
        directory = Path(model_config.model)
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else model_config.hf_config
        mm_config = model_config.multimodal_config
        geometry = vision_geometry(
            config,
            read_processor_config(directory),
            processor_overrides=mm_config.mm_processor_kwargs if mm_config is not None else None,
        )
        check_geometry(self.contract, geometry, checkpoint=str(directory))
        logger.info("video sampling contract matches the vision geometry of %s", directory)
        return super().get_all_weights(model_config, model)
