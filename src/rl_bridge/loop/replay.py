"""The async loop's replay buffer: complete groups tagged with weight version and data position.

The training data is a stream of *positions* ``0, 1, 2, ...``: position ``p`` is row
``DataOrder.row_id(p)`` of pass ``p // num_rows``, each pass a seeded permutation of the rows, so
the data position is one integer and the seed. One position becomes one **group** (G samples of
its row).

:class:`ReplayBuffer` is shared by the collector threads and the trainer (thread-safe, one lock):

- the collector :meth:`~ReplayBuffer.claim`\\ s a position (blocking while buffered plus claimed
  groups fill ``capacity``: back-pressure), generates the whole group and
  :meth:`~ReplayBuffer.put`\\ s it, tagged with the weight version it was dispatched at;
- the trainer :meth:`~ReplayBuffer.sample`\\ s complete groups, oldest first. Groups older than
  ``max_age`` weight versions are evicted first: counted, and their positions handed out again
  (generated anew with current weights), so no position is lost;
- :meth:`~ReplayBuffer.snapshot` and :meth:`~ReplayBuffer.restore` carry the buffered groups, the
  next position and the positions claimed but not yet buffered (generated again after a resume)
  across a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_bridge.rollout import RolloutResult, RolloutStats

__all__ = ["Claim", "DataOrder", "Group", "ReplayBuffer", "read_groups", "write_groups"]


@dataclass(frozen=True)
class DataOrder:
    """Which training row each data position is.

    Pass ``e`` visits every row once, in the order ``random.Random(f"{seed}/{e}").shuffle``
    gives, so position ``p`` depends only on ``seed``, ``num_rows`` and ``p``. The permutation of
    the last pass asked for is kept, so :meth:`row_id` costs O(1) except at the first position of
    a pass (and at a position of another pass handed out again after an eviction): O(rows).
    """

    num_rows: int
    seed: int
    epochs: int | None = None
    """Passes over the rows; ``None``: unbounded."""
    _last_pass: tuple[int, tuple[int, ...]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    """``(pass, its permutation)`` of the last :meth:`row_id` call; a cache, not state."""

    def __post_init__(self) -> None:
        if self.num_rows < 1:
            raise ValueError(f"DataOrder: num_rows must be >= 1, got {self.num_rows}")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"DataOrder: epochs must be >= 1 or None, got {self.epochs}")

    @property
    def total(self) -> int | None:
        """Positions in the whole stream (``None``: unbounded)."""
        return None if self.epochs is None else self.epochs * self.num_rows

    def row_id(self, position: int) -> int:
        """The training row of ``position``.

        Raises:
            IndexError: ``position`` is negative or past the last pass.
        """
        if position < 0 or (self.total is not None and position >= self.total):
            raise IndexError(f"data position {position} is outside [0, {self.total})")
        epoch, index = divmod(position, self.num_rows)
        return self._permutation(epoch)[index]

    def _permutation(self, epoch: int) -> tuple[int, ...]:
        """The rows of pass ``epoch`` in visiting order (cached for the last pass asked for)."""
        cached = self._last_pass  # one read: another thread may replace it meanwhile
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order = list(range(self.num_rows))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        permutation = tuple(order)
        object.__setattr__(self, "_last_pass", (epoch, permutation))  # frozen dataclass: the cache only
        return permutation


@dataclass(frozen=True)
class Claim:
    """A position handed to the collector: generate its group, then :meth:`ReplayBuffer.put` it."""

    position: int
    row_id: int
    weight_version: int
    """The trainer's weight version when the group was dispatched (the steps trained so far)."""


@dataclass(frozen=True)
class Group:
    """The G rollouts of one data position."""

    position: int
    row_id: int
    weight_version: int
    """Weight version at dispatch; with in-flight refits later tokens may come from newer weights
    (vLLM's logprobs of the sampled tokens, used for the IS correction, are always the true ones)."""
    results: tuple[RolloutResult, ...]
    stats: RolloutStats | None = None
    """The counts of the call that generated the group (``None``: it was buffered by a run that
    did not keep them)."""

    def age(self, version: int) -> int:
        """Weight versions between this group's dispatch and ``version``."""
        return version - self.weight_version

    def to_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "row_id": self.row_id,
            "weight_version": self.weight_version,
            "results": [dataclasses.asdict(r) for r in self.results],
            "stats": _stats_to_json(self.stats),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Group:
        return cls(
            position=int(data["position"]),
            row_id=int(data["row_id"]),
            weight_version=int(data["weight_version"]),
            results=tuple(RolloutResult(**r) for r in data["results"]),
            stats=_stats_from_json(data.get("stats")),
        )


def _stats_to_json(stats: RolloutStats | None) -> dict[str, Any] | None:
    if stats is None:
        return None
    # not dataclasses.asdict: it rebuilds the outcomes Counter from its (name, count) pairs
    return {**vars(stats), "outcomes": dict(stats.outcomes)}


def _stats_from_json(data: dict[str, Any] | None) -> RolloutStats | None:
    if data is None:
        return None
    return RolloutStats(**{**data, "outcomes": Counter(data["outcomes"])})


def write_groups(path: Path, groups: Iterable[Group]) -> None:
    """Write ``groups`` as JSON lines (one group per line)."""
    with path.open("w", encoding="utf-8") as out:
        for group in groups:
            out.write(json.dumps(group.to_json()) + "\n")


def read_groups(path: Path) -> list[Group]:
    """The groups :func:`write_groups` wrote, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [Group.from_json(json.loads(line)) for line in lines if line.strip()]


@dataclass
class _Ledger:
    next_position: int = 0
    requeued: deque[int] = field(default_factory=deque)
    """Positions to generate (again) before ``next_position``: evicted, or claimed before a resume."""
    claimed: set[int] = field(default_factory=set)
    evicted: int = 0


class ReplayBuffer:
    """Complete groups between the collector and the trainer (see the module docstring)."""

    def __init__(self, order: DataOrder, *, capacity: int, max_age: int) -> None:
        """
        Args:
            order: the data positions to hand out.
            capacity: most groups buffered plus claimed at once.
            max_age: oldest group :meth:`sample` returns, in weight versions.

        Raises:
            ValueError: ``capacity < 1`` or ``max_age < 0``.
        """
        if capacity < 1 or max_age < 0:
            raise ValueError(f"ReplayBuffer: capacity={capacity} must be >= 1 and max_age={max_age} >= 0")
        self.order = order
        self.capacity = capacity
        self.max_age = max_age
        self._groups: list[Group] = []
        self._ledger = _Ledger()
        self._closed = False
        self._cond = threading.Condition()

    # -- collector side ----------------------------------------------------------------------------

    def claim(self, weight_version: int) -> Claim | None:
        """The next position to generate, tagged with ``weight_version``.

        Blocks while the buffer is full, and while the data is used up but buffered or claimed
        groups may still be evicted (their positions then come back). ``None``: the buffer was
        closed, or the data is used up and every group consumed (see :meth:`exhausted`).
        """
        with self._cond:
            while not self._closed and (
                (self._has_data() and self._occupied() >= self.capacity)
                or (not self._has_data() and self._occupied() > 0)
            ):
                self._cond.wait()
            if self._closed or not self._has_data():
                return None
            ledger = self._ledger
            if ledger.requeued:
                position = ledger.requeued.popleft()
            else:
                position = ledger.next_position
                ledger.next_position += 1
            ledger.claimed.add(position)
            return Claim(position, self.order.row_id(position), weight_version)

    def put(self, claim: Claim, results: Sequence[RolloutResult], stats: RolloutStats | None = None) -> None:
        """Buffer the complete group of ``claim`` (``stats``: the counts of the call that generated it).

        Raises:
            ValueError: ``claim`` is not outstanding (never claimed, or already put or released).
        """
        with self._cond:
            self._settle(claim)
            self._groups.append(
                Group(claim.position, claim.row_id, claim.weight_version, tuple(results), stats)
            )
            self._cond.notify_all()

    def release(self, claim: Claim) -> None:
        """Give ``claim`` back ungenerated; its position is handed out again."""
        with self._cond:
            self._settle(claim)
            self._ledger.requeued.append(claim.position)
            self._cond.notify_all()

    # -- trainer side ------------------------------------------------------------------------------

    def sample(
        self, n: int, weight_version: int, *, timeout_s: float | None = None
    ) -> tuple[list[Group], int]:
        """Take ``n`` complete groups, oldest first, for training at ``weight_version``.

        Groups older than ``max_age`` are evicted first (their positions are generated again).
        Blocks until ``n`` groups are buffered, or fewer once no more can come (data used up and
        nothing claimed, or the buffer closed): then it returns what is left, possibly nothing.

        Returns:
            The groups, and how many were evicted by this call.

        Raises:
            ValueError: ``n < 1``.
            TimeoutError: ``timeout_s`` seconds passed without ``n`` groups (none are taken).
        """
        if n < 1:
            raise ValueError(f"ReplayBuffer.sample: n must be >= 1, got {n}")
        with self._cond:
            evicted = self._evict(weight_version)
            while len(self._groups) < n and not self._finished():
                if not self._cond.wait(timeout=timeout_s):
                    raise TimeoutError(f"no {n} groups within {timeout_s} s ({len(self._groups)} buffered)")
                evicted += self._evict(weight_version)
            self._groups.sort(key=lambda g: (g.weight_version, g.position))
            taken, self._groups = self._groups[:n], self._groups[n:]
            self._cond.notify_all()
            return taken, evicted

    def close(self) -> None:
        """Stop handing out positions and wake every waiter (claims return ``None``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- state -------------------------------------------------------------------------------------

    @property
    def evicted(self) -> int:
        """Groups evicted for age so far (over resumes)."""
        with self._cond:
            return self._ledger.evicted

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def exhausted(self) -> bool:
        """Whether every data position was handed out and its group consumed: no more groups
        will come and none is buffered."""
        with self._cond:
            return not self._has_data() and self._occupied() == 0

    def staleness(self, groups: Sequence[Group], trained_at: int, evicted: int) -> dict[str, float]:
        """The ``async/*`` metrics of a step that trained on ``groups`` with the weights of version
        ``trained_at``, after :meth:`sample` evicted ``evicted`` groups: the groups' count and age
        (mean and max, in versions), evictions (this step's and the run's) and the groups buffered."""
        ages = [group.age(trained_at) for group in groups]
        return {
            "async/groups": float(len(groups)),
            "async/age_mean": sum(ages) / len(ages),
            "async/age_max": float(max(ages)),
            "async/evicted": float(evicted),
            "async/evicted_total": float(self.evicted),
            "async/buffered": float(len(self)),
        }

    def snapshot(self) -> tuple[dict[str, Any], list[Group]]:
        """The state to checkpoint: a JSON-able ledger (next position, positions to generate
        again: requeued and currently claimed ones, eviction count) and the buffered groups."""
        with self._cond:
            ledger = self._ledger
            pending = sorted({*ledger.requeued, *ledger.claimed})
            state = {"next_position": ledger.next_position, "pending": pending, "evicted": ledger.evicted}
            return state, list(self._groups)

    def restore(self, state: dict[str, Any], groups: Sequence[Group]) -> None:
        """Load what :meth:`snapshot` returned into this (new, unused) buffer.

        Raises:
            RuntimeError: the buffer was already used.
        """
        with self._cond:
            if self._groups or self._ledger.claimed or self._ledger.next_position:
                raise RuntimeError("ReplayBuffer.restore needs a fresh buffer")
            self._ledger = _Ledger(
                next_position=int(state["next_position"]),
                requeued=deque(int(p) for p in state["pending"]),
                evicted=int(state["evicted"]),
            )
            self._groups = list(groups)
            self._cond.notify_all()

    # -- internals (lock held) ---------------------------------------------------------------------

    def _occupied(self) -> int:
        return len(self._groups) + len(self._ledger.claimed)

    def _has_data(self) -> bool:
        total = self.order.total
        return bool(self._ledger.requeued) or total is None or self._ledger.next_position < total

    def _finished(self) -> bool:
        return self._closed or (not self._has_data() and not self._ledger.claimed)

    def _settle(self, claim: Claim) -> None:
        if claim.position not in self._ledger.claimed:
            raise ValueError(f"position {claim.position} is not claimed (already put or released?)")
        self._ledger.claimed.discard(claim.position)

    def _evict(self, weight_version: int) -> int:
        stale = [g for g in self._groups if g.age(weight_version) > self.max_age]
        if stale:
            self._groups = [g for g in self._groups if g.age(weight_version) <= self.max_age]
            self._ledger.requeued.extend(g.position for g in stale)
            self._ledger.evicted += len(stale)
            self._cond.notify_all()
        return len(stale)
