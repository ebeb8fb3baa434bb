"""vLLM finds and calls the ``video_grpo`` general plugin: entry point, vLLM's loader, the live server."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap

import pytest

import vllm_video_plugin
from rl_bridge.services.vllm_server import VLLMServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_REGISTERED_LINE = re.compile(r"video_grpo plugin registered in pid (\d+)")


def test_entry_point_is_installed() -> None:
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get(vllm_video_plugin.PLUGIN_NAME) == "vllm_video_plugin:register", plugins


@pytest.fixture(scope="module")
def plugin_load_run() -> subprocess.CompletedProcess[str]:
    """A fresh interpreter (nothing registered yet) in which vLLM's own loader loads the general
    plugins allowed by ``VLLM_PLUGINS=video_grpo``, then ``register()`` is called once more."""
    script = textwrap.dedent(
        """
        import logging

        import vllm_video_plugin
        from vllm.plugins import load_general_plugins

        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        print("before", vllm_video_plugin.registered())
        load_general_plugins()
        print("after", vllm_video_plugin.registered())
        vllm_video_plugin.register()
        print("again", vllm_video_plugin.registered())
        """
    )
    env = {**os.environ, "VLLM_PLUGINS": vllm_video_plugin.PLUGIN_NAME, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_vllm_plugin_loader_calls_register(plugin_load_run: subprocess.CompletedProcess[str]) -> None:
    lines = [line for line in plugin_load_run.stdout.splitlines() if line.startswith(("before", "after"))]
    assert lines == ["before False", "after True"], plugin_load_run.stdout


def test_register_twice_registers_once(plugin_load_run: subprocess.CompletedProcess[str]) -> None:
    assert "again True" in plugin_load_run.stdout.splitlines()
    registrations = _REGISTERED_LINE.findall(plugin_load_run.stderr)
    assert len(registrations) == 1, plugin_load_run.stderr[-4000:]


def test_running_server_registered_the_plugin_in_its_processes(vllm_server: VLLMServer) -> None:
    pids = {int(pid) for pid in _REGISTERED_LINE.findall(vllm_server.log_path.read_text(errors="replace"))}
    # The engine core and the worker log it. The API server process registers the plugin too, but
    # while it builds its argument parser, before logging is configured, so its line is dropped.
    assert len(pids) >= 2, f"registration lines from pids {pids} in {vllm_server.log_path}"
    for pid in pids:
        assert os.getpgid(pid) == vllm_server.process.pid, f"pid {pid} is not one of the server's processes"
