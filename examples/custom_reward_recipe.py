"""Your own GRPO script: build a recipe in Python, pick the task, run the loop, read the results.

    envs/main/.venv/bin/python examples/custom_reward_recipe.py                # 10 steps
    envs/main/.venv/bin/python examples/custom_reward_recipe.py --steps 1 --run-dir runs/mine

This is what ``video-grpo train`` does, written out with the package's imports instead of the
CLI, so you can change any part: the typed recipe (:class:`rl_bridge.loop.Recipe`, the same
fields as the YAML recipes; unknown fields are rejected), a different task, and your own
analysis of the run. Here the task is *counting* instead of the default colour question: "how
many times does a shape flash?", four options, on the tiny random-weight Qwen2.5-VL, all on CPU.

The reward is computed by the Gym environment's ``/verify`` (``video_mcqa``: 1.0 for the correct
letter, else 0.0); ``rl_bridge.loop.sync.run_sync`` turns each group's rewards into GRPO
advantages. To reward something else, change what the environment verifies (a resources server
of your own: see examples/custom_video_tool_env) and keep this loop.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rl_bridge.recipe import Recipe, load_recipe
from rl_bridge.recipe import (
    RolloutSection,
    TaskSection,
    TrainSection,
    ValidationSection,
)
from rl_bridge.loop.rundir import RunDirError
from rl_bridge.loop.sync import run_sync


def counting_recipe(steps: int, run_dir: Path) -> Recipe:
    """The counting task, small enough for a CPU: 4 options, 4 prompts x 4 samples per step."""
    return Recipe(
        run_dir=run_dir,
        seed=0,
        task=TaskSection(
            name="count",  # the question asked about each clip: colour, count or order
            num_options=4,
            canonical_options=True,  # a fixed option order: each letter always means one count
            answer_format="letter",  # the answer is one option letter...
            train_rows=16,
            val_rows=8,
        ),
        rollout=RolloutSection(
            prompts_per_step=4,
            group_size=4,  # G samples per prompt; GRPO compares the rewards within a group
            max_output_tokens=1,
            restrict_to_options=True,  # ...sampled among the option letters only
        ),
        train=TrainSection(steps=steps, learning_rate=3e-4, checkpoint_at_end=False),
        validation=ValidationSection(every=steps),  # held-out greedy accuracy before and after
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/custom_reward_recipe"))
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run in --run-dir")
    args = parser.parse_args()

    recipe = counting_recipe(args.steps, args.run_dir)
    # A recipe is plain data: the same run from YAML would be
    #   load_recipe("recipes/tiny_cpu_sync.yaml", ["task.name=count", "task.num_options=4", ...])
    assert load_recipe(None, ["task.name=count"]).task.name == recipe.task.name
    print(recipe.model_dump_json(indent=2, by_alias=True, include={"task", "rollout", "train"}))

    # Starts vLLM, the Gym servers and the Megatron policy, and stops them; an earlier run in the
    # run directory is refused (rl_bridge.loop.rundir.RunDirError, one line) unless --overwrite.
    try:
        summary = run_sync(recipe, overwrite=args.overwrite)
    except RunDirError as error:
        print(f"custom_reward_recipe.py: {error}", file=sys.stderr)
        return 2

    # The run's per-step metrics, one JSON object per line, next to TensorBoard logs and curves.
    metrics = [json.loads(line) for line in (recipe.run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in metrics:
        if "rollout/reward_mean" in row:
            print(f"step {int(row['step'])}: reward_mean={row['rollout/reward_mean']:.3f}")
    accuracy = [entry["accuracy"] for entry in summary["validation_accuracy"]]
    print(
        f"steps={summary['steps']} weight_version={summary['served_weight_version']} val_accuracy={accuracy}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
