"""``video-grpo``'s one error path (issue 34, items 3 and 8): a mistake in the input is one line on
stderr naming the file (or the command line), the key and what was expected, exit status 2, no
traceback; ``--debug`` / ``VIDEO_GRPO_DEBUG=1`` raise it instead; the Gym environment's
``video-grpo`` names the environment that has the trainer.

The table runs ``main([...])`` in this process (the recipe's imports load torch once, about 4 s;
23 subprocesses would take a minute and a half); one case runs the console script end to end, and
the Gym environment's cases run its interpreter (no torch there, well under a second each).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_bridge import cli
from rl_bridge.paths import gym_python, project_root
from rl_bridge.user_errors import UsageError

pytestmark = pytest.mark.unit

RECIPES = project_root() / "recipes"


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Bad inputs of every kind under ``tmp_path``; ``train`` may set OMP_WAIT_POLICY (restored)."""
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", cli.OPENMP_WAIT_POLICY))
    monkeypatch.delenv("VIDEO_GRPO_DEBUG", raising=False)
    # train's logging set-up (rl_bridge.console.capture) would take over this process's root logger
    monkeypatch.setattr("rl_bridge.console.capture", lambda: None)
    (tmp_path / "a_directory").mkdir()
    (tmp_path / "malformed.yaml").write_text("train:\n  steps: 3\n  learning_rate: [1e-3\nmode: sync\n")
    (tmp_path / "misspelled.yaml").write_text("train:\n  stepz: 3\n")
    (tmp_path / "wrong_type.yaml").write_text("train:\n  steps: many\n")
    (tmp_path / "a_list.yaml").write_text("- train\n- steps\n")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00\x81train")
    (tmp_path / "not_json.json").write_text("[{'video': 1}")
    (tmp_path / "earlier_run").mkdir()
    (tmp_path / "earlier_run" / "summary.json").write_text("{}")
    (tmp_path / "no_run").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path


# (arguments with {tmp} for the fixture's directory, what the one line must contain)
CASES: list[tuple[list[str], list[str]]] = [
    (["train", "-r", "{tmp}/missing.yaml"], ["missing.yaml: no such recipe file"]),
    (
        ["train", "train.stepz=3"],
        ["command line: train.stepz: unknown key, did you mean train.steps? (train has: steps, "],
    ),
    (["train", "train.steps=abc"], ["command line: train.steps: expected an integer, got 'abc'"]),
    (["train", "trainsteps3"], ["override 'trainsteps3' is not of the form dotted.key=value"]),
    (["train", "-r", "{tmp}/a_directory"], ["a_directory: is a directory, not a recipe file"]),
    (["train", "-r", "{tmp}/malformed.yaml"], ["malformed.yaml: line 4, column 5: invalid YAML"]),
    (["train", "-r", "{tmp}/misspelled.yaml"], ["misspelled.yaml: train.stepz: unknown key"]),
    (
        ["train", "-r", "{tmp}/wrong_type.yaml"],
        ["wrong_type.yaml: train.steps: expected an integer, got 'many'"],
    ),
    (["train", "-r", "{tmp}/a_list.yaml"], ["a_list.yaml: the top level must be a mapping, got list"]),
    (["train", "-r", "{tmp}/binary.yaml"], ["binary.yaml: not a text file"]),
    (["train", "mode=sideways"], ["mode: expected 'sync' or 'async', got 'sideways'"]),
    (["train", "train=3"], ["train: expected a section (a mapping of keys to values), got 3"]),
    (["train", "train.steps=[1"], ["override 'train.steps=[1': its value is not valid YAML"]),
    (["train", "train.steps=0"], ["train.steps: expected greater than 0, got 0"]),
    (["train", "rollout.max_output_tokens=2"], ["set rollout.max_output_tokens=1 (got 2)"]),
    (["train", "unknown_section.x=1"], ["unknown_section: unknown key (a recipe has: run_dir, seed, mode"]),
    (["train", "--resume"], ["--resume needs an async recipe (mode: async)"]),
    (["train", "--bogus"], ["video-grpo: unrecognized arguments: --bogus (see video-grpo --help)"]),
    (["train", "run_dir={tmp}/earlier_run"], ["earlier_run exists (an earlier run): pass --overwrite"]),
    (
        ["train", "-r", str(RECIPES / "tiny_cpu_async.yaml"), "--resume", "run_dir={tmp}/no_run"],
        ["no_run: no earlier run to resume there"],
    ),
    (
        ["train", "-r", str(RECIPES / "tiny_cpu_async.yaml"), "--resume", "--overwrite"],
        ["--resume continues the run in run_dir and --overwrite replaces it: pass one"],
    ),
    (["plan", "-r", "{tmp}/missing.yaml"], ["video-grpo plan: ", "missing.yaml: no such recipe file"]),
    (
        ["plan", "model.placement=sideways"],
        ["model.placement: expected 'split' or 'colocated', got 'sideways'"],
    ),
    (["plan", "-r", "{tmp}/misspelled.yaml", "train.steps=2"], ["misspelled.yaml: train.stepz: unknown key"]),
    (
        [
            "gym-dataset",
            "convert",
            "--format",
            "generic",
            "{tmp}/missing.jsonl",
            "{tmp}/out.jsonl",
            "--media-root",
            "{tmp}",
        ],
        ["video-grpo gym-dataset convert: ", "missing.jsonl: no such file"],
    ),
    (
        [
            "gym-dataset",
            "convert",
            "--format",
            "generic",
            "{tmp}/a_directory",
            "{tmp}/out.jsonl",
            "--media-root",
            "{tmp}",
        ],
        ["a_directory: is a directory, not a file"],
    ),
    (
        [
            "gym-dataset",
            "convert",
            "--format",
            "video-r1",
            "{tmp}/not_json.json",
            "{tmp}/out.jsonl",
            "--media-root",
            "{tmp}",
        ],
        ["not_json.json: not JSON"],
    ),
    (
        ["gym-dataset", "validate", "{tmp}/missing.jsonl", "--media-root", "{tmp}"],
        ["missing.jsonl: no such file"],
    ),
    (
        ["gym-dataset", "validate", "{tmp}/a_directory", "--media-root", "{tmp}"],
        ["a_directory: is a directory"],
    ),
    (
        [
            "wheelhouse",
            "build",
            "{tmp}/wh",
            "--python",
            "3.12",
            "--torch",
            "2.11.0",
            "--image-packages",
            "{tmp}/none",
        ],
        ["--image-packages", "none: no such file"],
    ),
    (["serve-vllm", "--model", "{tmp}/a_directory"], ["--model", "a_directory: no config.json there"]),
    (
        ["serve-vllm", "--model", "{tmp}/model", "--video-contract", '{"style": "bogus"}'],
        ["--video-contract: JSON: style: expected 'uniform', "],
    ),
    (
        ["serve-vllm", "--model", "{tmp}/model", "--video-contract", "{tmp}/missing.json"],
        ["missing.json': not processor, none, a JSON object or a JSON file"],
    ),
    (["make-clips", "{tmp}/clips", "--media-root", "{tmp}/a_directory"], ["is not inside --media-root"]),
]


@pytest.mark.parametrize(("arguments", "expected"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_invocation_is_one_line_and_exit_2(
    files: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], expected: list[str]
) -> None:
    argv = [a.replace("{tmp}", str(files)) for a in arguments]
    try:
        status = cli.main(argv)
    except SystemExit as exit_:  # argparse
        status = exit_.code
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err + out
    assert err.startswith((f"video-grpo {argv[0]}", "video-grpo: ")), err
    for text in expected:
        assert text in err, err


def test_nothing_was_touched_by_a_refused_run(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", f"run_dir={files / 'earlier_run'}"]) == 2
    assert [p.name for p in (files / "earlier_run").iterdir()] == ["summary.json"]


@pytest.mark.parametrize("how", ["flag", "flag after the command", "environment"])
def test_debug_raises_the_error_with_its_cause(
    files: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    argv = ["train", "train.stepz=3"]
    if how == "flag":
        argv = ["--debug", *argv]
    elif how == "flag after the command":
        argv = [*argv[:1], "--debug", *argv[1:]]
    else:
        monkeypatch.setenv("VIDEO_GRPO_DEBUG", "1")
    with pytest.raises(UsageError, match="unknown key") as raised:
        cli.main(argv)
    assert type(raised.value.__cause__).__name__ == "ValidationError"  # the traceback shows both


def test_a_bug_keeps_its_traceback(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error that is not the input's (here a KeyError inside the loop) is not turned into a line."""
    from rl_bridge.loop import sync

    def broken(recipe, *, overwrite=False):
        raise KeyError("a bug")

    monkeypatch.setattr(sync, "run_sync", broken)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["train", f"run_dir={files / 'new_run'}"])


def test_the_console_script_prints_one_line(tmp_path: Path) -> None:
    """End to end, as a user runs it: the real entry point, its imports and logging set-up."""
    script = Path(sys.executable).parent / "video-grpo"
    done = subprocess.run(
        [str(script), "train", "train.stepz=3", f"run_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "VIDEO_GRPO_DEBUG"},
    )
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith(
        "video-grpo train: command line: train.stepz: unknown key, did you mean train.steps? "
        "(train has: steps, learning_rate, "
    )
    assert done.stdout == ""
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("arguments", "missing"),
    [
        (["train"], "torch"),
        (["train", "train.stepz=3"], "torch"),
        (["plan"], "torch"),
        (["serve-vllm", "--model", "/nonexistent"], "torch"),
        (["tiny-model", "qwen2_5_vl"], "transformers"),
    ],
)
def test_the_gym_environment_names_the_trainer_environment(arguments: list[str], missing: str) -> None:
    """The Gym environment (Python 3.13, no torch) runs the same console script."""
    python = gym_python()
    if not python.is_file():
        pytest.skip(f"no Gym environment at {python}")
    done = subprocess.run(
        [str(python), "-m", "rl_bridge.cli", *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(
        f"video-grpo {arguments[0]} needs the trainer environment (torch, vLLM, Megatron-Bridge)"
    )
    assert f"has no {missing}: " in line
    assert f"envs/main/.venv/bin/video-grpo {arguments[0]}" in line


def test_the_gym_environment_still_runs_its_own_commands(tmp_path: Path) -> None:
    python = gym_python()
    if not python.is_file():
        pytest.skip(f"no Gym environment at {python}")
    done = subprocess.run(
        [
            str(python),
            "-m",
            "rl_bridge.cli",
            "gym-dataset",
            "validate",
            str(tmp_path / "x.jsonl"),
            "--media-root",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stderr) == (
        2,
        f"video-grpo gym-dataset validate: {tmp_path / 'x.jsonl'}: no such file\n",
    )
