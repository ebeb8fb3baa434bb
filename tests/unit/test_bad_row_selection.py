"""Fault injection (``task.bad_row_fraction``) is independent of the data order (issue 34, item 1).

Both loops visit every training row once per pass, so a whole pass always holds exactly the
chosen bad rows; what the selection must not do is line up with the order, which made the first
steps of ``video-grpo train task.bad_row_fraction=0.25`` all bad rows (the bad rows were
``Random(task.seed).sample`` and the sync order ``Random(recipe.seed).shuffle`` popped from the
end: the same draws, both seeds 0 by default).

The margin. With the selection independent of the order, the bad rows among the first ``n``
prompts of a pass over ``N`` rows of which ``K`` are bad follow the hypergeometric law: mean
``n K / N``, variance ``n (K/N) (1 - K/N) (N - n) / (N - 1)``. The tests accept 4 standard
deviations either side (a normal tail of 6e-5 per check; Chebyshev's bound, whatever the shape,
still 1/16). An order aligned with the selection puts the issue's 64 bad rows of 256 first: 32 in
the first step of 32 prompts (mean 8, sd 2.3: 10.6 sd out), 64 in the first two (mean 16, sd 3.0:
16 sd out). The seeds are fixed, so each check passes or fails the same way every time.
"""

from __future__ import annotations

import math
from itertools import islice
from pathlib import Path

import pytest

from rl_bridge.loop.collect import sync_row_order
from rl_bridge.loop.replay import DataOrder
from rl_bridge.recipe import load_recipe
from rl_bridge.tasks import prepare_task
from video_grpo_demo.task import MEDIA_FAULT_KEY, with_bad_media

pytestmark = pytest.mark.unit

FRACTION = 0.25
SEEDS = range(10)


@pytest.fixture(scope="module")
def issue_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, list[bool]]:
    """The rows of the issue's command (the default recipe, ``task.bad_row_fraction=0.25``) as the
    loop prepares them, and which are bad."""
    run_dir = tmp_path_factory.mktemp("bad_rows") / "run"
    recipe = load_recipe(None, [f"run_dir={run_dir}", f"task.bad_row_fraction={FRACTION}"])
    rows = prepare_task(recipe).train_rows
    return recipe, [MEDIA_FAULT_KEY in row for row in rows]


def _band(n: int, rows: int, bad: int) -> tuple[float, float]:
    """Mean +- 4 standard deviations of the bad rows among the first ``n`` of a pass (hypergeometric)."""
    p = bad / rows
    sd = math.sqrt(n * p * (1 - p) * (rows - n) / (rows - 1))
    return n * p - 4 * sd, n * p + 4 * sd


def _first_pass(order: list[int], bad: list[bool], prompts: int) -> list[int]:
    """Bad rows among the first 1, 2, ... steps of ``prompts`` prompts of the pass ``order``."""
    return [sum(bad[i] for i in order[: k * prompts]) for k in range(1, len(order) // prompts + 1)]


def test_the_issue_command_has_the_requested_fraction_of_bad_rows(issue_run) -> None:
    recipe, bad = issue_run
    assert len(bad) == recipe.task.train_rows == 256
    assert sum(bad) == round(FRACTION * len(bad)) == 64


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_every_prefix_of_the_first_pass_holds_about_the_fraction(issue_run, loop: str) -> None:
    recipe, bad = issue_run
    rows, prompts = len(bad), recipe.rollout.prompts_per_step
    if loop == "sync":
        order = list(islice(sync_row_order(rows, recipe.seed), 2 * rows))
    else:
        data = DataOrder(num_rows=rows, seed=recipe.seed)
        order = [data.row_id(p) for p in range(2 * rows)]
    for first_pass in (order[:rows], order[rows:]):
        assert sorted(first_pass) == list(range(rows))  # a pass visits every row once
        counts = _first_pass(first_pass, bad, prompts)
        assert counts[-1] == sum(bad)  # the whole pass: exactly the requested share
        for steps, count in enumerate(counts[:-1], start=1):
            low, high = _band(steps * prompts, rows, sum(bad))
            assert low <= count <= high, (loop, steps, count, (low, high))


def test_the_share_of_the_first_steps_over_seeds(issue_run, tmp_path: Path) -> None:
    """Seeds 0-9 (``seed`` and ``task.seed`` equal, as by default): the bad rows in each seed's first
    step, summed, against the sum of 10 independent hypergeometric counts."""
    recipe, bad = issue_run
    rows, prompts = len(bad), recipe.rollout.prompts_per_step
    plain = [{**row, "task_id": f"row-{i}"} for i, row in enumerate(_good_rows(rows))]
    totals = {"sync": 0, "async": 0}
    for seed in SEEDS:
        chosen = [
            MEDIA_FAULT_KEY in row for row in with_bad_media(plain, FRACTION, tmp_path / "media", seed=seed)
        ]
        assert sum(chosen) == round(FRACTION * rows)
        totals["sync"] += sum(chosen[i] for i in islice(sync_row_order(rows, seed), prompts))
        data = DataOrder(num_rows=rows, seed=seed)
        totals["async"] += sum(chosen[data.row_id(p)] for p in range(prompts))
    low, high = _band(prompts, rows, round(FRACTION * rows))
    mean, spread = len(SEEDS) * (low + high) / 2, math.sqrt(len(SEEDS)) * (high - low) / 2
    for loop, total in totals.items():
        assert mean - spread <= total <= mean + spread, (loop, total, (mean - spread, mean + spread))


def _good_rows(rows: int) -> list[dict]:
    """``rows`` rows with an ``input_video`` part (what :func:`with_bad_media` replaces)."""
    part = {"type": "input_video", "video_url": "train/clip.mp4"}
    message = {"role": "user", "content": [part, {"type": "input_text", "text": "?"}]}
    return [{"responses_create_params": {"input": [message]}} for _ in range(rows)]
