"""The async loop's replay buffer: data order, back-pressure, complete groups, age eviction, state."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from rl_bridge.loop.replay import DataOrder, ReplayBuffer, read_groups, write_groups
from rl_bridge.rollout import RolloutResult, RolloutStats

pytestmark = pytest.mark.unit

G = 3


def _results(reward: float = 1.0) -> list[RolloutResult]:
    row = {"reward": reward, "response": {"output": [{"type": "message"}]}, "answer": "A"}
    return [
        RolloutResult(0, "ok", 1, result=row),
        RolloutResult(1, "content_failed", 1, error="HTTP 400: bad video"),
        RolloutResult(2, "ok", 2, redispatches=1, result={**row, "reward": 0.0}),
    ][:G]


def _fill(buffer: ReplayBuffer, n: int, version: int) -> list[int]:
    positions = []
    for _ in range(n):
        claim = buffer.claim(version)
        assert claim is not None
        buffer.put(claim, _results())
        positions.append(claim.position)
    return positions


def test_data_order_is_a_seeded_permutation_per_pass() -> None:
    order = DataOrder(num_rows=5, seed=7, epochs=2)
    first, second = [order.row_id(p) for p in range(5)], [order.row_id(p) for p in range(5, 10)]
    assert sorted(first) == sorted(second) == list(range(5))
    assert first != second
    assert [DataOrder(5, 7, 2).row_id(p) for p in range(10)] == first + second
    with pytest.raises(IndexError, match="data position 10"):
        order.row_id(10)
    assert DataOrder(5, 7).total is None and DataOrder(5, 7).row_id(1234) in range(5)


def test_claims_block_when_full_until_the_trainer_samples() -> None:
    buffer = ReplayBuffer(DataOrder(100, seed=0), capacity=2, max_age=5)
    _fill(buffer, 2, version=0)
    claimed: list[int] = []
    thread = threading.Thread(
        target=lambda: claimed.append(buffer.claim(0).position)  # type: ignore[union-attr]
    )
    thread.start()
    time.sleep(0.2)
    assert thread.is_alive() and not claimed  # back-pressure: 2 buffered = capacity
    groups, evicted = buffer.sample(1, weight_version=0)
    thread.join(timeout=5)
    assert [g.position for g in groups] == [0] and evicted == 0
    assert claimed == [2]


def test_claimed_groups_count_against_capacity_and_only_complete_groups_are_sampled() -> None:
    buffer = ReplayBuffer(DataOrder(100, seed=0), capacity=3, max_age=5)
    pending = buffer.claim(0)
    assert pending is not None
    _fill(buffer, 2, version=0)
    with pytest.raises(TimeoutError, match="no 3 groups"):
        buffer.sample(3, weight_version=0, timeout_s=0.1)
    assert len(buffer) == 2  # a timed-out sample takes nothing
    buffer.put(pending, _results())
    groups, _ = buffer.sample(3, weight_version=0, timeout_s=1)
    assert sorted(g.position for g in groups) == [0, 1, 2]
    assert all(len(g.results) == G for g in groups)
    with pytest.raises(ValueError, match="position 0 is not claimed"):
        buffer.put(pending, _results())


def test_stale_groups_are_evicted_counted_and_generated_again() -> None:
    buffer = ReplayBuffer(DataOrder(100, seed=0), capacity=10, max_age=1)
    _fill(buffer, 2, version=0)
    _fill(buffer, 1, version=1)
    groups, evicted = buffer.sample(1, weight_version=2)
    assert evicted == 2 and buffer.evicted == 2
    assert [(g.position, g.age(2)) for g in groups] == [(2, 1)]
    # The evicted positions come back first, tagged with the current version.
    again = [buffer.claim(2), buffer.claim(2), buffer.claim(2)]
    assert [c.position for c in again if c is not None] == [0, 1, 3]
    assert all(c is not None and c.weight_version == 2 for c in again)


def test_finite_data_drains_then_ends() -> None:
    buffer = ReplayBuffer(DataOrder(5, seed=1, epochs=1), capacity=10, max_age=3)
    positions = _fill(buffer, 5, version=0)
    assert positions == [0, 1, 2, 3, 4]
    first, _ = buffer.sample(2, weight_version=0)
    rest, _ = buffer.sample(4, weight_version=0)  # only 3 left and none can come: a short step
    assert len(first) == 2 and len(rest) == 3
    assert sorted(g.row_id for g in first + rest) == [0, 1, 2, 3, 4]
    assert buffer.exhausted()
    assert buffer.sample(2, weight_version=0) == ([], 0)
    assert buffer.claim(0) is None


def test_snapshot_round_trip_keeps_groups_position_and_claims(tmp_path: Path) -> None:
    order = DataOrder(6, seed=3, epochs=1)
    buffer = ReplayBuffer(order, capacity=10, max_age=2)
    _fill(buffer, 2, version=0)
    in_flight = buffer.claim(1)
    assert in_flight is not None
    state, groups = buffer.snapshot()
    assert state == {"next_position": 3, "pending": [2], "evicted": 0}
    write_groups(tmp_path / "buffer.jsonl", groups)
    loaded = read_groups(tmp_path / "buffer.jsonl")
    assert loaded == groups
    assert loaded[0].results[1].error == "HTTP 400: bad video"
    assert loaded[0].results[2].reward == 0.0 and loaded[0].results[2].redispatches == 1

    restored = ReplayBuffer(order, capacity=10, max_age=2)
    restored.restore(state, loaded)
    # The group claimed before the snapshot is generated again, then the data continues.
    claims = [restored.claim(1) for _ in range(4)]
    assert [c.position for c in claims if c is not None] == [2, 3, 4, 5]
    for claim in claims:
        assert claim is not None
        restored.put(claim, _results())
    taken, _ = restored.sample(6, weight_version=1)
    assert sorted(g.position for g in taken) == list(range(6))
    assert restored.exhausted()
    with pytest.raises(RuntimeError, match="fresh buffer"):
        restored.restore(state, loaded)


def test_close_wakes_a_blocked_collector_and_trainer() -> None:
    buffer = ReplayBuffer(DataOrder(100, seed=0), capacity=1, max_age=1)
    _fill(buffer, 1, version=0)
    out: list[object] = []
    threads = [
        threading.Thread(target=lambda: out.append(buffer.claim(0))),
        threading.Thread(target=lambda: out.append(buffer.sample(5, weight_version=0))),
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    buffer.close()
    for thread in threads:
        thread.join(timeout=5)
    assert not any(t.is_alive() for t in threads)
    assert None in out


def _row_id_rebuilt(num_rows: int, seed: int, position: int) -> int:
    """``DataOrder.row_id`` as it was computed before the permutation was cached: the whole pass
    shuffled again for every position."""
    epoch, index = divmod(position, num_rows)
    order = list(range(num_rows))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return order[index]


def test_data_order_caches_a_pass_and_gives_the_same_rows_as_before() -> None:
    order = DataOrder(num_rows=7, seed=3)
    positions = list(range(5 * 7))
    assert [order.row_id(p) for p in positions] == [_row_id_rebuilt(7, 3, p) for p in positions]
    # Out of order too: an evicted position of an earlier pass handed out again, then back.
    for position in (34, 2, 33, 15, 0, 34):
        assert order.row_id(position) == _row_id_rebuilt(7, 3, position)
    # One shuffle per pass, not one per position.
    shuffles = 0
    real_shuffle = random.Random.shuffle

    def counting_shuffle(self: random.Random, x: list[int]) -> None:
        nonlocal shuffles
        shuffles += 1
        real_shuffle(self, x)

    fresh = DataOrder(num_rows=50, seed=1, epochs=3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(random.Random, "shuffle", counting_shuffle)
        rows = [fresh.row_id(p) for p in range(150)]
    assert shuffles == 3
    assert rows == [_row_id_rebuilt(50, 1, p) for p in range(150)]
    assert fresh == DataOrder(50, 1, 3) and "_last_pass" not in repr(fresh)


def test_a_groups_rollout_counts_survive_the_checkpoint(tmp_path: Path) -> None:
    buffer = ReplayBuffer(DataOrder(2, seed=0, epochs=1), capacity=4, max_age=1)
    claim = buffer.claim(0)
    assert claim is not None
    stats = RolloutStats(
        rows=3, outcomes=Counter(ok=2, content_failed=1), retries=1, wall_s=2.5, started_at=7.0
    )
    buffer.put(claim, _results(), stats)
    _, groups = buffer.snapshot()
    write_groups(tmp_path / "buffer.jsonl", groups)
    (loaded,) = read_groups(tmp_path / "buffer.jsonl")
    assert loaded.stats == stats and loaded.stats.outcomes["content_failed"] == 1
    assert loaded.stats.outcomes["ok"] == 2


def test_staleness_reports_the_age_of_a_steps_groups_and_the_buffer() -> None:
    buffer = ReplayBuffer(DataOrder(8, seed=0, epochs=1), capacity=8, max_age=3)
    _fill(buffer, 1, version=0)
    _fill(buffer, 2, version=2)
    groups, evicted = buffer.sample(3, weight_version=2)
    metrics = buffer.staleness(groups, 2, evicted)
    assert metrics == {
        "async/groups": 3.0,
        "async/age_mean": pytest.approx(2 / 3),
        "async/age_max": 2.0,
        "async/evicted": 0.0,
        "async/evicted_total": 0.0,
        "async/buffered": 0.0,
    }
