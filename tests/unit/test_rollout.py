"""Rollout collection against a local HTTP server that fails on purpose: retries, masking, accounting;
and a supervised backend process that is killed under the rollout and restarted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gym_video_env.affinity import MODEL_REPLICA_KEY, pick, take_model_replica
from gym_video_env.coalesce import GROUP_METADATA_KEY
from rl_bridge.loop.stages.rollout import declared_groups
from rl_bridge.rollout import RolloutSettings, collect_rollouts, prompt_key, spread_prompts
from rl_bridge.services.process import ManagedProcess, ServiceError, free_port, wait_for_http
from rl_bridge.services.supervisor import RestartPolicy, ServiceSupervisor

pytestmark = pytest.mark.unit


class _Agent:
    """Answers ``/run`` by the row's ``plan``: a list of HTTP statuses, one per attempt (last repeats)."""

    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()
        self.order: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()


@pytest.fixture
def agent() -> Iterator[tuple[str, _Agent]]:
    with _serve_agent() as served:
        yield served


@contextlib.contextmanager
def _serve_agent() -> Iterator[tuple[str, _Agent]]:
    state = _Agent()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 (http.server API)
            row = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                attempt = state.attempts[row["id"]]
                state.attempts[row["id"]] += 1
                state.order.append(row["id"])
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            time.sleep(row.get("delay_s", 0.02))
            plan = row["plan"]
            status = plan[min(attempt, len(plan) - 1)]
            body = json.dumps({**row, "reward": 1.0} if status == 200 else {"error": "x"}).encode()
            if status == 298:  # an episode the policy made fail, scored by the agent
                status, body = (
                    200,
                    json.dumps({**row, "reward": 0.0, "policy_fault": "context_overflow"}).encode(),
                )
            if status == 299:  # a 200 without a reward
                status, body = 200, b'{"response": {}}'
            if status == 297:  # a 200 whose body is not JSON (a proxy's page)
                status, body = 200, b"<html>bad gateway</html>"
            if status == 599:  # Gym's agent quoting an inner server's client error
                status = 500
                body = json.dumps(
                    "Hit an exception in agent calling an inner server: "
                    + json.dumps({"error": {"type": "invalid_request_error", "code": "invalid_media"}})
                ).encode()
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


def test_with_agent_replicas_each_prompts_samples_go_to_one_and_every_replica_takes_some() -> None:
    prompts = [f"prompt {i}" for i in range(12)]
    rows = [
        {"id": f"{i}-{j}", "plan": [200], "responses_create_params": {"input": prompt, "temperature": 1.0}}
        for i, prompt in enumerate(prompts)
        for j in range(4)
    ]
    with _serve_agent() as (url_a, state_a), _serve_agent() as (url_b, state_b):
        results, stats = collect_rollouts([url_a, url_b], rows, RolloutSettings(max_in_flight=16))
    assert stats.outcomes == {"ok": len(rows)}
    groups = [{"a" if f"{i}-{j}" in state_a.attempts else "b" for j in range(4)} for i in range(len(prompts))]
    assert all(len(replicas) == 1 for replicas in groups), groups
    assert set().union(*groups) == {"a", "b"}
    assert sum(state_a.attempts.values()) + sum(state_b.attempts.values()) == len(rows)
    assert groups.count({"a"}) == 6, "the groups are dealt out evenly"


def test_a_calls_prompts_are_dealt_out_over_the_replicas_the_first_where_its_key_picks() -> None:
    keys = [f"k{i}" for i in range(16) for _ in range(8)]
    replicas = spread_prompts(keys, 4)
    assert list(replicas) == [f"k{i}" for i in range(16)]
    assert Counter(replicas.values()) == dict.fromkeys(range(4), 4)
    assert [replicas[f"k{i}"] for i in range(16)] == [(pick("k0", 4) + i) % 4 for i in range(16)]
    assert spread_prompts(["alone"] * 8, 4) == {"alone": pick("alone", 4)}


def test_declared_groups_post_every_groups_first_sample_first_each_group_to_one_replica() -> None:
    prompts = [
        {
            "id": f"p{i}",
            "plan": [200],
            "responses_create_params": {"input": f"prompt {i}", "metadata": {"k": "v"}},
        }
        for i in range(6)
    ]
    rows, order = declared_groups(prompts, 3)
    again, _ = declared_groups(prompts, 3)
    assert order == [0, 3, 6, 9, 12, 15, 1, 4, 7, 10, 13, 16, 2, 5, 8, 11, 14, 17]
    declarations = [row["responses_create_params"]["metadata"][GROUP_METADATA_KEY] for row in rows]
    assert len(set(declarations)) == 6 and all(d.endswith(":3") for d in declarations)
    assert all(row["responses_create_params"]["metadata"]["k"] == "v" for row in rows)
    assert declarations[:3] == [declarations[0]] * 3, "a group's samples share their declaration"
    # A prompt's groups (another step's, with another id) keep the prompt's key: replica, crash record.
    assert [prompt_key(row) for row in rows[::3]] == [prompt_key(row) for row in again[::3]]
    assert prompt_key(rows[0]) == prompt_key(
        {"responses_create_params": {"input": "prompt 0", "metadata": {"k": "v"}}}
    )
    rows = [{**row, "id": f"{index}"} for index, row in enumerate(rows)]
    with _serve_agent() as (url_a, state_a), _serve_agent() as (url_b, state_b):
        _, stats = collect_rollouts([url_a, url_b], rows, RolloutSettings(max_in_flight=1), order=order)
    assert stats.outcomes == {"ok": len(rows)}
    posted = [int(i) for i in state_a.order + state_b.order]
    assert sorted(posted) == list(range(len(rows)))
    for state in (state_a, state_b):  # one row in flight at a time: each replica saw them in order
        seen = [int(i) for i in state.order]
        assert seen == [i for i in order if i in seen]
    groups = [{"a" if str(g * 3 + s) in state_a.attempts else "b" for s in range(3)} for g in range(6)]
    assert all(len(replicas) == 1 for replicas in groups), groups
    with pytest.raises(ValueError, match="permutation"):
        collect_rollouts([url_a], rows, order=[0, 0])


def test_spread_group_samples_deals_a_groups_samples_over_the_replicas_naming_its_model_replica() -> None:
    prompts = [{"plan": [200], "responses_create_params": {"input": f"prompt {i}"}} for i in range(4)]
    rows, order = declared_groups(prompts, 4)
    rows = [{**row, "id": f"{index}"} for index, row in enumerate(rows)]
    keys = [prompt_key(row) for row in rows]
    settings = RolloutSettings(max_in_flight=16, spread_group_samples=True)
    with (
        _serve_agent() as (url_a, state_a),
        _serve_agent() as (url_b, state_b),
        _serve_agent() as (url_c, state_c),
    ):
        results, stats = collect_rollouts([url_a, url_b, url_c], rows, settings, order=order)
    assert stats.outcomes == {"ok": len(rows)}
    states = (state_a, state_b, state_c)
    replicas = spread_prompts([keys[i] for i in order], 3)
    for group in range(4):
        home = replicas[keys[group * 4]]
        took = [
            next(r for r, state in enumerate(states) if str(group * 4 + s) in state.attempts)
            for s in range(4)
        ]
        assert took == [(home + s) % 3 for s in range(4)], (
            "the k-th sample to the k-th replica from the group's"
        )
        for sample in range(4):
            params = results[group * 4 + sample].result["responses_create_params"]
            assert params["metadata"][MODEL_REPLICA_KEY] == str(home), "every sample names the group's model"
            assert GROUP_METADATA_KEY in params["metadata"]
    assert all(MODEL_REPLICA_KEY not in row["responses_create_params"]["metadata"] for row in rows)
    with (
        _serve_agent() as (url_a, state_a),
        _serve_agent() as (url_b, state_b),
    ):  # off: a group to one replica
        results, _ = collect_rollouts([url_a, url_b], rows, RolloutSettings(max_in_flight=16), order=order)
    assert all(MODEL_REPLICA_KEY not in r.result["responses_create_params"]["metadata"] for r in results)
    assert all(len({str(g * 4 + s) in state_a.attempts for s in range(4)}) == 1 for g in range(4))


def test_a_named_model_replica_is_taken_out_of_the_request() -> None:
    params = {"input": "x", "metadata": {MODEL_REPLICA_KEY: "2", "k": "v"}}
    assert take_model_replica(params) == ({"input": "x", "metadata": {"k": "v"}}, 2)
    assert take_model_replica({"input": "x", "metadata": {MODEL_REPLICA_KEY: "0"}}) == ({"input": "x"}, 0)
    assert take_model_replica({"input": "x"}) == ({"input": "x"}, None)
    for named in ("-1", "a", 3):
        with pytest.raises(ValueError, match=MODEL_REPLICA_KEY):
            take_model_replica({"input": "x", "metadata": {MODEL_REPLICA_KEY: named}})


def test_every_row_ends_in_one_outcome_with_retries_for_infra_errors(agent: tuple[str, _Agent]) -> None:
    url, state = agent
    plans = {
        "ok": [200],
        "flaky": [503, 502, 200],
        "down": [500],
        "refused": [400],
        "no_reward": [299],
        "inner_refused": [599],
        "policy_fault": [298],
        "not_json": [297],
    }
    rows = [
        {"id": f"{name}-{i}", "plan": plan, "logprobs": [-1 / 3 - i, -2.5e-12, -0.0]}
        for i in range(3)
        for name, plan in plans.items()
    ]
    done = []
    settings = RolloutSettings(max_in_flight=4, max_attempts=3, backoff_s=0.0, timeout_s=10)
    results, stats = collect_rollouts(url, rows, settings, on_done=done.append)

    assert [r.index for r in results] == list(range(len(rows)))
    assert len(done) == len(rows)
    outcome = {row["id"]: r.outcome for row, r in zip(rows, results, strict=True)}
    for i in range(3):
        assert outcome[f"ok-{i}"] == outcome[f"flaky-{i}"] == "ok"
        assert outcome[f"down-{i}"] == outcome[f"not_json-{i}"] == "infra_failed"
        assert state.attempts[f"not_json-{i}"] == 3
        assert (
            outcome[f"refused-{i}"]
            == outcome[f"no_reward-{i}"]
            == outcome[f"inner_refused-{i}"]
            == "content_failed"
        )
        assert state.attempts[f"flaky-{i}"] == 3 and state.attempts[f"down-{i}"] == 3
        assert (
            state.attempts[f"refused-{i}"] == state.attempts[f"inner_refused-{i}"] == 1
        )  # not re-dispatched
        # scored, not masked: it keeps its result and its (failure) reward
        assert outcome[f"policy_fault-{i}"] == "policy_fault" and state.attempts[f"policy_fault-{i}"] == 1
    metrics = stats.as_dict()
    assert (
        metrics["rollout/rows"]
        == len(rows)
        == (
            metrics["rollout/ok"]
            + metrics["rollout/policy_fault"]
            + metrics["rollout/content_failed"]
            + metrics["rollout/infra_failed"]
        )
    )
    assert metrics["rollout/policy_fault"] == 3
    faults = [r for r in results if r.outcome == "policy_fault"]
    assert [(r.reward, r.policy_fault) for r in faults] == [(0.0, "context_overflow")] * 3
    assert (metrics["rollout/ok"], metrics["rollout/content_failed"], metrics["rollout/infra_failed"]) == (
        6,
        9,
        6,
    )
    assert metrics["rollout/retries"] == 3 * 2 + 3 * 2 + 3 * 2
    assert metrics["rollout/redispatches"] == metrics["rollout/server_restarts"] == 0
    assert [r.reward for r in results if r.outcome == "ok"] == [1.0] * 6
    # the answers' floats (the logprobs) come back exactly as sent
    assert all(r.result["logprobs"] == rows[r.index]["logprobs"] for r in results if r.outcome == "ok")
    assert "not JSON" in results[rows.index(next(row for row in rows if row["id"] == "not_json-0"))].error
    assert all(r.error for r in results if r.outcome not in ("ok", "policy_fault"))
    assert 1 < state.max_in_flight <= 4


def test_with_a_clock_a_requests_timeout_counts_from_when_it_is_set(agent: tuple[str, _Agent]) -> None:
    """Rollouts queued while vLLM sleeps wait through the training: their timeout starts at the
    wake (the clock), not at their send."""
    url, _ = agent
    rows = [{"id": k, "plan": [200], "delay_s": 0.8} for k in range(3)]
    settings = RolloutSettings(max_in_flight=4, max_attempts=1, timeout_s=0.5)
    results, _ = collect_rollouts(url, rows, settings)  # from the send: each answer comes too late
    assert [r.outcome for r in results] == ["infra_failed"] * 3
    assert all("TimeoutError" in (r.error or "") for r in results)

    clock = threading.Event()
    threading.Timer(0.5, clock.set).start()  # answers at +0.8 s, within 0.5 s of the clock's +0.5 s
    results, _ = collect_rollouts(url, rows, settings, clock=clock)
    assert [r.outcome for r in results] == ["ok"] * 3

    late = threading.Event()
    slow = [{"id": k, "plan": [200], "delay_s": 1.5} for k in range(2)]
    threading.Timer(0.2, late.set).start()  # answers at +1.5 s, past the clock's +0.2 s + 0.5 s
    started = time.monotonic()
    results, _ = collect_rollouts(url, slow, settings, clock=late)
    assert [r.outcome for r in results] == ["infra_failed"] * 2
    assert "within 0.5 s of vLLM's wake" in (results[0].error or "")
    assert time.monotonic() - started < 1.4  # given up at about +0.7 s, not waited out


def test_connection_refused_is_an_infra_failure() -> None:
    from rl_bridge.services.process import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    results, stats = collect_rollouts(url, [{"id": 0}], RolloutSettings(max_attempts=2, backoff_s=0.0))
    assert results[0].outcome == "infra_failed" and results[0].attempts == 2
    assert "Cannot connect to host" in (results[0].error or "")  # the refused connection, named
    assert stats.retries == 1


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="max_in_flight=0"):
        RolloutSettings(max_in_flight=0)
    with pytest.raises(ValueError, match="backoff_s=-1"):
        RolloutSettings(backoff_s=-1)


# -- a supervised backend, killed under the rollout --------------------------------------------------


class _Backend:
    """A real HTTP server process standing in for vLLM behind the agent (restartable in place)."""

    def __init__(self, directory: Path) -> None:
        port = free_port()
        self.health_url = f"http://127.0.0.1:{port}/"
        self.process = ManagedProcess(
            "backend",
            [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
            log_path=directory / "backend.log",
            cwd=directory,
        )
        wait_for_http(self.health_url, timeout_s=30, process=self.process)

    def restart(self) -> None:
        self.process = self.process.respawn()
        wait_for_http(self.health_url, timeout_s=30, process=self.process)

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout_s=10)

    def up(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[_Backend]:
    server = _Backend(tmp_path)
    try:
        yield server
    finally:
        server.process.stop()


@contextlib.contextmanager
def _agent_before(
    backend: _Backend, kill_when: Callable[[dict[str, Any], Counter[str]], bool]
) -> Iterator[tuple[str, Counter[str]]]:
    """An agent in front of ``backend``: counts each row's requests, kills the backend when
    ``kill_when(row, counts)`` says so (under a lock, the request counted), answers 502 while the
    backend is down."""
    requests_seen: Counter[str] = Counter()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 (http.server API)
            row = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                requests_seen[row["id"]] += 1
                if kill_when(row, requests_seen):
                    backend.kill()
            time.sleep(0.05)
            status, body = (200, {**row, "reward": 1.0}) if backend.up() else (502, {"error": "backend down"})
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", requests_seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fronting_agent(backend: _Backend) -> Iterator[tuple[str, Counter[str]]]:
    """An agent that answers 502 while the backend is down, and kills it on the 4th request."""
    with _agent_before(backend, lambda _row, seen: sum(seen.values()) == 4) as agent:
        yield agent


def test_rows_in_flight_when_the_backend_dies_are_redispatched_after_its_restart(
    backend: _Backend, fronting_agent: tuple[str, Counter[str]]
) -> None:
    url, requests_seen = fronting_agent
    supervisor = ServiceSupervisor(backend, RestartPolicy(max_restarts=2, probe_interval_s=0.1))
    rows = [{"id": f"row-{i}"} for i in range(12)]
    settings = RolloutSettings(max_in_flight=4, max_attempts=1, backoff_s=0.0, timeout_s=10)
    results, stats = collect_rollouts(url, rows, settings, supervisor=supervisor)

    # max_attempts=1: without the restart rule every row failing during the outage would be lost.
    assert [r.outcome for r in results] == ["ok"] * len(rows)
    assert sorted(r.result["id"] for r in results if r.result) == sorted(row["id"] for row in rows)
    assert stats.server_restarts == supervisor.generation == 1 and stats.retries == 0
    assert stats.redispatches == sum(r.redispatches for r in results) >= 1
    assert sum(requests_seen.values()) == len(rows) + stats.redispatches
    (restart,) = supervisor.restarts
    assert restart.generation == 1 and "exited" in restart.reason
    assert backend.up()


@pytest.fixture
def poisoned_agent(backend: _Backend) -> Iterator[tuple[str, Counter[str]]]:
    """An agent whose backend dies whenever a row with the prompt ``"poison"`` reaches it (as a
    video that crashes vLLM's decoder would); 502 while the backend is down."""

    def poison(row: dict[str, Any], _seen: Counter[str]) -> bool:
        return row["responses_create_params"]["input"] == "poison" and backend.up()

    with _agent_before(backend, poison) as agent:
        yield agent


def _prompt_row(row_id: str, prompt: str) -> dict[str, object]:
    return {"id": row_id, "responses_create_params": {"input": prompt, "temperature": 1.0}}


def test_a_prompt_that_kills_the_backend_every_time_is_convicted_and_the_rest_complete(
    backend: _Backend, poisoned_agent: tuple[str, Counter[str]]
) -> None:
    url, requests_seen = poisoned_agent
    # One restart not caused by a convicted prompt is all this supervisor allows: without the
    # triage the poison's second crash would end the rollout.
    policy = RestartPolicy(max_restarts=1, crash_budget=1, probe_interval_s=0.1)
    supervisor = ServiceSupervisor(backend, policy)
    rows = [_prompt_row(f"row-{i}", f"clip {i}") for i in range(10)]
    # Two samples of one prompt.
    rows[3:3] = [_prompt_row("poison-a", "poison"), _prompt_row("poison-b", "poison")]
    settings = RolloutSettings(max_in_flight=4, max_attempts=2, backoff_s=0.0, timeout_s=10)
    results, stats = collect_rollouts(url, rows, settings, supervisor=supervisor)

    by_id = {row["id"]: result for row, result in zip(rows, results, strict=True)}
    for row_id in ("poison-a", "poison-b"):
        assert by_id[row_id].outcome == "content_failed" and by_id[row_id].crashed_server, by_id[row_id]
        assert "killed the server" in (by_id[row_id].error or "")
    assert all(by_id[f"row-{i}"].outcome == "ok" for i in range(10)), [r.error for r in results]
    assert stats.crashed_server == 2 and stats.outcomes == {"ok": 10, "content_failed": 2}
    # The first crash (the poison among others), then the poison alone: convicted, both excused.
    assert stats.server_restarts == supervisor.generation == 2 and supervisor.failure is None
    (reason,) = supervisor.convicted.values()
    assert "2 times" in reason and "alone" in reason
    # Each sample of it went out once before the first crash was noticed, then one of them alone.
    assert requests_seen["poison-a"] + requests_seen["poison-b"] <= 3
    assert backend.up()

    # Later calls do not send the convicted prompt at all; the others still go.
    later = [_prompt_row("poison-c", "poison"), rows[0]]
    again, stats = collect_rollouts(url, later, settings, supervisor=supervisor)
    assert [r.outcome for r in again] == ["content_failed", "ok"] and again[0].crashed_server
    assert requests_seen["poison-c"] == 0 and stats.server_restarts == 0


def test_supervisor_gives_up_after_max_restarts(backend: _Backend) -> None:
    supervisor = ServiceSupervisor(backend, RestartPolicy(max_restarts=1, probe_interval_s=0.1))
    assert supervisor.ensure_healthy() == 0  # healthy: no restart
    backend.kill()
    assert supervisor.ensure_healthy() == 1
    backend.kill()
    for _ in range(2):  # and every later call
        with pytest.raises(ServiceError, match="max_restarts=1"):
            supervisor.ensure_healthy()
    assert supervisor.failure is not None and len(supervisor.restarts) == 1


def test_watch_restarts_a_dead_backend_without_any_caller(backend: _Backend) -> None:
    supervisor = ServiceSupervisor(backend, RestartPolicy(probe_interval_s=0.1))
    with supervisor.watch(interval_s=0.2):
        backend.kill()
        deadline = time.monotonic() + 30
        while supervisor.generation == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert supervisor.generation == 1 and backend.up()


def test_a_server_killed_while_probed_is_reported_as_exited() -> None:
    """A killed server resets the health connection before its process can be reaped: the
    reason given is the exit the probe then sees, not the reset."""

    class Exiting:
        name = "server"
        polls = 0

        def poll(self) -> int | None:  # running at the first look, killed by the second
            self.polls += 1
            return None if self.polls == 1 else -9

    class Server:
        health_url = f"http://127.0.0.1:{free_port()}/"  # nothing listens: refused
        process = Exiting()

        def restart(self) -> None:
            raise AssertionError("probe() must not restart")

    assert ServiceSupervisor(Server()).probe() == "server exited with code -9"


def test_restart_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="probe_attempts=0"):
        RestartPolicy(probe_attempts=0)
    with pytest.raises(ValueError, match="crash_budget=0"):
        RestartPolicy(crash_budget=0)


def test_counts_of_calls_made_one_after_another_add_up_and_overlapping_ones_span() -> None:
    from rl_bridge.rollout import RolloutStats

    first = RolloutStats(rows=4, outcomes=Counter(ok=3, infra_failed=1), retries=2, server_restarts=1,
                         wall_s=10.0, started_at=100.0)  # fmt: skip
    second = RolloutStats(
        rows=4, outcomes=Counter(ok=4), redispatches=1, server_restarts=1, wall_s=6.0, started_at=104.0
    )
    after = RolloutStats.combined([first, second])
    assert after.rows == 8 and after.outcomes == Counter(ok=7, infra_failed=1)
    assert (after.retries, after.redispatches, after.server_restarts, after.wall_s) == (2, 1, 2, 16.0)
    overlapping = RolloutStats.combined([first, second], concurrent=True)
    # One restart seen by both calls; the seconds from the first start (100) to the last end (110).
    assert overlapping.server_restarts == 1 and overlapping.wall_s == 10.0 and overlapping.started_at == 100.0
    assert overlapping.as_dict()["rollout/rows"] == 8.0
