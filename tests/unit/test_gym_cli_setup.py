"""What ``gym env start`` needs from this package, and the dataset tools connecting, without services.

- every server's ``requirements.txt`` leaves the package out, so the install Gym would run from it
  cannot fetch a ``video-grpo`` from the package index;
- ``video-grpo gym-venvs`` links the venvs Gym looks for (``<uv_venv_dir>/<type>/<name>/.venv``)
  to an existing environment;
- ``video_tools_agent``'s resources server is a config variable with a default;
- ``make-clips`` output converts with ``gym-dataset convert --format generic`` (field names and
  path roots), whose format ``--help`` documents;
- ``serve-vllm`` refuses bad options with a message naming them, before starting anything.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from gym_video_env.datasets import GENERIC_FORMAT_HELP, convert_records, read_records
from gym_video_env.datasets import main as datasets_main
from rl_bridge.cli import main as cli_main
from rl_bridge.paths import gym_python, project_root
from rl_bridge.services.gym_venvs import DEFAULT_STOCK_SERVERS, _server_dirs, link_server_venvs

pytestmark = pytest.mark.unit

SRC = project_root() / "src"
OUR_SERVERS = {
    "responses_api_models/video_vllm_model",
    "resources_servers/video_mcqa",
    "resources_servers/video_segments",
    "responses_api_agents/video_tools_agent",
}


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli_main(argv)
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 2
            err.write(str(exit_.code))
    return status, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("server", sorted(OUR_SERVERS))
def test_requirements_never_name_the_package(server: str) -> None:
    requirements = (SRC / server / "requirements.txt").read_text()
    lines = [line.strip() for line in requirements.splitlines() if line.strip() and not line.startswith("#")]
    assert not [line for line in lines if "video-grpo" in line or "video_grpo" in line], lines
    # Gym's install for a non-editable server: `(echo nemo-gym==X && grep -v -F '../..' requirements.txt)`.
    assert [line for line in lines if "../.." not in line] == []
    assert "skip_venv_if_present=true" in requirements and "gym-venvs" in requirements


def test_gym_venvs_links_every_server_a_video_setup_runs(tmp_path: Path) -> None:
    venv = gym_python().parent.parent
    links = link_server_venvs(tmp_path / "venvs", venv=venv)
    names = {link.parent.relative_to(tmp_path / "venvs").as_posix() for link in links}
    assert names == OUR_SERVERS | set(DEFAULT_STOCK_SERVERS)
    for link in links:
        assert link.is_symlink() and link.resolve() == venv.resolve()
        # What Gym checks for skip_venv_if_present and runs the server with.
        assert (link / "bin" / "python").exists() and (link / "bin" / "activate").exists()
    # Idempotent: links are replaced.
    assert len(link_server_venvs(tmp_path / "venvs", venv=venv)) == len(links)


def test_gym_venvs_adds_search_dirs_and_refuses_what_is_in_the_way(tmp_path: Path) -> None:
    own = tmp_path / "mine" / "resources_servers" / "my_env"
    own.mkdir(parents=True)
    (own / "requirements.txt").write_text("")
    links = link_server_venvs(tmp_path / "venvs", search_dirs=[tmp_path / "mine"])
    assert tmp_path / "venvs" / "resources_servers" / "my_env" / ".venv" in links
    assert _server_dirs(tmp_path / "mine") == [own]

    blocked = tmp_path / "blocked" / "resources_servers" / "video_mcqa" / ".venv"
    blocked.mkdir(parents=True)
    with pytest.raises(FileExistsError, match="is not a symlink"):
        link_server_venvs(tmp_path / "blocked")
    with pytest.raises(FileNotFoundError, match="is not a venv"):
        link_server_venvs(tmp_path / "x", venv=tmp_path)
    status, _, err = _run_cli(["gym-venvs", str(tmp_path / "y"), "--search-dir", str(tmp_path / "missing")])
    assert status == 2 and "search dir" in err and "does not exist" in err


def test_video_tools_agent_resources_server_is_a_variable_with_a_default() -> None:
    config = yaml.safe_load(
        (SRC / "responses_api_agents/video_tools_agent/configs/video_tools_agent.yaml").read_text()
    )
    agent = config["video_tools_agent"]["responses_api_agents"]["video_tools_agent"]
    # OmegaConf's oc.select: the top-level key video_tools_resources_server, else video_segments.
    assert agent["resources_server"]["name"] == "${oc.select:video_tools_resources_server,video_segments}"
    # Gym's rollout collection reaches an agent through an environment server.
    relay = config["video_tools_agent_environment_server"]["environment_servers"]["legacy_agent"]
    assert relay["agent_server"] == {"type": "responses_api_agents", "name": "video_tools_agent"}


def test_video_mcqa_declares_a_dataset_for_gyms_one_shot_mode() -> None:
    config = yaml.safe_load((SRC / "resources_servers/video_mcqa/configs/video_mcqa.yaml").read_text())
    (dataset,) = config["video_mcqa"]["resources_servers"]["video_mcqa"]["datasets"]
    assert dataset["type"] == "validation" and dataset["license"]
    assert dataset["jsonl_fpath"] == "${oc.select:video_mcqa_rows,video_mcqa_rows.jsonl}"


def test_make_clips_output_converts_as_generic(tmp_path: Path) -> None:
    media_root = tmp_path / "videos"
    status, out, _ = _run_cli(
        [
            "make-clips",
            str(media_root / "clips"),
            "--task",
            "count",
            "-n",
            "2",
            "--media-root",
            str(media_root),
        ]
    )
    assert status == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert [record["video"] for record in records] == ["clips/count-s0-00000.mp4", "clips/count-s0-00001.mp4"]
    assert all("prompt" in record and "question" not in record for record in records)
    records_path = tmp_path / "clips.jsonl"
    records_path.write_text(out)
    rows, errors = convert_records(
        read_records(records_path, "generic"), "generic", media_root=media_root.resolve(), progress=False
    )
    assert errors == []
    assert [row["task_id"] for row in rows] == ["count-s0-00000", "count-s0-00001"]
    assert rows[0]["responses_create_params"]["input"][0]["content"][0]["video_url"] == records[0]["video"]
    assert rows[0]["answer"] == records[0]["answer"] and rows[0]["options"] == records[0]["options"]
    # Without --media-root the paths are relative to OUT, which is then the media root to convert with.
    status, out, _ = _run_cli(["make-clips", str(tmp_path / "flat"), "-n", "1"])
    assert status == 0 and json.loads(out)["video"] == "colour-s0-00000.mp4"
    status, _, err = _run_cli(["make-clips", str(tmp_path / "a"), "--media-root", str(tmp_path / "b")])
    assert status == 2 and "is not inside --media-root" in err


def test_generic_accepts_question_and_names_a_missing_prompt(tmp_path: Path) -> None:
    (tmp_path / "a.mp4").write_bytes(b"")
    source = tmp_path / "in.jsonl"
    source.write_text(
        json.dumps({"video": "a.mp4", "question": "Q?", "options": ["x", "y"], "answer": "B"})
        + "\n"
        + json.dumps({"video": "a.mp4", "answer": "A"})
        + "\n"
    )
    rows, errors = convert_records(
        read_records(source, "generic"), "generic", media_root=tmp_path, progress=False
    )
    assert rows[0]["responses_create_params"]["input"][0]["content"][1]["text"].startswith("Q?\nA. x\nB. y")
    assert [str(error) for error in errors] == ["line 2: missing field 'prompt' (or 'question')"]


def test_convert_help_documents_the_generic_format() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        datasets_main(["convert", "--help"])
    text = out.getvalue()
    assert GENERIC_FORMAT_HELP.splitlines()[0] in text
    for field in ("video", "prompt", "answer", "options", "id", "make-clips"):
        assert field in text


def test_serve_vllm_refuses_bad_options_before_starting(tmp_path: Path) -> None:
    status, _, err = _run_cli(["serve-vllm", "--model", str(tmp_path)])
    assert status == 2 and "no config.json" in err
    (tmp_path / "config.json").write_text("{}")
    status, _, err = _run_cli(
        ["serve-vllm", "--model", str(tmp_path), "--allowed-local-media-path", "/nonexistent"]
    )
    assert status == 2 and "/nonexistent: not a directory" in err
    status, _, err = _run_cli(["serve-vllm", "--model", str(tmp_path), "--video-contract", "none"])
    assert status == 2 and "needs a --video-contract other than none" in err
    status, _, err = _run_cli(["serve-vllm", "--model", str(tmp_path), "--video-contract", "{not json"])
    assert status == 2 and "is not JSON" in err
    status, _, err = _run_cli(
        ["serve-vllm", "--model", str(tmp_path), "--video-contract", '{"style": "bogus"}']
    )
    assert status == 2 and "--video-contract" in err and "style" in err
