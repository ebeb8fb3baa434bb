"""Offline wheelhouses for GPU hosts whose image already has torch.

Training hosts often come with Python, torch, transformers, numpy and the CUDA libraries in their
image, and without network. :func:`build_wheelhouse` (``video-grpo wheelhouse build``) runs on a
machine with network and writes everything else such a host needs into one directory:

- the vLLM release whose CUDA wheel pins the host's torch (:data:`VLLM_TORCH_PINS`), so that
  installing it never replaces the image's torch; on Hopper without its FlashAttention-2 library
  (Hopper runs FA3), repacked with LZMA (still a wheel: RECORD rewritten; pip reads it);
- every wheel vLLM needs that the image lacks, resolved for the host's Python and platform, minus
  large optional kernel packages vLLM imports only for features this package does not use
  (:data:`MAIN_SKIP`); torch, torchvision and torchaudio never;
- the trainer's Megatron-Core, Megatron-Bridge and OmegaConf, and this package's own wheel;
- the NeMo Gym side, for the host's Python (nemo-gym declares a newer Python than it needs),
  minus packages the Gym servers this package runs never import (:data:`GYM_SKIP`). Gym and vLLM
  pin different versions of shared packages (mcp, openai, ...), so they get separate wheel sets
  and separate environments;
- ``manifest.json`` (the host, the vLLM release, every wheel with its sha256, what was left out
  and why), ``install.sh`` and ``hostcheck.py``; optionally the wheels split into parts of a
  fixed size, for hosts reached by carrying files.

On the host, ``install.sh PREFIX`` creates ``PREFIX/main`` (vLLM, trainer, this package) and
``PREFIX/gym`` (nemo-gym, this package) as venvs with ``--system-site-packages`` over the image's
Python, installs with ``pip --no-index --no-deps``, fails if torch is not the image's afterwards,
and checks the imports.

The package: :mod:`.hosts` (the host and what is left out), :mod:`.build` (pip resolution and
:func:`build_wheelhouse`), :mod:`.wheels` (repacking, placeholders, parts), :mod:`.layout`
(:func:`write_wheelhouse`: the directory, ``manifest.json`` and ``install.sh``).
"""

from rl_bridge.hostpack.build import build_wheelhouse, python_with_pip
from rl_bridge.hostpack.hosts import (
    GYM_SKIP,
    MAIN_SKIP,
    METADATA_ONLY,
    VLLM_TORCH_PINS,
    HostSpec,
    canonical_name,
    read_image_packages,
    skip_reason,
    vllm_for_torch,
)
from rl_bridge.hostpack.layout import Wheel, write_wheelhouse
from rl_bridge.hostpack.wheels import placeholder_wheel, repack_wheel, split_parts

__all__ = [
    "GYM_SKIP",
    "MAIN_SKIP",
    "METADATA_ONLY",
    "VLLM_TORCH_PINS",
    "HostSpec",
    "Wheel",
    "build_wheelhouse",
    "canonical_name",
    "placeholder_wheel",
    "python_with_pip",
    "read_image_packages",
    "repack_wheel",
    "skip_reason",
    "split_parts",
    "vllm_for_torch",
    "write_wheelhouse",
]
