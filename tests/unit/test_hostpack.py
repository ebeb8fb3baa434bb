"""Offline wheelhouses (rl_bridge.hostpack, rl_bridge.hostcheck): the vLLM-for-torch table, what is
left out, wheel repacking, parts and the torch check (install.sh: tests/integration/test_wheelhouse.py)."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import zipfile
from collections.abc import Iterable
from pathlib import Path

import pytest

from rl_bridge import hostcheck
from rl_bridge.hostpack import (
    GYM_SKIP,
    MAIN_SKIP,
    HostSpec,
    placeholder_wheel,
    read_image_packages,
    repack_wheel,
    skip_reason,
    split_parts,
    vllm_for_torch,
)
from rl_bridge.hostpack.build import _lock_pins, _Plan, _select
from tests.fixtures.wheels import make_wheel

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------- release table


@pytest.mark.parametrize(
    ("torch", "release"),
    [("2.11.0", "0.26.0"), ("2.11.0+cu130", "0.26.0"), ("2.13.0+cu128", "0.32.0"), ("2.14.0", "0.33.0")],
)
def test_vllm_for_torch_takes_the_newest_release_that_pins_that_torch(torch: str, release: str) -> None:
    assert vllm_for_torch(torch) == release


def test_vllm_for_torch_without_a_release_names_the_table_and_the_override() -> None:
    with pytest.raises(LookupError, match=r"torch 2\.12\.0.*0\.26\.0 -> torch 2\.11\.0.*--vllm"):
        vllm_for_torch("2.12.0")


def test_vllm_for_torch_compares_versions_numerically() -> None:
    assert vllm_for_torch("2.13.0", {"0.9.0": "2.13.0", "0.10.0": "2.13.0"}) == "0.10.0"


# ----------------------------------------------------------------------------- what is left out


@pytest.mark.parametrize(
    ("name", "skipped"),
    [
        ("tokenspeed-mla", True),
        ("TileLang", True),
        ("nvidia_cublas_cu12", True),
        ("nvidia-cutlass-dsl-libs-cu13", True),
        ("PyNvVideoCodec", True),
        ("flashinfer-python", False),  # vLLM 0.26's sampler imports it at engine start
        ("nvidia-cublas", False),  # the CUDA 13 name
        ("nvidia-cutlass-dsl", True),  # all of it: without a CUDA-flavour library flashinfer's import raises
        ("nvidia-cutlass-dsl-libs-base", True),
        ("xgrammar", False),
    ],
)
def test_main_skip_list(name: str, skipped: bool) -> None:
    assert (skip_reason(name, MAIN_SKIP) is not None) is skipped


@pytest.mark.parametrize(
    ("name", "skipped"),
    [("ray", True), ("mlflow-skinny", True), ("SQLAlchemy", True), ("rayon", False), ("wandb", False)],
)
def test_gym_skip_list_leaves_out_only_what_the_servers_never_import(name: str, skipped: bool) -> None:
    assert (skip_reason(name, GYM_SKIP) is not None) is skipped


def test_select_never_takes_torch_drops_the_image_silently_and_records_skips() -> None:
    host = HostSpec("3.12", "2.11.0", frozenset({"numpy", "transformers"}))
    plan = _Plan()
    resolved = [("torch", "2.11.0"), ("numpy", "2.3.0"), ("tilelang", "0.1.9"), ("xgrammar", "0.2.1")]
    _select(plan, "main", resolved, host, MAIN_SKIP)
    assert plan.sets["main"] == [("xgrammar", "0.2.1")]
    assert [(s["name"], s["set"]) for s in plan.skipped] == [("torch", "main"), ("tilelang", "main")]
    assert "never replaced" in plan.skipped[0]["reason"]
    assert plan.from_image == {"main": ["numpy==2.3.0"]}


def test_read_image_packages_takes_pip_list_freeze_and_plain_names(tmp_path: Path) -> None:
    listing = tmp_path / "image.txt"
    listing.write_text(
        "# the image\nPackage    Version\n---------- -------\nTyping_Extensions 4.12.0\n"
        "torch==2.11.0+cu130\nnvidia-cudnn-cu13\nfoo.bar[extra]>=1\n"
    )
    assert read_image_packages(listing) == {"typing-extensions", "torch", "nvidia-cudnn-cu13", "foo-bar"}
    listing.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no package names"):
        read_image_packages(listing)


def test_host_platforms_cover_every_manylinux_tag_up_to_its_glibc() -> None:
    tags = HostSpec("3.12", "2.11.0", frozenset()).platforms()
    assert tags[0] == "manylinux_2_34_x86_64"
    assert {"manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_35_x86_64" not in tags
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        HostSpec("3.12.1", "2.11.0", frozenset())


def test_lock_pins_read_uv_lock_and_hashed_requirements(tmp_path: Path) -> None:
    (tmp_path / "uv.lock").write_text('[[package]]\nname = "Megatron_Core"\nversion = "0.19.2"\n')
    (tmp_path / "req.lock").write_text("orjson==3.13.0 \\\n    --hash=sha256:00\n    # via nemo-gym\n")
    assert _lock_pins(tmp_path / "uv.lock") == {"megatron-core": "0.19.2"}
    assert _lock_pins(tmp_path / "req.lock") == {"orjson": "3.13.0"}
    assert _lock_pins(tmp_path / "absent") == {}


# ---------------------------------------------------------------------------- wheels and parts


def test_repack_wheel_drops_a_member_rewrites_record_and_uses_lzma(tmp_path: Path) -> None:
    src = make_wheel(tmp_path, "pkg", "1.0", {"pkg/__init__.py": b"x = 1\n", "pkg/big.so": b"\0" * 4096})
    dst = tmp_path / "out" / src.name
    dst.parent.mkdir()
    repack_wheel(src, dst, drop=["pkg/big.so"])
    with zipfile.ZipFile(dst) as zf:
        assert "pkg/big.so" not in zf.namelist()
        assert {info.compress_type for info in zf.infolist()} == {zipfile.ZIP_LZMA}
        record = zf.read("pkg-1.0.dist-info/RECORD").decode()
        assert "pkg/big.so" not in record and "pkg/__init__.py,sha256=" in record
        assert zf.read("pkg/__init__.py") == b"x = 1\n"
    with pytest.raises(FileNotFoundError, match="has no pkg/absent"):
        repack_wheel(src, dst, drop=["pkg/absent"])


def test_placeholder_wheel_holds_metadata_only(tmp_path: Path) -> None:
    wheel = placeholder_wheel(tmp_path, "ray", "2.60.0", "read at import, never imported")
    assert wheel.name == "ray-2.60.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        assert all(name.startswith("ray-2.60.0.dist-info/") for name in zf.namelist())
        zf.extractall(tmp_path / "site")
    (dist,) = metadata.distributions(path=[str(tmp_path / "site")])
    assert dist.version == "2.60.0" and "Metadata only" in dist.metadata["Summary"]


def join_parts(parts: Iterable[Path], dst: Path) -> Path:
    """Concatenate ``parts`` in name order into ``dst``, as install.sh does (``cat wheels.tar.NNN``)."""
    dst.write_bytes(b"".join(part.read_bytes() for part in sorted(parts)))
    return dst


def test_split_and_join_parts_round_trip(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    whole = tmp_path / "wheels.tar"
    whole.write_bytes(data)
    parts = split_parts(whole, 3_000)
    assert [p.name for p in parts] == [f"wheels.tar.{i:03d}" for i in range(4)]
    assert [p.stat().st_size for p in parts] == [3_000, 3_000, 3_000, 1_000] and not whole.exists()
    assert join_parts(reversed(parts), tmp_path / "joined").read_bytes() == data


# ---------------------------------------------------------------------------------- torch check


def test_compare_torch_same_version_and_location_is_unchanged() -> None:
    probe = {"version": "2.11.0+cu130", "path": "/usr/lib/python3/site-packages/torch/__init__.py"}
    assert hostcheck.compare_torch(probe, dict(probe)) == []


@pytest.mark.parametrize(
    ("after", "message"),
    [
        ({"version": "2.13.0", "path": "/image/torch/__init__.py"}, "2.11.0 became 2.13.0"),
        ({"version": "2.11.0", "path": "/venv/torch/__init__.py"}, "imported from /venv"),
        ({"version": None, "path": None, "error": "ImportError: x"}, "no longer imports"),
    ],
)
def test_compare_torch_reports_a_replaced_or_shadowed_torch(after: dict, message: str) -> None:
    before = {"version": "2.11.0", "path": "/image/torch/__init__.py"}
    problems = hostcheck.compare_torch(before, after)
    assert len(problems) == 1 and message in problems[0]


def test_compare_torch_needs_an_image_torch() -> None:
    assert "no importable torch" in hostcheck.compare_torch({"version": None}, {"version": None})[0]


def test_manifest_wheels_by_set() -> None:
    manifest = {"wheels": [{"file": "a.whl", "sets": ["main"]}, {"file": "b.whl", "sets": ["gym", "main"]}]}
    assert hostcheck.manifest_wheels(manifest, "main") == ["a.whl", "b.whl"]
    assert hostcheck.manifest_wheels(manifest, "gym") == ["b.whl"]
    with pytest.raises(KeyError, match="has gym, main"):
        hostcheck.manifest_wheels(manifest, "trainer")
