"""The shipped async recipe through the CLI, from the command its header gives
(``video-grpo train -r recipes/tiny_cpu_async.yaml``), killed mid-way, resumed, and run until its
data ends.

One pass over 112 training rows, 32 groups per step (three steps of 32 and a last of 16) and a
checkpoint after every step: ``video-grpo train`` is SIGKILLed (with every server it started) once a
checkpoint appears, then ``video-grpo train --resume`` continues it. The resumed run must serve the
checkpoint's weight version right after the resume, train every row exactly once over both parts
(row ids in ``groups.jsonl``), end when the data runs out with exit code 0, and leave a final
checkpoint and summary. Over both parts the recipe must learn: held-out accuracy at the last step
far above the start, with vLLM's and the trainer's logprobs agreeing on the groups sampled with the
weights being trained.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from tests.fixtures.bad_inputs import FaultRecorder

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROWS, PROMPTS, GROUP = 112, 32, 8  # the recipe's 32 prompts x 8 samples
STEPS = -(-ROWS // PROMPTS)  # 3 x 32 + 16 groups
# As for the sync default (tests/integration/test_sync_loop.py): 48 held-out rows, a rise of 0.3 is
# over five standard errors of a start-to-end difference near chance (1/6).
LEARNING_MARGIN = 0.3


def _command(run_dir: Path, *extra: str) -> list[str]:
    from rl_bridge.paths import project_root

    return [
        sys.executable,
        "-m",
        "rl_bridge.cli",
        "train",
        "-r",
        str(project_root() / "recipes" / "tiny_cpu_async.yaml"),
        *extra,
        f"run_dir={run_dir}",
        f"task.train_rows={ROWS}",
        "train.steps=100",  # the data ends the run
        "async.epochs=1",
        "async.checkpoint_every=1",
    ]


def _kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process``'s group and the process groups of everything it started (the servers
    run in their own sessions, so killing the CLI's group alone would orphan them)."""
    children = psutil.Process(process.pid).children(recursive=True)
    os.killpg(process.pid, signal.SIGKILL)
    for child in children:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    process.wait(timeout=30)
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"processes survived the kill: {alive}"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("async")
    run_dir = root / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with (root / "first.log").open("wb") as log:
        first = subprocess.Popen(
            _command(run_dir), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 900
            while not list((run_dir / "checkpoints").glob("step-*/state.json")):
                log_tail = (root / "first.log").read_text(errors="replace")[-3000:]
                assert first.poll() is None, f"the first run exited early: {log_tail}"
                assert time.monotonic() < deadline, "no checkpoint within 900 s"
                time.sleep(0.5)
        finally:
            _kill_tree(first)
    checkpoint = max((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    killed_at = json.loads((checkpoint / "state.json").read_text())["step"]
    assert killed_at < STEPS, "the first run got to the last step before it was killed"
    started = time.monotonic()
    second = subprocess.run(
        _command(run_dir, "--resume"), capture_output=True, env=env, timeout=900, check=False
    )
    return {
        "run_dir": run_dir,
        "killed_at": killed_at,
        "returncode": second.returncode,
        "output": (second.stdout + second.stderr).decode(errors="replace"),
        "resume_wall_s": time.monotonic() - started,
    }


def test_run_that_runs_out_of_data_exits_0_with_final_checkpoint(
    resumed_run: dict, record_fault: FaultRecorder
) -> None:
    run_dir = resumed_run["run_dir"]
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    final_state = run_dir / "checkpoints" / f"step-{STEPS}" / "state.json"
    buffer = json.loads(final_state.read_text())["buffer"] if final_state.is_file() else None
    record_fault(
        "data_exhausted",
        f"exit {resumed_run['returncode']}, data_exhausted={summary.get('data_exhausted')}, "
        f"{summary.get('steps')} steps, served {summary.get('served_weight_version')}, final checkpoint "
        + (
            f"step-{STEPS} (buffer: {buffer['next_position']}/{ROWS} rows consumed, "
            f"{len(buffer['pending'])} pending)"
            if buffer is not None
            else f"step-{STEPS} missing"
        ),
    )
    assert resumed_run["returncode"] == 0, resumed_run["output"][-5000:]
    assert summary["data_exhausted"] is True
    assert summary["steps"] == STEPS
    assert summary["served_weight_version"] == f"step-{STEPS}"
    final = run_dir / "checkpoints" / f"step-{STEPS}"
    assert Path(summary["checkpoint"]) == final
    assert (final / "policy" / "meta.json").is_file()
    state = json.loads((final / "state.json").read_text())
    assert state["buffer"]["next_position"] == ROWS and state["buffer"]["pending"] == []
    assert (final / "buffer.jsonl").read_text() == ""
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [final.name]  # no staging left
    assert (run_dir / "curves.png").stat().st_size > 10_000


def test_resume_serves_the_checkpointed_weight_version(
    resumed_run: dict, record_fault: FaultRecorder
) -> None:
    resumed = json.loads((resumed_run["run_dir"] / "resume.json").read_text())
    k = resumed_run["killed_at"]
    record_fault(
        "trainer_killed_mid_run",
        f"killed after the step-{k} checkpoint; resumed at weight version {resumed['weight_version']}, "
        f"served {resumed['served_weight_version']}",
    )
    assert resumed["weight_version"] == k >= 1
    assert resumed["served_weight_version"] == f"step-{k}"


def test_every_group_is_trained_exactly_once_across_the_kill(
    resumed_run: dict, record_fault: FaultRecorder
) -> None:
    run_dir = resumed_run["run_dir"]
    groups = _records(run_dir / "groups.jsonl")
    trained = Counter(g["row_id"] for g in groups)
    per_step = Counter(g["step"] for g in groups)
    record_fault(
        "trainer_killed_mid_run",
        f"{sum(trained[row] == 1 for row in range(ROWS))}/{ROWS} row ids trained exactly once, "
        f"{sum(trained.values()) - len(trained)} duplicates, {ROWS - len(set(trained) & set(range(ROWS)))} "
        f"missing; groups per step {dict(sorted(per_step.items()))}, "
        f"max age {max((g['age'] for g in groups), default=None)}",
    )
    assert trained == Counter(range(ROWS)), groups
    assert sorted(g["position"] for g in groups) == list(range(ROWS))
    assert per_step == {step: min(PROMPTS, ROWS - (step - 1) * PROMPTS) for step in range(1, STEPS + 1)}
    assert all(0 <= g["age"] <= 1 for g in groups)

    steps = [r for r in _records(run_dir / "metrics.jsonl") if "time/step_s" in r]
    assert [r["step"] for r in steps] == list(
        range(1, STEPS + 1)
    )  # steps logged after the checkpoint were dropped
    for record in steps:
        rows = record["async/groups"] * GROUP
        assert record["rollout/rows"] == rows
        outcomes = ("rollout/ok", "rollout/policy_fault", "rollout/content_failed", "rollout/infra_failed")
        assert sum(record[name] for name in outcomes) == rows
        assert record["preprocess/samples"] + record["preprocess/masked"] == rows
        assert record["async/age_max"] <= 1
        assert record["refit/weight_version"] == record["step"]


def test_the_recipe_learns_across_the_kill(resumed_run: dict) -> None:
    summary = json.loads((resumed_run["run_dir"] / "summary.json").read_text())
    validations = summary["validation_accuracy"]
    # The recipe validates every 2 steps (a progress-bar crash after validation used to stop it at
    # step 2); the validations before the kill are kept.
    assert [v["step"] for v in validations] == list(range(0, STEPS + 1, 2)), validations
    assert validations[-1]["accuracy"] >= validations[0]["accuracy"] + LEARNING_MARGIN, validations


def test_the_recipe_trains_on_fresh_groups_with_matching_logprobs(resumed_run: dict) -> None:
    steps = [r for r in _records(resumed_run["run_dir"] / "metrics.jsonl") if "time/step_s" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for record in steps:
        assert record["async/age_max"] <= 1
        assert record["train/optimizer_steps"] == 1.0
        assert 0.5 < record["train/is/weight_mean"] <= 2.0  # truncated IS at tis_cap 2
        assert math.isfinite(record["mismatch/token_mult_prob_error"])
    # The first step's groups were sampled with the weights being trained (age 0): vLLM's logprobs
    # and the trainer's agree; later groups are one version old and differ by the update, which the
    # truncated IS weight corrects for.
    assert steps[0]["async/age_max"] == 0.0
    assert 1.0 <= steps[0]["mismatch/token_mult_prob_error"] < 1.01
    assert any(r["async/age_max"] == 1.0 for r in steps[1:])
