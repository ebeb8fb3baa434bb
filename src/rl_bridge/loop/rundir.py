"""A run's directory: never replaced by accident.

Both loops call :func:`new_run_dir` before they write anything. A directory that holds an earlier
run (its ``recipe.json``, ``metrics.jsonl`` or ``summary.json``, which a run writes first and as it
goes) is refused with :class:`RunDirError` unless the caller asked to overwrite it
(``video-grpo train --overwrite``; ``run_sync(recipe, overwrite=True)``); ``--resume`` (async)
continues one in place. A directory that is not a run's (no records, files a run does not write)
is refused even with ``overwrite`` (``run_dir=.`` used to delete the working directory).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rl_bridge.user_errors import UsageError

__all__ = ["RUN_RECORDS", "RunDirError", "is_earlier_run", "new_run_dir", "resumable_run_dir"]

RUN_RECORDS = ("recipe.json", "metrics.jsonl", "summary.json")
"""Files whose presence makes a directory an earlier run (``recipe.json`` is written first)."""

# What a run writes at the top of its directory: a directory without RUN_RECORDS that holds only
# these (the media a prepare_task call wrote) is replaced silently; one holding anything else is not
# a run's and is refused. An earlier run (RUN_RECORDS) is replaced whole with overwrite.
_RUN_OUTPUTS = frozenset(
    {
        *RUN_RECORDS,
        "media",
        "media-bad-outside",
        "logs",
        "tensorboard",
        "curves.png",
        "masked_rows.jsonl",
        "groups.jsonl",
        "checkpoint",
        "checkpoints",
        "export",
        "weights",
    }
)


class RunDirError(UsageError):
    """The run directory cannot take this run (an earlier run is there, or files of no run, or
    nothing to resume); nothing was changed."""


def is_earlier_run(run_dir: Path) -> bool:
    """``run_dir`` holds a run's records (:data:`RUN_RECORDS`)."""
    return any((run_dir / name).exists() for name in RUN_RECORDS)


def new_run_dir(run_dir: Path, *, overwrite: bool = False, resumable: bool = False) -> Path:
    """``run_dir`` resolved and created empty for a new run.

    Args:
        run_dir: the recipe's ``run_dir`` (messages show it as given).
        overwrite: replace an earlier run in ``run_dir``.
        resumable: the run's loop can ``--resume`` (the hint offers it).

    Raises:
        RunDirError: ``run_dir`` holds an earlier run and ``overwrite`` is false, or holds files
            a run does not write, or is a file.
    """
    path = run_dir.resolve()
    if path.exists():
        if not path.is_dir():
            raise RunDirError(f"{run_dir} is a file, not a run directory: pass run_dir=... for the run")
        if is_earlier_run(path):
            if not overwrite:
                resume = ", or --resume to continue it" if resumable else ""
                raise RunDirError(
                    f"{run_dir} exists (an earlier run): pass --overwrite to replace it, "
                    f"run_dir=... for a new one{resume}"
                )
        elif foreign := sorted(p.name for p in path.iterdir() if p.name not in _RUN_OUTPUTS):
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise RunDirError(
                f"{run_dir} is not a run directory (it holds {shown}); not replaced, even with "
                "--overwrite: pass run_dir=... for the run"
            )
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def resumable_run_dir(run_dir: Path) -> Path:
    """``run_dir`` resolved, for ``--resume``.

    Raises:
        RunDirError: no earlier run there to continue.
    """
    path = run_dir.resolve()
    if not is_earlier_run(path):
        raise RunDirError(f"{run_dir}: no earlier run to resume there (no {RUN_RECORDS[0]})")
    return path
