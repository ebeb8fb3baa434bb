"""The video sampling contract: the one object that decides which frames are taken and how they are shaped.

The same :class:`VideoSamplingContract` configures vLLM's video loader (through the ``"video"`` block of
``--media-io-kwargs``), the Gym side and the trainer's preprocessing, so all three sample the same
frames. This module is pure Python (pydantic only): it never imports vLLM.

How the contract reaches the loader inside vLLM (vLLM 0.32, ``vllm/multimodal/media/video.py`` and
``media/connector.py``): ``MediaConnector.fetch_video`` builds ``VideoMediaIO(image_io, **video_kwargs)``
from the ``"video"`` block. ``VideoMediaIO`` pops ``video_backend`` (the loader's registry name) and
``num_frames`` (default 32 when absent), and calls ``loader.load_bytes(data, num_frames=num_frames,
**rest)``. So every other key arrives as a keyword argument, and ``num_frames`` always arrives, which is
why :meth:`VideoSamplingContract.to_media_io_kwargs` always writes it (``-1``, vLLM's "no count",
when the contract has none). Per-request ``media_io_kwargs`` are merged over the server's block; a
request that sets only ``num_frames`` drops the block's ``fps`` and vice versa.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, model_validator

__all__ = [
    "KEEP_VIDEO_BYTES_OPTION",
    "QWEN_DEFAULT_FPS",
    "QWEN_MAX_FPS",
    "QWEN_MAX_FRAMES",
    "QWEN_MIN_FRAMES",
    "VIDEO_BYTES_KEY",
    "VIDEO_LOADER_NAME",
    "AspectPolicy",
    "SamplingStyle",
    "TimestampPolicy",
    "VideoSamplingContract",
]

VIDEO_LOADER_NAME: Final = "video_grpo"
"""Registry name of this package's vLLM video loader (the ``video_backend`` of the media-io block)."""
KEEP_VIDEO_BYTES_OPTION: Final = "keep_video_bytes"
"""Key of the media-io ``"video"`` block saying whether an encoded video's metadata carries its
bytes (:data:`VIDEO_BYTES_KEY`). Not a contract field: it depends on the model's processor, not on
how frames are sampled (:func:`vllm_video_plugin.geometry.fit_contract` decides it per checkpoint)."""
VIDEO_BYTES_KEY: Final = "original_video_bytes"
"""Video metadata key of an encoded video's source bytes (vLLM's ``nemotron_vl`` loader's name for it)."""

SamplingStyle = Literal["uniform", "nemotron_rounded", "qwen2_vl", "qwen3_vl"]
"""How frames are chosen (see :mod:`vllm_video_plugin.sampling` for the exact rules):

- ``"uniform"``: stock vLLM ``opencv`` / ``nemotron_vl``: ``num_frames`` spread with
  ``linspace(..., dtype=int)``, capped by ``floor(duration * fps)`` when ``fps`` is set;
- ``"nemotron_rounded"``: NeMo RL's Nemotron sampling: rounded uniform indices, the count rounded
  down to a multiple of ``temporal_patch_size`` (at least one tubelet: a 1-frame video is repeated);
- ``"qwen2_vl"``: Qwen2-VL / Qwen2.5-VL fps-based sampling (vLLM ``qwen2_vl`` loader, HF
  ``Qwen2VLVideoProcessor.sample_frames``);
- ``"qwen3_vl"``: Qwen3-VL fps-based sampling (vLLM ``qwen3_vl`` loader).
"""

TimestampPolicy = Literal["nominal", "presentation"]
"""What the prompt's timestamps (Qwen3-VL's ``<t seconds>``, Nemotron's frame times) say:
``"nominal"``: frame index / the video's average frame rate, as stock vLLM writes them;
``"presentation"``: each sampled frame's decoded presentation time. They differ on
variable-frame-rate video, where a frame's index says little about when it plays."""

AspectPolicy = Literal["keep", "stretch"]
"""``"keep"`` preserves each frame's aspect ratio when resizing to the budget; ``"stretch"`` fills a
square patch grid (Nemotron's ``video_maintain_aspect_ratio=False``)."""

QWEN_DEFAULT_FPS: Final = 2.0
"""Sampling rate of the Qwen styles when the contract gives none (HF and vLLM default), frames/s."""
QWEN_MIN_FRAMES: Final = 4
"""Default minimum frame count of the Qwen styles (HF and vLLM default)."""
QWEN_MAX_FRAMES: Final = 768
"""Largest frame count of the Qwen styles; vLLM's qwen loaders silently cap higher values."""
QWEN_MAX_FPS: Final = 30.0
"""Largest sampling rate of the Qwen styles; vLLM's qwen loaders silently cap higher values, frames/s."""

_QWEN_STYLES: Final = ("qwen2_vl", "qwen3_vl")
# vLLM's "not set" value for num_frames and fps in the media-io block and the loader signature.
_UNSET: Final = -1


class VideoSamplingContract(BaseModel):
    """Which frames of a video are sampled, and the budget they are resized to.

    Immutable and hashable; unknown keys are rejected with an error naming them. Defaults of the
    Qwen styles (``fps``, ``min_frames``, ``max_frames``) are filled in at construction, so two
    contracts that sample alike compare (and serialise) equal.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    style: SamplingStyle
    """Sampling rules; see :data:`SamplingStyle`."""
    num_frames: PositiveInt | None = None
    """Requested frame count. Required by ``nemotron_rounded``; optional for ``uniform`` (``None``
    means every frame, unless ``fps`` caps it); not accepted by the Qwen styles, which sample by fps."""
    fps: PositiveFloat | None = None
    """Sampling rate in frames per second of video. ``uniform``: caps the count at
    ``floor(duration * fps)`` (``None``: no cap). Qwen styles: the target rate (``None`` means
    :data:`QWEN_DEFAULT_FPS`, at most :data:`QWEN_MAX_FPS`). Not accepted by ``nemotron_rounded``."""
    min_frames: PositiveInt | None = None
    """Qwen styles only: the fewest frames to sample (``None`` means :data:`QWEN_MIN_FRAMES`)."""
    max_frames: PositiveInt | None = None
    """Qwen styles only: the most frames to sample (``None`` means :data:`QWEN_MAX_FRAMES`)."""
    temporal_patch_size: PositiveInt = 2
    """Frames per temporal patch (tubelet) of the vision encoder. Rounds the count of
    ``nemotron_rounded`` and ``qwen2_vl``, groups Qwen3-VL timestamps, and sets Qwen2.5-VL's seconds
    per temporal patch."""
    patch_size: PositiveInt | None = None
    """Vision patch edge in pixels (``None``: taken from the checkpoint, not checked)."""
    spatial_merge_size: PositiveInt | None = None
    """Patches merged per token along each axis: Qwen's ``merge_size``, Nemotron's
    ``1 / downsample_ratio`` (``None``: from the checkpoint, not checked)."""
    min_pixels: PositiveInt | None = None
    """Pixel budget: smallest frame area after resizing, in pixels (``None``: processor default)."""
    max_pixels: PositiveInt | None = None
    """Pixel budget: largest frame area after resizing, in pixels (``None``: processor default)."""
    target_num_patches: PositiveInt | None = None
    """Patch budget: patches per frame after resizing, Nemotron's ``video_target_num_patches``
    (``None``: from the checkpoint). Exclusive with the pixel budget."""
    aspect_policy: AspectPolicy = "keep"
    """How frames are resized to the budget; see :data:`AspectPolicy`."""
    timestamps: TimestampPolicy = "nominal"
    """The times the model's processor writes into the prompt; see :data:`TimestampPolicy`. Which
    frames are sampled does not change. ``"presentation"`` needs a style whose model is shown
    times (not ``qwen2_vl``). Left out of the media-io block and the fingerprint at its default,
    so stock-compatible contracts serialise as before."""

    @model_validator(mode="before")
    @classmethod
    def _fill_style_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("style") in _QWEN_STYLES:
            data = dict(data)
            data.setdefault("fps", QWEN_DEFAULT_FPS)
            data.setdefault("min_frames", QWEN_MIN_FRAMES)
            data.setdefault("max_frames", QWEN_MAX_FRAMES)
        return data

    @model_validator(mode="after")
    def _check_combination(self) -> VideoSamplingContract:
        style = self.style
        if style in _QWEN_STYLES:
            if self.num_frames is not None:
                raise ValueError(
                    f"style {style!r} samples by fps and ignores a frame count (as vLLM's {style} "
                    f"loader does); drop num_frames={self.num_frames} and set fps (and min_frames/"
                    "max_frames) instead"
                )
            assert self.fps is not None and self.min_frames is not None and self.max_frames is not None
            if self.fps > QWEN_MAX_FPS:
                raise ValueError(
                    f"fps={self.fps} exceeds {QWEN_MAX_FPS:g}, the rate vLLM's {style} loader silently "
                    f"caps to; use fps <= {QWEN_MAX_FPS:g}"
                )
            if self.max_frames > QWEN_MAX_FRAMES:
                raise ValueError(
                    f"max_frames={self.max_frames} exceeds {QWEN_MAX_FRAMES}, the count vLLM's {style} "
                    f"loader silently caps to; use max_frames <= {QWEN_MAX_FRAMES}"
                )
            if style == "qwen2_vl" and self.min_frames < self.temporal_patch_size:
                raise ValueError(
                    f"min_frames={self.min_frames} is below temporal_patch_size={self.temporal_patch_size}; "
                    "qwen2_vl floors the count to whole temporal patches, so a short video would get "
                    "none (vLLM and transformers then divide by zero)"
                )
            if self.min_frames > self.max_frames:
                raise ValueError(f"min_frames={self.min_frames} is larger than max_frames={self.max_frames}")
            if self.aspect_policy != "keep":
                raise ValueError(
                    f"style {style!r} always keeps the aspect ratio (Qwen's smart_resize); "
                    f"aspect_policy={self.aspect_policy!r} is not possible"
                )
        else:
            for name in ("min_frames", "max_frames"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} applies to the qwen2_vl and qwen3_vl styles only; style {style!r} "
                        "takes num_frames" + (" and fps" if style == "uniform" else "")
                    )
        if style == "nemotron_rounded":
            if self.num_frames is None:
                raise ValueError("style 'nemotron_rounded' needs num_frames (the frame count to sample)")
            if self.fps is not None:
                raise ValueError(
                    "style 'nemotron_rounded' samples exactly num_frames (rounded to whole tubelets) and "
                    f"takes no fps; drop fps={self.fps} or use style 'uniform' for an fps cap"
                )
        if self.timestamps == "presentation" and style == "qwen2_vl":
            raise ValueError(
                "timestamps='presentation' changes the times written into the prompt, and style "
                "'qwen2_vl' (Qwen2.5-VL) writes none: use it with qwen3_vl, uniform or nemotron_rounded"
            )
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} is larger than max_pixels={self.max_pixels}")
        if self.target_num_patches is not None and (self.min_pixels or self.max_pixels):
            raise ValueError(
                "give either a pixel budget (min_pixels/max_pixels) or a patch budget "
                "(target_num_patches), not both"
            )
        return self

    def to_media_io_kwargs(self) -> dict[str, Any]:
        """The ``"video"`` block of vLLM's ``--media-io-kwargs`` that selects this package's loader.

        Holds ``video_backend`` (:data:`VIDEO_LOADER_NAME`), ``num_frames`` (``-1`` when the contract
        has none, so that vLLM's default of 32 does not apply) and every other field that is set.
        Use it as ``--media-io-kwargs '{"video": <this dict as JSON>}'``.
        """
        block: dict[str, Any] = {"video_backend": VIDEO_LOADER_NAME}
        block.update(self._dump(exclude_none=True))
        block["num_frames"] = _UNSET if self.num_frames is None else self.num_frames
        return block

    def _dump(self, *, exclude_none: bool = False) -> dict[str, Any]:
        data = self.model_dump(mode="json", exclude_none=exclude_none)
        if data["timestamps"] == "nominal":
            del data["timestamps"]
        return data

    @classmethod
    def from_media_io_kwargs(cls, kwargs: dict[str, Any]) -> VideoSamplingContract:
        """Rebuild the contract from a media-io ``"video"`` block, or from the keyword arguments a
        loader's ``load_bytes(data, num_frames=..., **kwargs)`` received (pass
        ``{"num_frames": num_frames, **kwargs}``).

        ``video_backend`` may be present and must then be :data:`VIDEO_LOADER_NAME`. ``num_frames``
        or ``fps`` equal to ``-1`` mean "not set", as in vLLM.

        Raises:
            ValueError: (a pydantic ``ValidationError``) unknown keys (named in the message), a
                different ``video_backend``, or an inconsistent combination.
        """
        fields = dict(kwargs)
        backend = fields.pop("video_backend", VIDEO_LOADER_NAME)
        if backend != VIDEO_LOADER_NAME:
            raise ValueError(
                f"video_backend={backend!r} is not this package's loader {VIDEO_LOADER_NAME!r}; the "
                "block configures another loader"
            )
        for name in ("num_frames", "fps"):
            if fields.get(name) == _UNSET:
                del fields[name]
        return cls.model_validate(fields)

    def canonical_json(self) -> str:
        """Every field, keys sorted, no whitespace: equal contracts give equal strings."""
        return json.dumps(self._dump(), sort_keys=True, separators=(",", ":"))

    def fingerprint(self) -> str:
        """SHA-256 (hex) of :meth:`canonical_json`, used in cache keys."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()
