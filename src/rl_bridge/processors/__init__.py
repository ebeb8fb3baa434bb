"""Policy-side media processors, one per model family, behind :class:`MediaProcessor`.

:func:`load_processor` picks the implementation from the checkpoint's ``model_type``:

- ``qwen2_5_vl`` (the training path) and ``qwen3_vl``: :class:`~.qwen.QwenVLProcessor`, the
  checkpoint's HF processors on the frames vLLM sampled;
- Nemotron Nano VL V2 / Omni (the architectures vLLM serves with ``nano_nemotron_vl``):
  :class:`~.nemotron.NemotronVLProcessor`, a bit-exact copy of vLLM's own Nemotron video processing.
"""

from __future__ import annotations

import json
from pathlib import Path

from rl_bridge.processors.base import MediaProcessingError, MediaProcessor, ProcessedMedia, ProcessorFamily
from vllm_video_plugin.contract import VideoSamplingContract

__all__ = [
    "MediaProcessingError",
    "MediaProcessor",
    "ProcessedMedia",
    "ProcessorFamily",
    "load_processor",
]

# Architectures vLLM 0.32 serves with its nano_nemotron_vl model and processor.
_NEMOTRON_ARCHITECTURES = frozenset(
    {
        "NemotronH_Nano_VL_V2",
        "NemotronH_Nano_Omni_Reasoning_V3",
        "NemotronH_Super_Omni_Reasoning_V3",
        "NemotronH_Omni_Reasoning_V3",
    }
)


def load_processor(model_dir: str | Path, contract: VideoSamplingContract | None = None) -> MediaProcessor:
    """The media processor of a checkpoint.

    Args:
        model_dir: the HF checkpoint directory.
        contract: the contract vLLM's video loader samples with. ``None`` means the checkpoint's
            own (Qwen only: Nemotron's frame count is a serving setting, so it must be given).

    Raises:
        ValueError: an unsupported checkpoint (the supported ones are listed), a Nemotron
            checkpoint without a contract, or a contract that contradicts the checkpoint.
    """
    from rl_bridge.processors.nemotron import NemotronVLProcessor
    from rl_bridge.processors.qwen import QWEN_FAMILIES, QwenVLProcessor

    directory = Path(model_dir)
    config = json.loads((directory / "config.json").read_text())
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if model_type in QWEN_FAMILIES:
        return QwenVLProcessor(directory, contract)
    if _NEMOTRON_ARCHITECTURES.intersection(architectures):
        if contract is None:
            raise ValueError(
                f"{directory}: a Nemotron VL processor needs the video sampling contract vLLM uses "
                "(its frame count is a serving setting, not part of the checkpoint)"
            )
        return NemotronVLProcessor(directory, contract)
    raise ValueError(
        f"{directory}: no media processor for model_type {model_type!r} (architectures {architectures}); "
        f"supported: model_type {sorted(QWEN_FAMILIES)} or architectures {sorted(_NEMOTRON_ARCHITECTURES)}"
    )
