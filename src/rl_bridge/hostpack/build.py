"""Building a wheelhouse: pip resolves each wheel set for the host, the tables of :mod:`.hosts` pick
what is kept, pip downloads it, and :func:`~rl_bridge.hostpack.layout.write_wheelhouse` lays it out."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rl_bridge import hostcheck
from rl_bridge.hostpack.hosts import (
    FA2_LIBRARY,
    GYM_SKIP,
    MAIN_SKIP,
    METADATA_ONLY,
    NEMO_GYM,
    RAY_FALLBACK,
    SOURCE_ONLY,
    TORCH_FAMILY,
    TRAINER_NO_DEPS,
    TRAINER_PINS,
    VLLM_TORCH_PINS,
    HostSpec,
    canonical_name,
    skip_reason,
    vllm_for_torch,
)
from rl_bridge.hostpack.layout import Wheel, write_wheelhouse
from rl_bridge.hostpack.wheels import placeholder_wheel
from vllm_video_plugin.compat import ipc_engine_imports_ray

__all__ = ["build_wheelhouse", "python_with_pip"]


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
