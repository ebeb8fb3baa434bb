"""What goes into a wheelhouse for a host: the host, the vLLM release for its torch, what is left out.

The tables here are the wheelhouse's policy (see :mod:`rl_bridge.hostpack`); :mod:`.build` applies
them to pip's resolution.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "GYM_SKIP",
    "MAIN_SKIP",
    "METADATA_ONLY",
    "VLLM_TORCH_PINS",
    "HostSpec",
    "canonical_name",
    "read_image_packages",
    "skip_reason",
    "vllm_for_torch",
]

#: vLLM release -> the ``torch==`` its x86_64 CUDA wheel requires, read from each wheel's metadata
#: on the package index (2026-12-05). A host whose torch is not pinned by any release here needs
#: ``--vllm`` (and a vLLM built for its torch).
VLLM_TORCH_PINS: dict[str, str] = {
    "0.26.0": "2.11.0",
    "0.27.0": "2.13.0",
    "0.27.1": "2.13.0",
    "0.28.0": "2.13.0",
    "0.29.0": "2.13.0",
    "0.30.0": "2.13.0",
    "0.31.0": "2.13.0",
    "0.32.0": "2.13.0",
    "0.33.0": "2.14.0",
}

#: Never in a wheelhouse: the image's own build of these is the one that must be used.
TORCH_FAMILY = ("torch", "torchvision", "torchaudio")

#: Left out of the vLLM set (name pattern -> why). Large optional kernel packages that vLLM
#: imports only for models, quantizations or features this package does not use; flashinfer stays
#: (vLLM's sampler imports it at engine start).
MAIN_SKIP: dict[str, str] = {
    r"tokenspeed(-.*)?": "MLA attention kernels (DeepSeek-style models)",
    r"tilelang": "TileLang kernels for some quantized and MoE paths",
    r"z3-solver": "constraint solver used by TileLang's compiler",
    r"pynvvideocodec": "NVDEC video decoding; this package decodes video with PyAV",
    r"nvidia-cutlass-dsl(-libs-.*)?": (
        "CuTe DSL (FlashAttention-4 and quack kernels); without its CUDA-flavour library flashinfer's "
        "import of it raises instead of falling back, which broke `import megatron.core` on the H200"
    ),
    r"nvidia-.*-cu12": "CUDA 12 runtime libraries; the image's CUDA libraries are used",
    r"nvidia-cuda-(nvcc|crt|nvdisasm|cccl)": "CUDA compiler toolchain for JIT kernel builds",
    r"nvidia-nvvm": "CUDA compiler toolchain for JIT kernel builds",
    r"cuda-python": "CUDA Python bindings; the image has cuda-bindings",
}

#: Left out of the Gym set (name pattern -> why): large packages that nemo-gym depends on and
#: that neither `gym --help` nor the Gym servers of this package import (their imports were listed
#: from ``sys.modules`` after importing every server app and running ``gym --help``).
GYM_SKIP: dict[str, str] = {
    r"ray": "Gym's Ray launcher (`gym env start`); the video servers declare ray_enabled = False",
    r"mlflow(-skinny|-tracing)?": "experiment tracking integration, not imported by the servers",
    r"databricks-sdk": "MLflow's Databricks client",
    r"sqlalchemy|alembic": "MLflow's tracking database",
    r"py-spy": "profiler binary",
    r"virtualenv|distlib|python-discovery": "per-server venv builder; install.sh makes the venv",
    r"gunicorn": "MLflow's server",
    r"docker": "sandbox providers",
}

#: Left out but needed by name (name -> why): nemo-gym reads Ray's version with
#: ``importlib.metadata`` when ``nemo_gym.global_config`` is imported, although the servers never
#: import Ray. Where another set carries the same version (the main set for vLLM 0.26, whose ipc
#: engine imports Ray) that real wheel is installed, at no extra size; otherwise a wheel of its
#: metadata only, whose module is absent, so anything that does import it fails plainly.
METADATA_ONLY: dict[str, str] = {
    "ray": "nemo_gym.global_config reads ray's version at import; the video servers never import ray",
}

#: Installed without their dependencies (what they need at import is in the image or the vLLM set).
TRAINER_NO_DEPS: dict[str, str] = {"megatron-core": "0.19.2", "megatron-bridge": "0.6.2"}
#: Resolved with their dependencies into the main set; versions from ``envs/main/uv.lock`` where it has them.
TRAINER_PINS: dict[str, str] = {"av": "19.0.2", "omegaconf": "2.4.0"}

#: Ray for the main set where vLLM's ``ipc`` engine imports it (see
#: :func:`vllm_video_plugin.compat.ipc_engine_imports_ray`); ``envs/main/uv.lock``'s version first.
RAY_FALLBACK = "2.60.0"

NEMO_GYM = "nemo-gym==0.7.0"
#: Published as source only at the version Gym's dependencies pin (hydra-core 1.3: antlr4 4.9.*):
#: built into a wheel on the build machine (pure Python), so the host installs it like the rest.
SOURCE_ONLY: dict[str, str] = {"antlr4-python3-runtime": "4.9.3"}
FA2_LIBRARY = "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"


@dataclass(frozen=True)
class HostSpec:
    """The GPU host a wheelhouse is for."""

    python: str  # "3.12"
    torch: str  # the image's torch, e.g. "2.11.0" or "2.11.0+cu130"
    image_packages: frozenset[str]  # canonical names of what the image already has
    gpu_arch: str = "hopper"
    arch: str = "x86_64"
    glibc: str = "2.34"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d+", self.python):
            raise ValueError(f"--python {self.python!r}: give MAJOR.MINOR, e.g. 3.12")

    @property
    def torch_release(self) -> str:
        return self.torch.split("+")[0]

    def platforms(self) -> list[str]:
        """Every manylinux tag the host's glibc accepts, newest first."""
        major, minor = (int(x) for x in self.glibc.split("."))
        tags = [f"manylinux_{major}_{m}_{self.arch}" for m in range(minor, 4, -1)]
        legacy = {"2_17": "manylinux2014", "2_12": "manylinux2010", "2_5": "manylinux1"}
        tags += [f"{name}_{self.arch}" for glibc, name in legacy.items() if f"_{glibc}_" in "".join(tags)]
        return tags

    def pip_target(self) -> list[str]:
        """``pip`` options that select wheels for this host rather than for the machine running pip."""
        args = ["--only-binary=:all:", "--python-version", self.python, "--implementation", "cp"]
        for tag in self.platforms():
            args += ["--platform", tag]
        return args


def canonical_name(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_image_packages(path: Path) -> frozenset[str]:
    """Canonical names from a ``pip list``, ``pip freeze`` or one-name-a-line file (``#`` comments)."""
    names = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-") or line.lower().startswith("package "):
            continue
        names.add(canonical_name(re.split(r"[\s=<>!~@;\[]", line, maxsplit=1)[0]))
    if not names:
        raise ValueError(f"{path}: no package names in it (expected the image's `pip list`)")
    return frozenset(names)


def skip_reason(name: str, skip: dict[str, str]) -> str | None:
    """Why ``name`` is left out under ``skip`` (pattern -> reason), or None."""
    for pattern, reason in skip.items():
        if re.fullmatch(pattern, canonical_name(name)):
            return reason
    return None


def vllm_for_torch(torch: str, pins: dict[str, str] = VLLM_TORCH_PINS) -> str:
    """The newest vLLM release in ``pins`` whose CUDA wheel requires exactly this torch release."""
    release = torch.split("+")[0]
    matching = [v for v, pin in pins.items() if pin == release]
    if not matching:
        known = ", ".join(f"{v} -> torch {pin}" for v, pin in pins.items())
        raise LookupError(
            f"no vLLM release in the table pins torch {release} (known: {known}); pass --vllm VERSION "
            "for a release built for that torch"
        )
    return max(matching, key=lambda v: tuple(int(x) for x in v.split(".")))
