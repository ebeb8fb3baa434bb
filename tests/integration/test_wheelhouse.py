"""install.sh of an offline wheelhouse (rl_bridge.hostpack), run end to end on tiny wheels: parts
joined and checked, two venvs over the base Python, torch left alone, imports checked, re-runnable."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rl_bridge.hostpack import HostSpec, Wheel, python_with_pip, write_wheelhouse
from tests.fixtures.wheels import make_wheel

pytestmark = pytest.mark.integration


def _base_python() -> str:
    try:
        return python_with_pip("3.12")[0]
    except FileNotFoundError:
        pytest.skip("no Python 3.12 with pip and venv here")


def test_wheelhouse_in_parts_installs_offline_into_two_venvs_and_keeps_torch(tmp_path: Path) -> None:
    python = _base_python()
    src = tmp_path / "src"
    src.mkdir()
    alpha = {"alpha/__init__.py": b"", "alpha/unused.py": b"", "alpha/fa2.so": b"x" * 100}
    files = [
        (make_wheel(src, "alpha", "1.0", alpha), ["main"]),
        (make_wheel(src, "beta", "2.0", {"beta/__init__.py": b""}), ["gym"]),
        (make_wheel(src, "shared", "0.1", {"shared/__init__.py": b""}), ["gym", "main"]),
    ]
    # The image's torch: a stand-in on PYTHONPATH, seen alike by the image's Python and both venvs.
    image = tmp_path / "image"
    (image / "torch").mkdir(parents=True)
    (image / "torch" / "__init__.py").write_text('__version__ = "2.11.0+fake"\n')
    host = HostSpec("3.12", "2.11.0", frozenset({"torch"}))
    out = tmp_path / "house"
    manifest = write_wheelhouse(
        out,
        host,
        [(path, Wheel(path.name, *path.name.split("-")[:2], sets)) for path, sets in files],
        drop={"alpha-1.0": ("alpha/fa2.so",)},
        part_mib=1,
        jobs=1,
        import_checks={"main": ["alpha", "shared"], "gym": ["beta", "shared"]},
        log=lambda _: None,
    )
    assert [p["file"] for p in manifest["parts"]] == ["wheels.tar.000"] and not (out / "wheels").exists()
    assert manifest["wheels"][0]["note"].startswith("without alpha/fa2.so")

    env = {**os.environ, "PYTHON": python, "PYTHONPATH": str(image), "PYTHONDONTWRITEBYTECODE": "1"}
    prefix = tmp_path / "prefix"
    for _ in range(2):  # idempotent
        run = subprocess.run(
            [out / "install.sh", prefix], capture_output=True, text=True, env=env, timeout=120, check=False
        )
        assert run.returncode == 0, run.stdout + run.stderr
    assert f"export VIDEO_GRPO_GYM_PYTHON={prefix}/gym/bin/python" in run.stdout
    assert "main: imports ok (alpha shared)" in run.stdout and "gym: imports ok (beta shared)" in run.stdout
    probe = json.loads((prefix / ".torch-main.json").read_text())
    assert probe == {"version": "2.11.0+fake", "path": str((image / "torch" / "__init__.py").resolve())}
    main_site = next((prefix / "main" / "lib").glob("python3.12/site-packages"))
    assert (main_site / "alpha").is_dir() and not (main_site / "alpha" / "fa2.so").exists()
    # Every module compiled at install (compileall on every core, not pip's one process), even the
    # ones no check imports and with PYTHONDONTWRITEBYTECODE set (below): no run compiles at import.
    compiled = {path.name.split(".")[0] for path in (main_site / "alpha").glob("__pycache__/*.pyc")}
    assert compiled == {"__init__", "unused"}, compiled
    assert not (main_site / "beta").exists() and not (prefix / ".wheelhouse").exists()

    # A damaged part is refused before anything is installed.
    part = out / "wheels.tar.000"
    data = bytearray(part.read_bytes())
    data[len(data) // 3] ^= 0xFF
    part.write_bytes(bytes(data))
    run = subprocess.run(
        [out / "install.sh", tmp_path / "p2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert run.returncode != 0 and "damaged" in run.stderr


def test_install_sees_the_torch_of_an_image_whose_python_is_a_venv(tmp_path: Path) -> None:
    """Images often keep torch in a venv (the H200's: ``/opt/torch/.venv``). A venv made from that
    Python with ``--system-site-packages`` reaches only the base installation, where there is no
    torch: install.sh must list the image venv's site-packages in each venv it makes."""
    python = _base_python()
    image = tmp_path / "image-venv"
    subprocess.run([python, "-m", "venv", image], check=True, timeout=120)
    site = subprocess.run(
        [image / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "torch").mkdir()
    (Path(site) / "torch" / "__init__.py").write_text('__version__ = "2.11.0+venv"\n')
    src = tmp_path / "src"
    src.mkdir()
    wheel = make_wheel(src, "alpha", "1.0", {"alpha/__init__.py": b"import torch\n"})
    out = tmp_path / "house"
    write_wheelhouse(
        out,
        HostSpec("3.12", "2.11.0", frozenset({"torch"})),
        [(wheel, Wheel(wheel.name, "alpha", "1.0", ["main"]))],
        jobs=1,
        import_checks={"main": ["alpha", "torch"], "gym": []},
        log=lambda _: None,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    prefix = tmp_path / "prefix"
    run = subprocess.run(
        [out / "install.sh", prefix], capture_output=True, text=True, timeout=120, check=False,
        env={**env, "PYTHON": str(image / "bin" / "python")},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "main: imports ok (alpha torch)" in run.stdout
    probe = json.loads((prefix / ".torch-main.json").read_text())
    assert probe == {"version": "2.11.0+venv", "path": str((Path(site) / "torch" / "__init__.py").resolve())}


def test_the_wheel_sets_install_at_once_and_a_failing_set_fails_the_install(tmp_path: Path) -> None:
    """main and gym install concurrently; a set whose import check fails fails install.sh, naming
    the set and the module, and the other set still prints its own lines."""
    python = _base_python()
    src = tmp_path / "src"
    src.mkdir()
    alpha = make_wheel(src, "alpha", "1.0", {"alpha/__init__.py": b""})
    beta = make_wheel(src, "beta", "2.0", {"beta/__init__.py": b"raise ImportError('beta is broken')\n"})
    image = tmp_path / "image"
    (image / "torch").mkdir(parents=True)
    (image / "torch" / "__init__.py").write_text('__version__ = "2.11.0+fake"\n')
    out = tmp_path / "house"
    write_wheelhouse(
        out,
        HostSpec("3.12", "2.11.0", frozenset({"torch"})),
        [
            (alpha, Wheel(alpha.name, "alpha", "1.0", ["main"])),
            (beta, Wheel(beta.name, "beta", "2.0", ["gym"])),
        ],
        jobs=1,
        import_checks={"main": ["alpha"], "gym": ["beta"]},
        log=lambda _: None,
    )
    env = {**os.environ, "PYTHON": python, "PYTHONPATH": str(image)}
    run = subprocess.run(
        [out / "install.sh", tmp_path / "prefix"], capture_output=True, text=True, env=env, timeout=120,
        check=False,
    )  # fmt: skip
    assert run.returncode != 0, run.stdout + run.stderr
    assert "main: imports ok (alpha)" in run.stdout
    assert "import beta failed" in run.stderr and "wheel set(s) gym failed" in run.stderr, run.stderr
    assert "Installed." not in run.stdout
