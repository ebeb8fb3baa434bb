"""The torchrun launcher's argument handling: rank environment parsing and layout checks.

The multi-rank path itself (gloo, TP = 2) runs in tests/integration/test_megatron_tp.py.
"""

from __future__ import annotations

import pytest
import torch

from rl_bridge.megatron.distributed import RankEnvironment, model_parallel_group

pytestmark = pytest.mark.unit

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "10.0.0.2",
    "MASTER_PORT": "29500",
}


def test_rank_environment_reads_torchrun_variables() -> None:
    assert RankEnvironment.from_environ(TORCHRUN) == RankEnvironment(
        rank=3, world_size=4, local_rank=1, master_addr="10.0.0.2", master_port=29500
    )


def test_rank_environment_names_missing_variables_and_the_launcher() -> None:
    environ = {name: value for name, value in TORCHRUN.items() if name not in ("RANK", "MASTER_PORT")}
    with pytest.raises(RuntimeError, match=r"RANK, MASTER_PORT not set; start the process with torchrun"):
        RankEnvironment.from_environ(environ)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"WORLD_SIZE": "four"}, r"WORLD_SIZE='four' is not an integer"),
        ({"RANK": "4"}, r"rank 4 is not in \[0, world size 4\)"),
        ({"MASTER_PORT": "70000"}, r"master_port 70000 is not in \[1, 65535\]"),
    ],
)
def test_rank_environment_rejects_bad_values(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RankEnvironment.from_environ({**TORCHRUN, **overrides})


def test_only_a_single_process_may_go_without_a_rendezvous() -> None:
    assert RankEnvironment.single_process() == RankEnvironment(0, 1, 0, None, None)
    with pytest.raises(ValueError, match="world size 2 needs master_addr and master_port"):
        RankEnvironment(rank=0, world_size=2, local_rank=0, master_addr=None, master_port=None)
    with pytest.raises(ValueError, match="both set or both None"):
        RankEnvironment(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=None)


def test_tensor_parallel_size_must_divide_the_world_before_anything_starts() -> None:
    environment = RankEnvironment.from_environ({**TORCHRUN, "WORLD_SIZE": "6", "RANK": "0"})
    with pytest.raises(
        ValueError, match="tensor_parallel=4 x pipeline_parallel=1 does not divide the world size 6"
    ):
        with model_parallel_group(tensor_parallel=4, environment=environment):
            pass
    with pytest.raises(ValueError, match="backend='mpi'"):
        with model_parallel_group(tensor_parallel=2, backend="mpi", environment=environment):
            pass
    assert not torch.distributed.is_initialized()


def test_an_existing_process_group_is_refused() -> None:
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already initialised .*backend gloo, world size 1"):
            with model_parallel_group(environment=RankEnvironment.single_process()):
                pass
    finally:
        torch.distributed.destroy_process_group()
