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
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rl_bridge import hostcheck
from vllm_video_plugin.compat import ipc_engine_imports_ray

__all__ = [
    "GYM_SKIP",
    "MAIN_SKIP",
    "METADATA_ONLY",
    "VLLM_TORCH_PINS",
    "HostSpec",
    "Wheel",
    "build_wheelhouse",
    "canonical_name",
    "join_parts",
    "placeholder_wheel",
    "python_with_pip",
    "read_image_packages",
    "repack_wheel",
    "skip_reason",
    "split_parts",
    "vllm_for_torch",
    "write_wheelhouse",
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
    r"nvidia-cutlass-dsl-libs-cu1[23]": "CuTe DSL kernel libraries (FlashAttention-4 and quack kernels)",
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
LZMA_MIN_BYTES = 1 << 20  # smaller wheels are copied as they are
MANIFEST_FORMAT = 1


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


@dataclass
class Wheel:
    """One wheel of a wheelhouse."""

    file: str
    name: str
    version: str
    sets: list[str]
    sha256: str = ""
    size: int = 0
    note: str = ""  # how it differs from the index's wheel, if it does
    index_sha256: str = ""  # the index's wheel, when this one was repacked


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


# --------------------------------------------------------------------------------------- wheels


def repack_wheel(src: Path, dst: Path, drop: Sequence[str] = ()) -> None:
    """Copy wheel ``src`` to ``dst`` with every member LZMA-compressed and ``drop`` left out.

    The RECORD loses the dropped files' lines; the other lines stay valid (their content is
    unchanged), so ``dst`` is a wheel that pip installs (zipfile reads LZMA members).
    """
    dropped = set(drop)
    with zipfile.ZipFile(src) as zin:
        missing = dropped - set(zin.namelist())
        if missing:
            raise FileNotFoundError(f"{src.name} has no {', '.join(sorted(missing))}")
        with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_LZMA) as zout:
            for info in zin.infolist():
                if info.filename in dropped:
                    continue
                data = zin.read(info)
                if info.filename.endswith(".dist-info/RECORD") and dropped:
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(ln for ln in lines if ln.split(",", 1)[0] not in dropped).encode()
                out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                out.external_attr = info.external_attr
                out.compress_type = zipfile.ZIP_LZMA
                zout.writestr(out, data)


def placeholder_wheel(directory: Path, name: str, version: str, why: str) -> Path:
    """A wheel of ``name``'s metadata only (no modules): it satisfies ``importlib.metadata``
    lookups of a package that is deliberately not installed."""
    directory.mkdir(parents=True, exist_ok=True)
    dist_info = f"{name.replace('-', '_')}-{version}.dist-info"
    summary = f"Metadata only, not {name} itself (video-grpo wheelhouse): {why}"
    members = {
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        f"Summary: {summary}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: video-grpo\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = [f"{path},sha256={_record_hash(d.encode())},{len(d.encode())}" for path, d in members.items()]
    members[f"{dist_info}/RECORD"] = "\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n"
    path = directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for member, data in members.items():
            zf.writestr(member, data)
    return path


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _repack_if_smaller(src: Path, dst: Path, drop: tuple[str, ...]) -> bool:
    """Repack ``src`` into ``dst``; keep it only if dropping or LZMA made it at least 5% smaller."""
    repack_wheel(src, dst, drop)
    if drop or dst.stat().st_size < 0.95 * src.stat().st_size:
        return True
    dst.unlink()
    return False


def split_parts(path: Path, part_bytes: int) -> list[Path]:
    """Split ``path`` into ``path.000``, ``path.001``, ... of at most ``part_bytes`` each; remove it."""
    parts = []
    with open(path, "rb") as whole:
        while block := whole.read(part_bytes):
            part = path.with_name(f"{path.name}.{len(parts):03d}")
            part.write_bytes(block)
            parts.append(part)
    path.unlink()
    return parts


def join_parts(parts: Iterable[Path], dst: Path) -> Path:
    """Concatenate ``parts`` (in name order) into ``dst``: the inverse of :func:`split_parts`."""
    with open(dst, "wb") as whole:
        for part in sorted(parts):
            with open(part, "rb") as handle:
                shutil.copyfileobj(handle, whole, 1 << 20)
    return dst


# ------------------------------------------------------------------------------------ resolution


def _pip(pip: Sequence[str], *args: str, quiet: bool = True) -> None:
    cmd = [*pip, *args, *(["-q"] if quiet else [])]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed:\n{result.stdout[-3000:]}{result.stderr[-6000:]}")


def _resolve(
    pip: Sequence[str],
    host: HostSpec,
    requirements: Sequence[str],
    work: Path,
    tag: str,
    constraints: Sequence[str] = (),
    ignore_requires_python: bool = False,
) -> list[tuple[str, str]]:
    """``(name, version)`` of every distribution pip installs for ``requirements`` on the host."""
    req = work / f"{tag}-requirements.txt"
    req.write_text("\n".join(requirements) + "\n")
    con = work / f"{tag}-constraints.txt"
    con.write_text("\n".join(constraints) + "\n")
    report = work / f"{tag}-report.json"
    extra = ["--ignore-requires-python"] if ignore_requires_python else []
    extra += ["--find-links", str(work / "local")]
    _pip(
        pip, "install", "--dry-run", "--ignore-installed", *host.pip_target(), *extra,
        "--target", str(work / f"{tag}-target"), "--report", str(report), "-r", str(req), "-c", str(con),
    )  # fmt: skip
    items = json.loads(report.read_text())["install"]
    return [(canonical_name(i["metadata"]["name"]), i["metadata"]["version"]) for i in items]


def _lock_pins(path: Path) -> dict[str, str]:
    """``name -> version`` from a ``uv.lock`` or a hashed ``requirements.lock``; empty if absent."""
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8")
    pins = dict(re.findall(r'^name = "([^"]+)"\nversion = "([^"]+)"', text, flags=re.M))
    pins.update(re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", text, flags=re.M))
    return {canonical_name(k): v for k, v in pins.items()}


def python_with_pip(python: str) -> list[str]:
    """A pip running on the host's Python version: this interpreter's, else ``pythonX.Y`` on PATH or in pyenv.

    pip checks ``Requires-Python`` against the interpreter it runs on even with ``--python-version``,
    so a pip on another Python resolves some packages wrongly or not at all.
    """
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = [str(p) for p in sorted(pyenv.glob(f"{python}.*/bin/python{python}"), reverse=True)]
    for candidate in (sys.executable, shutil.which(f"python{python}"), *found):
        if candidate is None:
            continue
        probe = subprocess.run(
            [candidate, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == python:
            return [candidate, "-m", "pip"]
    raise FileNotFoundError(
        f"no Python {python} with pip here: install one, or pass --pip-python with a Python {python} "
        "that has pip"
    )


def _own_requirements(wheel: Path) -> list[str]:
    """This package's base ``Requires-Dist`` (no extras), read from its wheel."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(name).decode().splitlines()
    return [ln.split(": ", 1)[1] for ln in lines if ln.startswith("Requires-Dist: ") and "extra ==" not in ln]


@dataclass
class _Plan:
    """What the resolutions chose: per set, ``(name, version)`` to download, and what was left out."""

    sets: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    from_image: dict[str, list[str]] = field(default_factory=dict)  # resolved, but the image has it
    no_deps: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)


def _select(
    plan: _Plan, wheel_set: str, resolved: list[tuple[str, str]], host: HostSpec, skip: dict[str, str]
) -> None:
    chosen = []
    plan.from_image[wheel_set] = []
    for name, version in resolved:
        if name in TORCH_FAMILY:
            reason = "the image's torch is used (never replaced)"
        elif name in host.image_packages:
            reason = "in the image"
        else:
            reason = skip_reason(name, skip)
        if reason is None:
            chosen.append((name, version))
        elif reason == "in the image":
            plan.from_image[wheel_set].append(f"{name}=={version}")
        else:
            plan.skipped.append({"set": wheel_set, "name": name, "version": version, "reason": reason})
    plan.sets[wheel_set] = chosen


# ----------------------------------------------------------------------------------------- build


def build_wheelhouse(
    out: Path,
    host: HostSpec,
    *,
    project: Path,
    vllm: str | None = None,
    with_vllm: bool = True,
    with_gym: bool = True,
    part_mib: int = 0,
    pip: Sequence[str] | None = None,
    jobs: int = 2,
    log=print,
) -> dict:
    """Download, resolve and repack everything ``host`` needs into ``out``; return the manifest.

    ``vllm`` overrides the release chosen from :data:`VLLM_TORCH_PINS`.
    """
    pip = list(pip) if pip else python_with_pip(host.python)
    release = vllm or (vllm_for_torch(host.torch) if with_vllm else None)
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    main_pins = _lock_pins(project / "envs" / "main" / "uv.lock")
    gym_pins = _lock_pins(project / "envs" / "gym" / "requirements.lock")
    with tempfile.TemporaryDirectory(prefix="wheelhouse-", dir=out) as tmp:
        work = Path(tmp)
        downloads = work / "downloads"
        downloads.mkdir()
        log(f"building this package's wheel from {project}")
        _pip(pip, "wheel", "--no-deps", "-w", str(work / "own"), str(project))
        own = next((work / "own").glob("*.whl"))
        own_reqs = _own_requirements(own)
        local = work / "local"
        for name, version in SOURCE_ONLY.items():
            log(f"building {name}=={version} from source (no wheel on the index)")
            _pip(pip, "wheel", "--no-deps", "--no-binary", name, "-w", str(local), f"{name}=={version}")

        plan = _Plan()
        torch_pin = f"torch=={host.torch_release}"
        trainer = [f"{n}=={main_pins.get(n, v)}" for n, v in TRAINER_PINS.items()]
        main_reqs = [*own_reqs, *trainer] + ([f"vllm=={release}"] if release else [])
        if release and ipc_engine_imports_ray(release):  # the colocated refit's engine needs it there
            main_reqs.append(f"ray=={main_pins.get('ray', RAY_FALLBACK)}")
        log(f"resolving the main set for Python {host.python}: {', '.join(main_reqs[-3:])} ...")
        _select(plan, "main", _resolve(pip, host, main_reqs, work, "main", [torch_pin]), host, MAIN_SKIP)
        plan.no_deps = [(n, main_pins.get(n, v)) for n, v in TRAINER_NO_DEPS.items()]
        if with_gym:
            log(f"resolving the Gym set ({NEMO_GYM}) for Python {host.python}, ignoring its Requires-Python")
            gym_reqs = [NEMO_GYM, *own_reqs]
            pins = [f"{n}=={v}" for n, v in gym_pins.items() if n not in TORCH_FAMILY and n != "nemo-gym"]
            try:
                resolved = _resolve(pip, host, gym_reqs, work, "gym", [*pins, torch_pin], True)
            except RuntimeError as error:  # a locked version without a wheel for this Python
                log(f"the Gym lock's versions do not resolve for Python {host.python}: {error}")
                log("resolving the Gym set without the lock's versions")
                resolved = _resolve(pip, host, gym_reqs, work, "gym", [torch_pin], True)
            _select(plan, "gym", resolved, host, GYM_SKIP)

        # One download per set: the sets may hold different versions of one package.
        for tag, wanted in [*plan.sets.items(), ("no-deps", plan.no_deps)]:
            log(f"downloading the {len(wanted)} wheels of {tag}")
            reqfile = work / f"{tag}-download.txt"
            reqfile.write_text("\n".join(f"{n}=={v}" for n, v in wanted) + "\n")
            gym_python = ["--ignore-requires-python"] if tag == "gym" else []
            _pip(
                pip, "download", "--no-deps", *host.pip_target(), *gym_python, "--find-links", str(local),
                "-d", str(downloads), "-r", str(reqfile),
            )  # fmt: skip
        shutil.copy(own, downloads)
        membership: dict[tuple[str, str], list[str]] = {}
        for wheel_set, chosen in plan.sets.items():
            for pv in chosen:
                membership.setdefault(pv, []).append(wheel_set)
        for pv in plan.no_deps:
            membership.setdefault(pv, []).append("main")
        own_name, own_version = _wheel_name_version(own.name)
        membership[(own_name, own_version)] = ["main", "gym"] if with_gym else ["main"]
        # A package left out of one set but needed by name (METADATA_ONLY): the real wheel when
        # another set carries the same version (it costs no bytes), else a wheel of its metadata.
        placeholders: dict[Path, list[str]] = {}
        for entry in list(plan.skipped):
            if entry["name"] not in METADATA_ONLY:
                continue
            key = (entry["name"], entry["version"])
            if key in membership:
                membership[key].append(entry["set"])
                plan.skipped.remove(entry)
                continue
            why = METADATA_ONLY[entry["name"]]
            path = placeholder_wheel(work / "placeholders", entry["name"], entry["version"], why)
            placeholders.setdefault(path, []).append(entry["set"])
            entry["reason"] += "; a wheel of its metadata only is installed instead"

        files = []
        for path in sorted(downloads.glob("*.whl")):
            name, version = _wheel_name_version(path.name)
            sets = membership.get((name, version))
            if sets is None:
                raise RuntimeError(f"pip downloaded {path.name}, which no resolution asked for")
            files.append((path, Wheel(path.name, name, version, sorted(set(sets)))))
        for path, sets in placeholders.items():
            name, version = _wheel_name_version(path.name)
            note = "metadata only: a placeholder, see skipped"
            files.append((path, Wheel(path.name, name, version, sorted(sets), note=note)))
        missing = set(membership) - {(w.name, w.version) for _, w in files}
        if missing:
            raise RuntimeError(f"no wheel downloaded for {sorted(missing)}")

        drop = {}
        if release and host.gpu_arch == "hopper":
            drop[f"vllm-{release}"] = (FA2_LIBRARY,)
        manifest = write_wheelhouse(
            out, host, files, drop=drop, skipped=plan.skipped, part_mib=part_mib, jobs=jobs, log=log,
            extra={
                "vllm": {
                    "release": release,
                    "chosen_by": "--vllm" if vllm else "torch pin table",
                    "torch_pins": VLLM_TORCH_PINS,
                    "removed": list(drop.get(f"vllm-{release}", ())),
                } if release else None,
                "installed_without_dependencies": [f"{n}=={v}" for n, v in plan.no_deps],
                # What the resolutions took from the image (by name; the image's versions are used).
                "from_image": plan.from_image,
                "nemo_gym": NEMO_GYM if with_gym else None,
            },
        )  # fmt: skip
    if (project / "recipes").is_dir():  # the host has no checkout: its recipes travel along
        shutil.copytree(project / "recipes", out / "recipes", dirs_exist_ok=True)
    manifest["build_seconds"] = round(time.monotonic() - started, 1)
    (out / hostcheck.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _wheel_name_version(filename: str) -> tuple[str, str]:
    name, version = filename.split("-")[:2]
    return canonical_name(name), version


def _import_checks(wheels: list[Wheel]) -> dict[str, list[str]]:
    names = {w.name for w in wheels}
    main = ["vllm_video_plugin", "rl_bridge", "gym_video_env"]
    if "vllm" in names:
        main.insert(0, "vllm")
    if "megatron-core" in names:
        main.append("megatron.core")
    gym = ["gym_video_env"]
    if "nemo-gym" in names:
        gym = [
            "nemo_gym",
            "responses_api_models.video_vllm_model.app",
            "responses_api_agents.video_tools_agent.app",
            "resources_servers.video_mcqa.app",
            "resources_servers.video_segments.app",
        ]
    return {"main": main, "gym": gym}


def write_wheelhouse(
    out: Path,
    host: HostSpec,
    files: list[tuple[Path, Wheel]],
    *,
    drop: dict[str, tuple[str, ...]] | None = None,
    skipped: list[dict[str, str]] = (),
    part_mib: int = 0,
    jobs: int = 2,
    extra: dict | None = None,
    import_checks: dict[str, list[str]] | None = None,
    log=print,
) -> dict:
    """Repack ``files`` into ``out/wheels`` and write the manifest, ``install.sh`` and
    ``hostcheck.py``; with ``part_mib``, pack the wheels into ``wheels.tar.NNN`` parts instead.

    ``drop`` maps a wheel file's ``name-version`` prefix to members left out of it.
    """
    drop = drop or {}
    wheels_dir = out / "wheels"
    if wheels_dir.exists():
        shutil.rmtree(wheels_dir)
    for old in out.glob("wheels.tar.*"):
        old.unlink()
    wheels_dir.mkdir(parents=True)

    log(f"repacking {len(files)} wheels with LZMA ({jobs} processes)")
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {}
        for src, wheel in files:
            members = next((m for prefix, m in drop.items() if src.name.startswith(prefix + "-")), ())
            if members or src.stat().st_size >= LZMA_MIN_BYTES:
                futures[src] = pool.submit(_repack_if_smaller, src, wheels_dir / src.name, tuple(members))
            if members:
                wheel.note = f"without {', '.join(members)}; "
        for src, wheel in files:
            repacked = src in futures and futures[src].result()
            if repacked:
                wheel.index_sha256 = hostcheck.sha256_file(src)
                wheel.note += "repacked with LZMA"
            else:
                shutil.copy2(src, wheels_dir / src.name)
            wheel.sha256 = hostcheck.sha256_file(wheels_dir / src.name)
            wheel.size = (wheels_dir / src.name).stat().st_size
    wheels = [w for _, w in files]

    def total(wheel_set: str | None = None) -> int:
        return sum(w.size for w in wheels if wheel_set is None or w.sets == [wheel_set])

    manifest = {
        "format": MANIFEST_FORMAT,
        "host": {
            "python": host.python,
            "torch": host.torch,
            "gpu_arch": host.gpu_arch,
            "platforms": host.platforms(),
            "image_packages": sorted(host.image_packages),
        },
        **(extra or {}),
        "import_checks": import_checks or _import_checks(wheels),
        "sizes": {
            "total": total(),
            "main_only": total("main"),
            "gym_only": total("gym"),
            "shared": total() - total("main") - total("gym"),
        },
        "wheels": [asdict(w) for w in wheels],
        "skipped": list(skipped),
        "parts": [],
    }
    (out / hostcheck.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.copy(hostcheck.__file__, out / "hostcheck.py")
    (out / "install.sh").write_text(INSTALL_SH)
    (out / "install.sh").chmod(0o755)
    if part_mib:
        tar = out / "wheels.tar"
        subprocess.run(["tar", "-cf", str(tar), "-C", str(out), "wheels"], check=True)
        shutil.rmtree(wheels_dir)
        parts = split_parts(tar, part_mib << 20)
        manifest["parts"] = [
            {"file": p.name, "sha256": hostcheck.sha256_file(p), "size": p.stat().st_size} for p in parts
        ]
        (out / hostcheck.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# The host has no video-grpo yet, so this is plain bash plus hostcheck.py (standard library only).
INSTALL_SH = r"""#!/usr/bin/env bash
# Install this wheelhouse on a GPU host whose image has Python and torch; no network needed.
#
#   ./install.sh PREFIX          (PYTHON=/path/to/python3 to use another interpreter of the image)
#
# Creates PREFIX/main (vLLM, trainer, video-grpo) and PREFIX/gym (NeMo Gym, video-grpo) as venvs
# that see the image's packages (--system-site-packages), installs the wheels with
# pip --no-index --no-deps, and fails if torch is not the image's afterwards. Safe to re-run.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix=${1:?usage: install.sh PREFIX}
mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
python=${PYTHON:-python3}
check() { "$python" "$here/hostcheck.py" "$@"; }
die() { echo "install.sh: $*" >&2; exit 1; }

want=$(check info "$here" python)
have=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$want" = "$have" ] || die "this wheelhouse is for Python $want; $python is $have (set PYTHON=...)"
"$python" -c 'import lzma, venv, pip' 2>/dev/null || die "$python lacks lzma, venv or pip"

# 1. The wheels: carried as they are, or as parts to join.
if [ -d "$here/wheels" ]; then
  house=$here
else
  house=$prefix/.wheelhouse
  rm -rf "$house" && mkdir -p "$house"
  check verify-parts "$here" || die "the parts are damaged or incomplete: carry them again"
  cat "$here"/wheels.tar.[0-9][0-9][0-9] | tar -xf - -C "$house"
  cp "$here/manifest.json" "$house/"
fi
check verify "$house" || die "the wheelhouse is damaged: carry the files again"

# 2. The image's torch, before anything is installed.
check probe-torch > "$prefix/.torch-image.json"
echo "image: Python $have, torch $(cat "$prefix/.torch-image.json")"

# 3. One venv per wheel set, over the image's site-packages; the image's pip installs into it.
for set in main gym; do
  mapfile -t wheels < <(check wheels "$house" "$set" 2>/dev/null || true)
  [ "${#wheels[@]}" -gt 0 ] || continue
  venv=$prefix/$set
  [ -x "$venv/bin/python" ] || "$python" -m venv --system-site-packages --without-pip "$venv"
  echo "installing ${#wheels[@]} wheels into $venv"
  # --ignore-requires-python: nemo-gym declares a newer Python than it needs (the wheels were chosen
  # for this Python when the wheelhouse was built).
  "$venv/bin/python" -m pip install --isolated --no-index --no-deps --ignore-requires-python \
    --disable-pip-version-check -q "${wheels[@]}"
  "$venv/bin/python" "$here/hostcheck.py" probe-torch > "$prefix/.torch-$set.json"
  check same-torch "$prefix/.torch-image.json" "$prefix/.torch-$set.json" \
    || die "installing into $venv changed torch (see above); remove $venv and report this"
  imports=$(check imports "$house" "$set")
  for module in $imports; do
    "$venv/bin/python" -c "import $module" || die "$venv: import $module failed"
  done
  echo "$set: imports ok ($imports)"
done
if [ -x "$prefix/gym/bin/gym" ]; then
  "$prefix/gym/bin/gym" --help > /dev/null || die "$prefix/gym: gym --help failed"
  echo "gym: gym --help ok"
fi
[ "$house" = "$here" ] || rm -rf "$house"

echo
echo "Installed. Add to your job's environment:"
[ -d "$prefix/gym" ] && echo "  export VIDEO_GRPO_GYM_PYTHON=$prefix/gym/bin/python"
echo "  export PATH=$prefix/main/bin:\$PATH     # video-grpo, and python with vLLM and the trainer"
echo "Then: video-grpo doctor; video-grpo train -r RECIPE"
"""
