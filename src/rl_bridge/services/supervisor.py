"""Keep a server serving: notice that it died or stopped answering, restart it, count generations.

A :class:`ServiceSupervisor` wraps a running server handle (a
:class:`~rl_bridge.services.vllm_server.VLLMServer`, or anything with a ``process``, a
``health_url`` and a ``restart()``). Callers ask it :meth:`~ServiceSupervisor.ensure_healthy` when a
request failed in a way the server may be to blame for, and :meth:`~ServiceSupervisor.watch` runs
the same check every few seconds in a thread, so that a dead server comes back even while its
clients only wait (Gym's model server retries a vanished vLLM until it answers again, so the
requests in flight then finish on their own). :meth:`~ServiceSupervisor.ensure_healthy` probes the
server, restarts it when its process is gone or it failed
``probe_attempts`` probes in a row, and returns the server's **generation**: 0 for the first
launch, +1 per restart. A caller that remembers the generation it dispatched under can tell "the
server was restarted under my request" (generation changed: re-dispatch) from "the server is
fine, my request failed for another reason" (same generation)::

    server = start_vllm_server(config, log_dir=run_dir / "vllm")
    supervisor = ServiceSupervisor(server, on_restart=lambda s: refit_client.refit(latest, version="..."))
    with supervisor.watch(interval_s=5.0):
        results, stats = collect_rollouts(agent_url, rows, settings, supervisor=supervisor)

Concurrent callers are serialised: while one restarts the server the others wait, then see the new
generation. After ``max_restarts`` restarts, a further failure raises :class:`ServiceError`
(and so does every later call): a server that keeps dying needs a person, not another restart.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from rl_bridge.services.process import ManagedProcess, ServiceError

__all__ = ["RestartPolicy", "RestartRecord", "Restartable", "ServiceSupervisor"]


class Restartable(Protocol):
    """A server handle the supervisor can check and restart (e.g. ``VLLMServer``)."""

    @property
    def process(self) -> ManagedProcess: ...

    @property
    def health_url(self) -> str: ...

    def restart(self) -> None:
        """Stop whatever runs and start the server again at the same URL; return once healthy."""
        ...


ServerT = TypeVar("ServerT", bound=Restartable)


@dataclass(frozen=True)
class RestartPolicy:
    """When the supervisor restarts a server and when it gives up."""

    max_restarts: int = 3
    """Restarts over the supervisor's life; the next failure after them raises ``ServiceError``."""
    probe_timeout_s: float = 5.0
    """Longest wait for one health answer, seconds."""
    probe_attempts: int = 3
    """Failed health probes in a row, the process still running, before a hung server is restarted
    (a dead process is restarted at once)."""
    probe_interval_s: float = 1.0
    """Wait between two failed probes, seconds."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.probe_attempts < 1:
            raise ValueError(
                f"RestartPolicy: max_restarts={self.max_restarts} must be >= 0 and "
                f"probe_attempts={self.probe_attempts} >= 1"
            )
        if not self.probe_timeout_s > 0 or self.probe_interval_s < 0:
            raise ValueError(
                f"RestartPolicy: probe_timeout_s={self.probe_timeout_s} must be > 0 and "
                f"probe_interval_s={self.probe_interval_s} >= 0"
            )


@dataclass(frozen=True)
class RestartRecord:
    """One restart the supervisor made."""

    generation: int
    """The generation the restart started (1 for the first restart)."""
    reason: str
    """Why the server was judged down (exit code, or the last probe error)."""
    restart_s: float
    """Seconds from stopping the old server to the new one answering its health check."""


class ServiceSupervisor(Generic[ServerT]):
    """Restarts ``server`` when it is down; see the module docstring. Thread-safe."""

    def __init__(
        self,
        server: ServerT,
        policy: RestartPolicy | None = None,
        *,
        on_restart: Callable[[ServerT], None] | None = None,
    ) -> None:
        """
        Args:
            server: a running server; the supervisor restarts it in place (``server.restart()``).
            policy: when to restart and give up; ``None`` means the defaults.
            on_restart: called (under the supervisor's lock, before waiting callers resume) after
                each successful restart, e.g. to load the latest weights into a new vLLM. An
                exception from it counts as a failed restart.
        """
        self.server = server
        self.policy = policy or RestartPolicy()
        self.on_restart = on_restart
        """The restart hook; may be set after construction (e.g. by the loop that owns the weights)."""
        self._lock = threading.Lock()
        self._generation = 0
        self._restarts: list[RestartRecord] = []
        self._gave_up: str | None = None

    @property
    def generation(self) -> int:
        """0 for the server as given, +1 per restart."""
        return self._generation

    @property
    def restarts(self) -> tuple[RestartRecord, ...]:
        """Every restart so far, oldest first."""
        return tuple(self._restarts)

    def probe(self) -> str | None:
        """One health check: ``None`` when the server answers 200, else why not."""
        exit_code = self.server.process.poll()
        if exit_code is not None:
            return f"{self.server.process.name} exited with code {exit_code}"
        url = self.server.health_url
        try:
            with urllib.request.urlopen(url, timeout=self.policy.probe_timeout_s) as response:
                return None if response.status == 200 else f"{url} answered HTTP {response.status}"
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
            return f"{url} did not answer: {error!r}"

    def ensure_healthy(self) -> int:
        """Probe the server and restart it if it is down; return its generation, once healthy.

        Raises:
            ServiceError: the server is down and ``max_restarts`` restarts were already made, or
                the restart itself failed (the server log tail is in the message). Every later
                call raises it again.
        """
        with self._lock:
            if self._gave_up is not None:
                raise ServiceError(self._gave_up)
            problem = self._down_reason()
            if problem is not None:
                self._restart(problem)
            return self._generation

    @property
    def failure(self) -> str | None:
        """Why the supervisor gave up (every later :meth:`ensure_healthy` raises it); ``None`` until then."""
        return self._gave_up

    @contextlib.contextmanager
    def watch(self, interval_s: float = 5.0) -> Iterator[None]:
        """Within the block, a daemon thread calls :meth:`ensure_healthy` every ``interval_s`` seconds.

        The thread ends when the block does, or when the supervisor gives up (:attr:`failure`);
        leaving the block waits for a restart in progress to finish.
        """
        if not interval_s > 0:
            raise ValueError(f"watch: interval_s={interval_s} must be > 0")
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    self.ensure_healthy()
                except ServiceError:
                    return  # recorded in self.failure; callers get it from ensure_healthy()

        thread = threading.Thread(target=loop, name=f"watch:{self.server.process.name}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _down_reason(self) -> str | None:
        """``None`` when healthy; else why the server counts as down (after ``probe_attempts``)."""
        problem: str | None = None
        for attempt in range(self.policy.probe_attempts):
            if attempt:
                time.sleep(self.policy.probe_interval_s)
            problem = self.probe()
            if problem is None or self.server.process.poll() is not None:
                return problem
        return problem

    def _restart(self, reason: str) -> None:
        if len(self._restarts) >= self.policy.max_restarts:
            self._gave_up = (
                f"{self.server.process.name} is down ({reason}) and was already restarted "
                f"{len(self._restarts)} times (max_restarts={self.policy.max_restarts}); giving up"
            )
            raise ServiceError(self._gave_up)
        started = time.monotonic()
        try:
            self.server.restart()
            if self.on_restart is not None:
                self.on_restart(self.server)
        except Exception as error:
            self._gave_up = f"restarting {self.server.process.name} after '{reason}' failed: {error}"
            raise ServiceError(self._gave_up) from error
        self._generation += 1
        self._restarts.append(RestartRecord(self._generation, reason, time.monotonic() - started))

    def __repr__(self) -> str:
        return f"ServiceSupervisor({self.server!r}, generation={self._generation})"
