"""Checks that a wheelhouse's ``install.sh`` runs on the GPU host (standard library only).

``video-grpo wheelhouse build`` copies this file next to ``install.sh``, which runs it with the
host's Python before this package is installed there::

    python3 hostcheck.py probe-torch                  # {"version": ..., "path": ...} of the torch seen
    python3 hostcheck.py same-torch BEFORE AFTER      # exit 1, with the reason, if torch changed
    python3 hostcheck.py verify-parts WHEELHOUSE      # every part's sha256 against manifest.json
    python3 hostcheck.py verify WHEELHOUSE            # every wheel's sha256 against manifest.json
    python3 hostcheck.py wheels WHEELHOUSE SET        # the wheel paths of set ``main`` or ``gym``
    python3 hostcheck.py imports WHEELHOUSE SET       # the modules to import in set ``main`` or ``gym``
    python3 hostcheck.py info WHEELHOUSE KEY          # a host field of the manifest (python, torch)
    python3 hostcheck.py image-site                   # this Python's venv site-packages, if it is a venv

Torch counts as unchanged when the version and the resolved location of its ``__init__.py`` are
both the image's: a venv that shadows the image's torch with another build fails even when the
version strings match.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

__all__ = [
    "compare_torch",
    "manifest_wheels",
    "probe_torch",
    "sha256_file",
    "verify_parts",
    "venv_site_dirs",
    "verify_wheelhouse",
]

MANIFEST = "manifest.json"


def probe_torch() -> dict[str, str | None]:
    """The version and the resolved ``__init__.py`` location of the torch this interpreter imports,
    or ``None`` for both (with the error) when it has none."""
    try:
        import torch  # noqa: PLC0415 - the point is to see what this interpreter imports
    except Exception as error:  # noqa: BLE001 - report any failure to import as "no torch"
        return {"version": None, "path": None, "error": f"{type(error).__name__}: {error}"}
    return {"version": str(torch.__version__), "path": os.path.realpath(torch.__file__)}


def compare_torch(before: dict, after: dict) -> list[str]:
    """What differs between two :func:`probe_torch` results (empty: the same torch)."""
    problems = []
    if before.get("version") is None:
        problems.append(f"the image has no importable torch ({before.get('error', 'unknown error')})")
        return problems
    if after.get("version") is None:
        problems.append(f"torch no longer imports ({after.get('error', 'unknown error')})")
        return problems
    if before["version"] != after["version"]:
        problems.append(f"torch version {before['version']} became {after['version']}")
    if before.get("path") != after.get("path"):
        problems.append(f"torch is now imported from {after.get('path')}, not {before.get('path')}")
    return problems


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's content."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest(wheelhouse: Path) -> dict:
    return json.loads((wheelhouse / MANIFEST).read_text(encoding="utf-8"))


def manifest_wheels(manifest: dict, wheel_set: str) -> list[str]:
    """The wheel file names of ``wheel_set`` (``main`` or ``gym``), in manifest order."""
    sets = {name for wheel in manifest["wheels"] for name in wheel["sets"]}
    if wheel_set not in sets:
        raise KeyError(f"no wheel set {wheel_set!r} in the manifest; it has {', '.join(sorted(sets))}")
    return [wheel["file"] for wheel in manifest["wheels"] if wheel_set in wheel["sets"]]


def verify_parts(wheelhouse: Path) -> list[str]:
    """Every part of the manifest that is missing from ``wheelhouse`` or differs from its recorded
    sha256 (empty: all present and intact)."""
    problems = []
    for part in _manifest(wheelhouse)["parts"]:
        path = wheelhouse / part["file"]
        if not path.is_file():
            problems.append(f"{part['file']}: missing")
        elif sha256_file(path) != part["sha256"]:
            problems.append(f"{part['file']}: sha256 differs from the manifest's (damaged in transit?)")
    return problems


def verify_wheelhouse(wheelhouse: Path) -> list[str]:
    """Every wheel of the manifest that is missing from ``wheelhouse/wheels`` or differs from its
    recorded sha256 (empty: all present and intact)."""
    problems = []
    for wheel in _manifest(wheelhouse)["wheels"]:
        path = wheelhouse / "wheels" / wheel["file"]
        if not path.is_file():
            problems.append(f"{wheel['file']}: missing")
        elif sha256_file(path) != wheel["sha256"]:
            problems.append(f"{wheel['file']}: sha256 differs from the manifest's (damaged in transit?)")
    return problems


def venv_site_dirs() -> list[str]:
    """The site-packages of the venv this interpreter runs in (none outside a venv). Images often
    install torch into a venv (``/opt/torch/.venv``, say); a venv made from that interpreter with
    ``--system-site-packages`` reaches the base installation's packages, not the image venv's, so
    install.sh lists these in a ``.pth`` file of each venv it makes."""
    if sys.prefix == sys.base_prefix:
        return []
    import sysconfig

    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def main(argv: list[str]) -> int:
    command, *rest = argv or ["help"]
    if command == "probe-torch":
        print(json.dumps(probe_torch()))
        return 0
    if command == "same-torch":
        before, after = (json.loads(Path(p).read_text()) for p in rest)
        problems = compare_torch(before, after)
        for problem in problems:
            print(f"TORCH CHANGED: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if command in ("verify", "verify-parts"):
        problems = (verify_wheelhouse if command == "verify" else verify_parts)(Path(rest[0]))
        for problem in problems:
            print(f"BAD WHEEL: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if command == "wheels":
        wheelhouse = Path(rest[0])
        for name in manifest_wheels(_manifest(wheelhouse), rest[1]):
            print(wheelhouse / "wheels" / name)
        return 0
    if command == "imports":
        print(" ".join(_manifest(Path(rest[0]))["import_checks"][rest[1]]))
        return 0
    if command == "image-site":
        print("\n".join(venv_site_dirs()))
        return 0
    if command == "info":
        print(_manifest(Path(rest[0]))["host"][rest[1]])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
