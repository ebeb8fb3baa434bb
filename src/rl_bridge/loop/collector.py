"""The async loop's collector: threads that generate complete groups into the replay buffer.

``rollout.max_in_flight // rollout.group_size`` threads each claim a data position from the
:class:`~rl_bridge.loop.replay.ReplayBuffer` (waiting while it is full), generate the whole group
(G samples of the row) through the Gym agent with whatever weights vLLM serves, and buffer it
tagged with the weight version at dispatch and the counts of its call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rl_bridge.loop.replay import ReplayBuffer
from rl_bridge.rollout import RolloutResult, RolloutStats

__all__ = ["Collector"]


class Collector:
    """Threads that generate complete groups into a :class:`ReplayBuffer` (see the module docstring)."""

    def __init__(
        self,
        buffer: ReplayBuffer,
        generate: Callable[[Mapping[str, Any]], tuple[list[RolloutResult], RolloutStats]],
        rows: Sequence[Mapping[str, Any]],
        *,
        workers: int,
        weight_version: Callable[[], int],
    ) -> None:
        """
        Args:
            buffer: where the groups go (and the data positions come from).
            generate: the G rollouts of one row and the call's counts (called from the collector's
                threads).
            rows: the training rows, indexed by the buffer's row ids.
            workers: groups generated at once.
            weight_version: the trainer's current weight version (read at each dispatch).
        """
        self.buffer = buffer
        self._generate = generate
        self._rows = rows
        self._weight_version = weight_version
        self._threads = [
            threading.Thread(target=self._work, name=f"collector-{i}", daemon=True) for i in range(workers)
        ]
        self._error: BaseException | None = None

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop claiming positions and wait for the groups being generated (they are buffered)."""
        self.buffer.close()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()

    def raise_if_failed(self) -> None:
        """Raise the collector's failure, if it had one.

        Raises:
            RuntimeError: a collector thread failed (chained to its exception).
        """
        if self._error is not None:
            raise RuntimeError(f"the rollout collector failed: {self._error!r}") from self._error

    def _work(self) -> None:
        while (claim := self.buffer.claim(self._weight_version())) is not None:
            try:
                results, stats = self._generate(self._rows[claim.row_id])
            except BaseException as error:
                self.buffer.release(claim)
                self._error = error
                self.buffer.close()
                return
            self.buffer.put(claim, results, stats)
