"""Ports and health checks of managed processes (rl_bridge.services.process): a port is drawn from
the configured range and never handed out twice, and a server that lost its port to another
process does not pass for healthy when that process answers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rl_bridge.services.process import PORT_RANGE_ENV, ManagedProcess, ServiceError, free_port, wait_for_http

pytestmark = pytest.mark.unit


def test_ports_come_from_the_configured_range_and_never_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "29990-29997")
    ports = [free_port() for _ in range(4)]
    assert len(set(ports)) == 4
    assert all(29990 <= port <= 29997 for port in ports)


def test_a_malformed_range_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "30000")
    with pytest.raises(ValueError, match=PORT_RANGE_ENV):
        free_port()


def test_an_answer_from_another_process_on_the_port_is_not_health(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with ManagedProcess("holder", argv, log_path=tmp_path / "holder.log", cwd=tmp_path) as holder:
        wait_for_http(url, timeout_s=30, process=holder)  # its own port: healthy
        # A server that never got the port (still starting, or about to exit on EADDRINUSE).
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        with ManagedProcess("late", sleeper, log_path=tmp_path / "late.log") as late:
            with pytest.raises(ServiceError, match=rf"not from late: port {port} is held by another process"):
                wait_for_http(url, timeout_s=30, process=late)
