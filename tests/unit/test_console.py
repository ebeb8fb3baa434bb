"""``rl_bridge.console``: a library's warnings, log records and prints go to the run log, the
project's own lines to the console, in a fresh interpreter (logging is process-wide state)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = textwrap.dedent(
    """
    import logging, sys, warnings
    from pathlib import Path
    from rl_bridge import console

    console.capture()
    warnings.warn("Apex is not installed. Falling back to Torch Norm")  # before the run log exists
    logging.getLogger("megatron.core.early").info("early record")
    logging.getLogger("rl_bridge.loop").info("starting the roles")
    run_dir = Path(sys.argv[1])
    assert console.attach_run_log(run_dir) == run_dir / "logs" / "trainer.log"
    with console.stdout_to_run_log():
        print("Params for bucket 1")
        noisy = logging.getLogger("megatron.bridge.noisy")
        noisy.addHandler(logging.StreamHandler())  # a library's own console handler, made in here
        noisy.info("noisy record")
    noisy.info("after the block")
    logging.getLogger("rl_bridge.loop").warning("a problem of the project's")
    logging.getLogger("transformers.configuration_utils").warning("torch_dtype is deprecated")
    print("the summary")
    """
)


def test_library_output_goes_to_the_run_log_and_the_projects_lines_to_the_console(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stderr.splitlines() == [
        "[video-grpo] starting the roles",
        "[video-grpo] a problem of the project's",
    ]
    assert done.stdout == "the summary\n"
    log = (tmp_path / "logs" / "trainer.log").read_text()
    for line in (
        "Apex is not installed",  # held while no run log existed, then written
        "early record",
        "starting the roles",
        "Params for bucket 1",
        "noisy record",
        "after the block",
        "torch_dtype is deprecated",
    ):
        assert line in log, line
    assert log.count("after the block") == 1, "a library's own handler is taken over, not doubled"


def test_without_capture_nothing_changes(tmp_path: Path) -> None:
    from rl_bridge import console

    assert console.attach_run_log(tmp_path) is None
    with console.stdout_to_run_log():
        pass
    assert not (tmp_path / "logs").exists()
