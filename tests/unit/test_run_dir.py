"""A second run never replaces the first by accident (issue 34, item 7): rl_bridge.loop.rundir, and
``make train``, which repeats the main job on purpose."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from rl_bridge import cli
from rl_bridge.loop.rundir import RUN_RECORDS, RunDirError, new_run_dir, resumable_run_dir
from rl_bridge.paths import project_root

pytestmark = pytest.mark.unit


def _earlier_run(run_dir: Path, record: str = "summary.json") -> Path:
    (run_dir / "checkpoint").mkdir(parents=True)
    (run_dir / record).write_text("{}")
    (run_dir / "curves.png").write_bytes(b"png")
    return run_dir


def test_a_new_directory_is_created(tmp_path: Path) -> None:
    run_dir = new_run_dir(tmp_path / "runs" / "a")
    assert run_dir.is_dir() and not list(run_dir.iterdir())


@pytest.mark.parametrize("record", RUN_RECORDS)
def test_an_earlier_run_is_refused_and_left_alone(tmp_path: Path, record: str) -> None:
    run_dir = _earlier_run(tmp_path / "run", record)
    before = sorted(p.name for p in run_dir.iterdir())
    with pytest.raises(RunDirError) as refused:
        new_run_dir(run_dir)
    message = str(refused.value)
    assert message == (
        f"{run_dir} exists (an earlier run): pass --overwrite to replace it, run_dir=... for a new one"
    )
    assert sorted(p.name for p in run_dir.iterdir()) == before
    with pytest.raises(RunDirError, match=r"or --resume to continue it$"):
        new_run_dir(run_dir, resumable=True)  # the async loop offers --resume


def test_overwrite_replaces_an_earlier_run(tmp_path: Path) -> None:
    run_dir = _earlier_run(tmp_path / "run")
    assert new_run_dir(run_dir, overwrite=True) == run_dir.resolve()
    assert not list(run_dir.iterdir())


def test_leftovers_of_no_run_are_replaced_without_asking(tmp_path: Path) -> None:
    """What prepare_task alone writes (the clips) is no earlier run."""
    run_dir = tmp_path / "run"
    (run_dir / "media" / "train").mkdir(parents=True)
    new_run_dir(run_dir)
    assert not list(run_dir.iterdir())


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_that_is_not_a_run_is_never_replaced(tmp_path: Path, overwrite: bool) -> None:
    """``run_dir=.`` in a checkout, or a home directory: refused even with --overwrite."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "media").mkdir()
    with pytest.raises(RunDirError, match=r"is not a run directory \(it holds pyproject.toml\)"):
        new_run_dir(tmp_path, overwrite=overwrite)
    assert (tmp_path / "pyproject.toml").is_file()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(RunDirError, match="is a file, not a run directory"):
        new_run_dir(tmp_path / "a_file", overwrite=overwrite)


def test_resume_needs_an_earlier_run(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="no earlier run to resume there"):
        resumable_run_dir(tmp_path / "missing")
    run_dir = _earlier_run(tmp_path / "run", "recipe.json")
    assert resumable_run_dir(run_dir) == run_dir.resolve()
    assert (run_dir / "curves.png").is_file()  # resuming changes nothing here


class _Started(Exception):
    """Raised where the run would start its work, once its directory is ready."""


def _make_train_arguments() -> list[str]:
    """The arguments of ``video-grpo`` in the Makefile's ``train`` target."""
    makefile = (project_root() / "Makefile").read_text()
    recipe = re.search(r"^train:.*\n\t(.+)$", makefile, re.MULTILINE)
    assert recipe is not None, "no train target in the Makefile"
    words = shlex.split(recipe.group(1))
    assert words[0].endswith("video-grpo"), words
    return words[1:]


def test_make_train_repeats_on_the_same_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``make train`` twice: the second replaces the first (the README says so), through the CLI and
    the real run_sync up to the point where the run starts its work."""
    arguments = _make_train_arguments()
    assert arguments[:2] == ["train", "--overwrite"]
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", cli.OPENMP_WAIT_POLICY))
    monkeypatch.setattr("rl_bridge.console.capture", lambda: None)
    seen: list[list[str]] = []

    def started(recipe):
        seen.append(sorted(p.name for p in recipe.run_dir.iterdir()))
        raise _Started

    monkeypatch.setattr("rl_bridge.tasks.prepare_task", started)
    run_dir = _earlier_run(tmp_path / "run")
    for _ in range(2):
        with pytest.raises(_Started):
            cli.main([*arguments, f"run_dir={run_dir}"])
        (run_dir / "summary.json").write_text("{}")  # as a finished run leaves it
    for names in seen:  # each time, the earlier run's files were gone and the new run's recipe there
        assert "recipe.json" in names and not {"summary.json", "curves.png", "checkpoint"} & set(names)
    assert len(seen) == 2
    # without --overwrite the same command is refused, in one line
    assert cli.main(["train", f"run_dir={run_dir}"]) == 2
    assert "exists (an earlier run): pass --overwrite" in capsys.readouterr().err
