"""The vision geometry of a checkpoint, and how a sampling contract is checked against it.

vLLM reads patch size, spatial merge (or downsample) ratio, temporal patch size and the pixel or patch
budget from the checkpoint; the sampling contract states what the trainer and the Gym side assume.
:func:`check_geometry` refuses a contract that contradicts the checkpoint, naming both values. Used
by the ``--load-format`` loader (:mod:`vllm_video_plugin.model_loader`) and by the trainer at start-up.

:func:`fit_contract` goes one step further, to the model's processor: which media-io options the
video loader needs for it (whether an encoded video's bytes travel in its metadata) and what the
contract asks that the processor cannot do. Any style samples frames for any family; what differs
is what the processor reads besides the frames:

- Qwen2-VL, Qwen2.5-VL and Qwen3-VL build ``transformers.VideoMetadata`` from the metadata and fail
  on any other key: the source bytes never travel (``keep_video_bytes=true`` is refused);
- Nemotron Nano VL / Omni reads ``fps`` and ``frames_indices``, and with ``use_audio_in_video``
  set server-wide decodes each video's audio track from its bytes: the bytes travel exactly then
  (an adaptation: the block says ``keep_video_bytes=true``; ``false`` is refused);
- Qwen2-VL and Qwen2.5-VL write no times into the prompt, so ``timestamps='presentation'`` is
  refused for them (it would change Qwen2.5-VL's seconds per temporal patch instead);
- the geometry (:func:`geometry_mismatches`): a Qwen style always keeps the aspect ratio, so it is
  refused for a Nemotron checkpoint that stretches frames, and so on.

Pure Python: does not import vLLM.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from vllm_video_plugin.contract import KEEP_VIDEO_BYTES_OPTION, AspectPolicy, VideoSamplingContract

__all__ = [
    "CONTRACT_CONFIG_KEY",
    "ContractFit",
    "VisionGeometry",
    "check_geometry",
    "fit_contract",
    "geometry_mismatches",
    "read_processor_config",
    "vision_geometry",
]

# Qwen model types whose processors write no frame times into the prompt.
_TIMELESS_MODEL_TYPES: Final = frozenset({"qwen2_vl", "qwen2_5_vl"})

CONTRACT_CONFIG_KEY: Final = "video_contract"
"""Key of vLLM's ``--model-loader-extra-config`` holding the sampling contract."""

# Where a Qwen video processor's settings live, most specific first (transformers' lookup order).
_PROCESSOR_FILES: Final = (
    ("video_preprocessor_config.json", None),
    ("processor_config.json", "video_processor"),
    ("preprocessor_config.json", None),
)


@dataclass(frozen=True)
class VisionGeometry:
    """The vision settings of a checkpoint that a sampling contract must agree with.

    ``None`` in :attr:`min_pixels` / :attr:`max_pixels` means unknown (no processor file was read);
    in :attr:`target_num_patches` it means the checkpoint sets no video patch budget.
    """

    family: Literal["qwen", "nemotron"]
    """``"qwen"``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL; ``"nemotron"``: Nemotron Nano VL / Omni."""
    patch_size: int
    """Vision patch edge in pixels (``vision_config.patch_size``; Nemotron: ``patch_size``)."""
    spatial_merge_size: int
    """Patches merged per token along each axis (Qwen ``spatial_merge_size``; Nemotron
    ``round(1 / downsample_ratio)``)."""
    temporal_patch_size: int
    """Frames per tubelet (Qwen ``temporal_patch_size``; Nemotron ``video_temporal_patch_size``,
    1 when absent)."""
    min_pixels: int | None
    """Qwen video processor's smallest frame area after resizing, in pixels."""
    max_pixels: int | None
    """Qwen video processor's largest frame area after resizing, in pixels."""
    target_num_patches: int | None
    """Nemotron's ``video_target_num_patches`` (or derived from ``video_target_img_size``)."""
    aspect_policy: AspectPolicy
    """Qwen always keeps the aspect ratio; Nemotron keeps it when ``video_maintain_aspect_ratio``."""
    sources: Mapping[str, str]
    """For each field, the checkpoint key it was read from (used in error messages)."""
    model_type: str | None = None
    """The config's ``model_type`` (``qwen2_5_vl``, ``qwen3_vl``, ...; Nemotron's names its
    architecture); ``None``: not read."""

    @property
    def writes_timestamps(self) -> bool:
        """Whether the model's processor writes frame times into the prompt (Qwen3-VL, Nemotron;
        not Qwen2-VL and Qwen2.5-VL)."""
        return self.model_type not in _TIMELESS_MODEL_TYPES


def _field(node: Any, name: str) -> Any:
    """``node[name]`` or ``node.name`` (configs arrive as JSON dicts or as config objects)."""
    if isinstance(node, Mapping):
        return node.get(name)
    return getattr(node, name, None)


def vision_geometry(
    config: Any, processor: Mapping[str, Any] | None, *, processor_overrides: Mapping[str, Any] | None = None
) -> VisionGeometry:
    """Read the vision geometry of a checkpoint.

    Args:
        config: the checkpoint's ``config.json`` as a dict, or its ``PretrainedConfig``.
        processor: the video processor's settings (:func:`read_processor_config`); ``None`` leaves
            the pixel budget unknown.
        processor_overrides: vLLM's ``--mm-processor-kwargs`` (``min_pixels``, ``max_pixels`` or
            ``size``), which take precedence over ``processor``.

    Raises:
        ValueError: the architecture is neither a Qwen-VL nor a Nemotron VL one.
    """
    vision = _field(config, "vision_config")
    if vision is not None and _field(vision, "spatial_merge_size") is not None:
        settings = {**(processor or {}), **(processor_overrides or {})}
        size = settings.get("size") or {}
        return VisionGeometry(
            family="qwen",
            patch_size=int(_field(vision, "patch_size")),
            spatial_merge_size=int(_field(vision, "spatial_merge_size")),
            temporal_patch_size=int(_field(vision, "temporal_patch_size")),
            min_pixels=settings.get("min_pixels") or size.get("shortest_edge"),
            max_pixels=settings.get("max_pixels") or size.get("longest_edge"),
            target_num_patches=None,
            aspect_policy="keep",
            sources={
                "patch_size": "vision_config.patch_size",
                "spatial_merge_size": "vision_config.spatial_merge_size",
                "temporal_patch_size": "vision_config.temporal_patch_size",
                "min_pixels": "video processor size.shortest_edge (min_pixels)",
                "max_pixels": "video processor size.longest_edge (max_pixels)",
            },
            model_type=_field(config, "model_type"),
        )
    ratio = _field(config, "downsample_ratio")
    if ratio is not None:
        vision = vision if vision is not None else config
        patch = int(_field(config, "patch_size") or _field(vision, "patch_size"))
        target = _field(vision, "video_target_num_patches")
        target_source = "vision_config.video_target_num_patches"
        image_size = _field(vision, "video_target_img_size")
        if target is None and image_size is not None:
            target = math.ceil(image_size / patch) ** 2
            target_source = "vision_config.video_target_img_size"
        return VisionGeometry(
            family="nemotron",
            patch_size=patch,
            spatial_merge_size=round(1 / float(ratio)),
            temporal_patch_size=int(_field(vision, "video_temporal_patch_size") or 1),
            min_pixels=None,
            max_pixels=None,
            target_num_patches=None if target is None else int(target),
            aspect_policy="keep" if _field(vision, "video_maintain_aspect_ratio") else "stretch",
            sources={
                "patch_size": "patch_size",
                "spatial_merge_size": "1 / downsample_ratio",
                "temporal_patch_size": "vision_config.video_temporal_patch_size",
                "target_num_patches": target_source,
                "aspect_policy": "vision_config.video_maintain_aspect_ratio",
            },
            model_type=_field(config, "model_type"),
        )
    architectures = _field(config, "architectures")
    raise ValueError(
        f"cannot read the vision geometry of architecture {architectures}: the contract can be checked "
        "against Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Nemotron Nano VL checkpoints only"
    )


def read_processor_config(model_dir: str | Path) -> Mapping[str, Any] | None:
    """The video processor settings stored in a checkpoint directory, or ``None`` when it has none
    (or ``model_dir`` is not a local directory)."""
    directory = Path(model_dir)
    for name, key in _PROCESSOR_FILES:
        path = directory / name
        if path.is_file():
            settings = json.loads(path.read_text())
            if key is None:
                return settings
            if key in settings:
                return settings[key]
    return None


def geometry_mismatches(contract: VideoSamplingContract, geometry: VisionGeometry) -> list[str]:
    """Each way ``contract`` contradicts ``geometry``, as ``"<field>: contract X, checkpoint Y"``.

    Fields the contract leaves ``None`` are not checked; ``temporal_patch_size`` and
    ``aspect_policy`` always are. A pixel budget cannot hold for Nemotron (it sizes frames by
    patches) nor a patch budget for Qwen, nor presentation timestamps for a model that writes no
    times into the prompt.
    """
    problems: list[str] = []
    if contract.timestamps == "presentation" and not geometry.writes_timestamps:
        problems.append(
            "timestamps: contract timestamps='presentation', but checkpoint model_type="
            f"{geometry.model_type} writes no times into the prompt (use timestamps='nominal')"
        )

    def differ(name: str, wanted: object, actual: object) -> None:
        if wanted is not None and actual is not None and wanted != actual:
            problems.append(f"{name}: contract {name}={wanted}, checkpoint {geometry.sources[name]}={actual}")

    differ("patch_size", contract.patch_size, geometry.patch_size)
    differ("spatial_merge_size", contract.spatial_merge_size, geometry.spatial_merge_size)
    differ("temporal_patch_size", contract.temporal_patch_size, geometry.temporal_patch_size)
    if geometry.family == "qwen":
        differ("min_pixels", contract.min_pixels, geometry.min_pixels)
        differ("max_pixels", contract.max_pixels, geometry.max_pixels)
        if contract.target_num_patches is not None:
            problems.append(
                f"target_num_patches: contract target_num_patches={contract.target_num_patches}, but "
                "a Qwen checkpoint sizes frames by pixels (set min_pixels/max_pixels instead)"
            )
        if contract.aspect_policy != "keep":
            problems.append(
                f"aspect_policy: contract aspect_policy={contract.aspect_policy!r}, but a Qwen checkpoint "
                "always keeps the aspect ratio ('keep')"
            )
    else:
        for name in ("min_pixels", "max_pixels"):
            if getattr(contract, name) is not None:
                problems.append(
                    f"{name}: contract {name}={getattr(contract, name)}, but a Nemotron checkpoint sizes "
                    "frames by patches (set target_num_patches instead)"
                )
        wanted = contract.target_num_patches
        if wanted is not None and wanted != geometry.target_num_patches:
            actual = geometry.target_num_patches if geometry.target_num_patches is not None else "unset"
            problems.append(
                f"target_num_patches: contract target_num_patches={contract.target_num_patches}, "
                f"checkpoint {geometry.sources['target_num_patches']}={actual}"
            )
        differ("aspect_policy", contract.aspect_policy, geometry.aspect_policy)
    return problems


def check_geometry(contract: VideoSamplingContract, geometry: VisionGeometry, *, checkpoint: str) -> None:
    """Raise when ``contract`` contradicts ``geometry``.

    Raises:
        ValueError: naming ``checkpoint`` and, per contradiction, the contract's and the checkpoint's
            values.
    """
    problems = geometry_mismatches(contract, geometry)
    if problems:
        raise ValueError(
            f"the video sampling contract does not match the vision geometry of {checkpoint}: "
            + "; ".join(problems)
            + ". Fix the contract (--model-loader-extra-config "
            f"{CONTRACT_CONFIG_KEY}) or serve the checkpoint it was written for."
        )


@dataclass(frozen=True)
class ContractFit:
    """A contract fitted to one checkpoint's processor (:func:`fit_contract`)."""

    contract: VideoSamplingContract
    keep_video_bytes: bool
    """Whether an encoded video's metadata carries its bytes (``original_video_bytes``): only for
    a Nemotron model with ``use_audio_in_video`` set server-wide, whose processor decodes each
    video's audio track from them."""
    adaptations: tuple[str, ...]
    """One line for each way the media-io block differs from the contract's own
    (:meth:`VideoSamplingContract.to_media_io_kwargs`), with the reason; empty when none does."""

    def media_io_kwargs(self) -> dict[str, Any]:
        """The ``"video"`` block for this checkpoint: the contract's, with ``keep_video_bytes`` stated."""
        return {**self.contract.to_media_io_kwargs(), KEEP_VIDEO_BYTES_OPTION: self.keep_video_bytes}


def fit_contract(
    contract: VideoSamplingContract,
    geometry: VisionGeometry,
    *,
    checkpoint: str,
    keep_video_bytes: bool | None = None,
    audio_in_video: bool = False,
) -> ContractFit:
    """Fit ``contract`` to the processor of the checkpoint ``geometry`` was read from (the module
    docstring says what each family's processor takes).

    Args:
        checkpoint: how messages name the checkpoint.
        keep_video_bytes: the block's ``keep_video_bytes`` (``None``: not given, decided here).
        audio_in_video: vLLM runs with ``use_audio_in_video`` in ``--mm-processor-kwargs``.

    Raises:
        ValueError: one line naming ``checkpoint`` and, per contradiction, the contract's (or the
            block's) value and the checkpoint's.
    """
    problems = geometry_mismatches(contract, geometry)
    family = geometry.model_type or geometry.family
    needs_bytes = geometry.family == "nemotron" and audio_in_video
    if keep_video_bytes and geometry.family != "nemotron":
        problems.append(
            f"{KEEP_VIDEO_BYTES_OPTION}: block {KEEP_VIDEO_BYTES_OPTION}=true, checkpoint "
            f"model_type={family} builds transformers.VideoMetadata from the metadata, which refuses "
            "original_video_bytes"
        )
    if keep_video_bytes is False and needs_bytes:
        problems.append(
            f"{KEEP_VIDEO_BYTES_OPTION}: block {KEEP_VIDEO_BYTES_OPTION}=false (or unset), server "
            "use_audio_in_video=true, and the processor decodes each video's audio track from its bytes "
            f"(set {KEEP_VIDEO_BYTES_OPTION}: true)"
        )
    if problems:
        raise ValueError(
            f"the video sampling contract ({contract.style}) cannot be served to {checkpoint}: "
            + "; ".join(problems)
        )
    adaptations: list[str] = []
    if needs_bytes and keep_video_bytes is None:
        adaptations.append(
            f"{KEEP_VIDEO_BYTES_OPTION}=true: with use_audio_in_video the {family} processor decodes each "
            "video's audio track from its bytes"
        )
    keep = needs_bytes if keep_video_bytes is None else keep_video_bytes
    return ContractFit(contract, keep_video_bytes=keep, adaptations=tuple(adaptations))
