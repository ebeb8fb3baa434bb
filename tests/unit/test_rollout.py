"""Rollout collection against a local HTTP server that fails on purpose: retries, masking, accounting."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rl_bridge.rollout import RolloutSettings, collect_rollouts

pytestmark = pytest.mark.unit


class _Agent:
    """Answers ``/run`` by the row's ``plan``: a list of HTTP statuses, one per attempt (last repeats)."""

    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()


@pytest.fixture
def agent() -> Iterator[tuple[str, _Agent]]:
    state = _Agent()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 (http.server API)
            row = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                attempt = state.attempts[row["id"]]
                state.attempts[row["id"]] += 1
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            time.sleep(0.02)
            plan = row["plan"]
            status = plan[min(attempt, len(plan) - 1)]
            body = json.dumps({**row, "reward": 1.0} if status == 200 else {"error": "x"}).encode()
            if status == 299:  # a 200 without a reward
                status, body = 200, b'{"response": {}}'
            with state.lock:
                state.in_flight -= 1
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", state
    finally:
        server.shutdown()
        server.server_close()


def test_every_row_ends_in_one_outcome_with_retries_for_infra_errors(agent: tuple[str, _Agent]) -> None:
    url, state = agent
    plans = {
        "ok": [200],
        "flaky": [503, 502, 200],
        "down": [500],
        "refused": [400],
        "no_reward": [299],
    }
    rows = [{"id": f"{name}-{i}", "plan": plan} for i in range(3) for name, plan in plans.items()]
    done = []
    settings = RolloutSettings(max_in_flight=4, max_attempts=3, backoff_s=0.0, timeout_s=10)
    results, stats = collect_rollouts(url, rows, settings, on_done=done.append)

    assert [r.index for r in results] == list(range(len(rows)))
    assert len(done) == len(rows)
    outcome = {row["id"]: r.outcome for row, r in zip(rows, results, strict=True)}
    for i in range(3):
        assert outcome[f"ok-{i}"] == outcome[f"flaky-{i}"] == "ok"
        assert outcome[f"down-{i}"] == "infra_failed"
        assert outcome[f"refused-{i}"] == outcome[f"no_reward-{i}"] == "content_failed"
        assert state.attempts[f"flaky-{i}"] == 3 and state.attempts[f"down-{i}"] == 3
        assert state.attempts[f"refused-{i}"] == 1  # content failures are not re-dispatched
    metrics = stats.as_dict()
    assert metrics["rollout/rows"] == len(rows) == (
        metrics["rollout/ok"] + metrics["rollout/content_failed"] + metrics["rollout/infra_failed"]
    )
    assert (metrics["rollout/ok"], metrics["rollout/content_failed"], metrics["rollout/infra_failed"]) == (6, 6, 3)
    assert metrics["rollout/retries"] == 3 * 2 + 3 * 2
    assert [r.reward for r in results if r.outcome == "ok"] == [1.0] * 6
    assert all(r.error for r in results if r.outcome != "ok")
    assert 1 < state.max_in_flight <= 4


def test_connection_refused_is_an_infra_failure() -> None:
    from rl_bridge.services.process import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    results, stats = collect_rollouts(url, [{"id": 0}], RolloutSettings(max_attempts=2, backoff_s=0.0))
    assert results[0].outcome == "infra_failed" and results[0].attempts == 2
    assert "ConnectionError" in (results[0].error or "")
    assert stats.retries == 1


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="max_in_flight=0"):
        RolloutSettings(max_in_flight=0)
