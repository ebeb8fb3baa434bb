"""``video-grpo train``'s process set-up, before any heavy import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rl_bridge.cli import OPENMP_WAIT_POLICY

pytestmark = pytest.mark.unit

# Stops the process at its first ``import torch``, printing the OpenMP wait policy it would load with.
_SPY = """
import os, sys
class TorchImportSpy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("OMP_WAIT_POLICY at the first torch import:", os.environ.get("OMP_WAIT_POLICY"), flush=True)
            os._exit(0)
        return None
sys.meta_path.insert(0, TorchImportSpy())
from rl_bridge.cli import main
main(["train"])
"""


@pytest.mark.parametrize(("given", "expected"), [(None, OPENMP_WAIT_POLICY), ("ACTIVE", "ACTIVE")])
def test_train_sets_the_openmp_wait_policy_before_torch_loads_unless_the_user_did(
    given: str | None, expected: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    done = subprocess.run([sys.executable, "-c", _SPY], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"OMP_WAIT_POLICY at the first torch import: {expected}"
