"""``write_curves``: what a reader of ``curves.png`` needs (issue: title, units, plain legends, whole
steps, no empty axes). The figure is inspected through matplotlib before it is saved."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest

from rl_bridge.loop import metrics

pytestmark = pytest.mark.unit

matplotlib.use("Agg")

HISTORY = [
    {"step": 0, "val/accuracy": 0.2},
    {"step": 1, "rollout/reward_mean": 0.3, "mismatch/token_mult_prob_error": 1.001, "preprocess/masked": 0.0,
     "time/rollout_s": 5.0, "time/train_s": 4.0},
    {"step": 2, "rollout/reward_mean": 0.5, "mismatch/token_mult_prob_error": 1.002, "preprocess/masked": 0.0,
     "time/rollout_s": 5.0, "time/train_s": 4.0, "val/accuracy": 0.9},
]  # fmt: skip


@pytest.fixture
def figure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    import matplotlib.pyplot as plt

    saved = []
    monkeypatch.setattr(plt, "close", saved.append)  # keep the figure for inspection
    out = metrics.write_curves(HISTORY, tmp_path / "curves.png", chance=1 / 6, title="my_run: sync GRPO")
    assert out.stat().st_size > 10_000
    return saved[0]


def test_the_figure_names_the_run_and_every_axis(figure) -> None:  # type: ignore[no-untyped-def]
    assert figure._suptitle.get_text() == "my_run: sync GRPO"
    for ax in figure.axes:
        assert ax.get_title() and ax.get_xlabel() == "step" and ax.get_ylabel(), ax.get_title()


def test_steps_are_whole_numbers(figure) -> None:  # type: ignore[no-untyped-def]
    figure.canvas.draw()
    for ax in figure.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)


def test_legends_are_plain_language_and_empty_panels_say_so(figure) -> None:  # type: ignore[no-untyped-def]
    by_title = {ax.get_title(): ax for ax in figure.axes}
    legends = [t.get_text() for ax in figure.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert "held-out accuracy (greedy)" in legends and "mean reward of the step's samples" in legends
    assert not [text for text in legends if "/" in text and "_" in text], legends  # no raw metric names
    # Nothing was masked (all zeros) and no GPU ran: the panels say so instead of a +-0.04 axis.
    notes = {title: [t.get_text() for t in ax.texts] for title, ax in by_title.items()}
    assert notes["Masked samples, retries and restarts"] == ["none: every rollout was trained"]
    assert notes["GPU memory"] == ["no GPU in this run"]
    assert not by_title["Masked samples, retries and restarts"].get_lines()
    assert "reward" not in " ".join(
        t.get_text() for t in by_title["Held-out accuracy"].get_legend().get_texts()
    )
