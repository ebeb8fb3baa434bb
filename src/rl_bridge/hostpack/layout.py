"""The wheelhouse directory: its wheels (or their parts), ``manifest.json``, ``install.sh`` and
``hostcheck.py``."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from rl_bridge import hostcheck
from rl_bridge.hostpack.hosts import HostSpec
from rl_bridge.hostpack.wheels import repack_if_smaller, split_parts

__all__ = ["INSTALL_SH", "MANIFEST_FORMAT", "Wheel", "write_wheelhouse"]

LZMA_MIN_BYTES = 1 << 20  # smaller wheels are copied as they are
MANIFEST_FORMAT = 1


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
                futures[src] = pool.submit(repack_if_smaller, src, wheels_dir / src.name, tuple(members))
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

# 3. One venv per wheel set, over the image's site-packages; the image's pip installs into it. The
# sets are independent venvs, installed at once (each pip is one process); each set's lines are
# printed when it is done, and any failure fails the install.
install_set() {
  local set=$1 venv site imports module started=$SECONDS
  mapfile -t wheels < <(check wheels "$house" "$set" 2>/dev/null || true)
  [ "${#wheels[@]}" -gt 0 ] || return 0
  venv=$prefix/$set
  [ -x "$venv/bin/python" ] || "$python" -m venv --system-site-packages --without-pip "$venv"
  # An image whose Python is itself a venv (torch in /opt/torch/.venv, say): --system-site-packages
  # reaches only the base installation, so the image venv's site-packages go in a .pth file.
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  check image-site > "$site/_image_site.pth"
  echo "installing ${#wheels[@]} wheels into $venv"
  # --ignore-requires-python: nemo-gym declares a newer Python than it needs (the wheels were chosen
  # for this Python when the wheelhouse was built). pip byte-compiles in its one process, half its
  # time (main set on a 2-core CPU box: 52 s, 28 s with --no-compile); compileall does it on every
  # core instead (17 s there), so no run compiles at import, PYTHONDONTWRITEBYTECODE or not. Its
  # status is not checked: some wheels ship files that are not Python 3 (pip ignores them too).
  "$venv/bin/python" -m pip install --isolated --no-index --no-deps --ignore-requires-python \
    --disable-pip-version-check --no-compile --no-cache-dir -q "${wheels[@]}"
  "$venv/bin/python" -m compileall -q -j 0 "$site" > /dev/null 2>&1 || true
  echo "$set: ${#wheels[@]} wheels installed and compiled in $((SECONDS - started)) s"
  "$venv/bin/python" "$here/hostcheck.py" probe-torch > "$prefix/.torch-$set.json"
  check same-torch "$prefix/.torch-image.json" "$prefix/.torch-$set.json" \
    || die "installing into $venv changed torch (see above); remove $venv and report this"
  imports=$(check imports "$house" "$set")
  # One process for every module (vLLM's and Megatron's imports each load torch and its CUDA libraries).
  "$venv/bin/python" - $imports <<'PY' || die "$venv: an import failed (above)"
import importlib, sys, traceback
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"import {name} failed")
PY
  echo "$set: imports ok ($imports) in $((SECONDS - started)) s"
}
declare -A pids
for set in main gym; do
  install_set "$set" > "$prefix/.install-$set.log" 2>&1 &
  pids[$set]=$!
done
failed=""
for set in main gym; do
  if wait "${pids[$set]}"; then
    cat "$prefix/.install-$set.log"
  else
    failed="$failed $set"
    cat "$prefix/.install-$set.log" >&2
  fi
done
[ -z "$failed" ] || die "installing the wheel set(s)$failed failed (see above)"
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
