"""Wheel files: LZMA repacking, metadata-only placeholders, and parts of a fixed size."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["placeholder_wheel", "repack_if_smaller", "repack_wheel", "split_parts"]


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


def repack_if_smaller(src: Path, dst: Path, drop: tuple[str, ...]) -> bool:
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
