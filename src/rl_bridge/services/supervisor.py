"""Keep a server serving: notice that it died or stopped answering, restart it, count generations.

A :class:`ServiceSupervisor` wraps a running server handle (a
:class:`~rl_bridge.services.vllm_server.VLLMServer`, or anything with a ``process``, a
``health_url`` and a ``restart()``). Callers ask it :meth:`~ServiceSupervisor.ensure_healthy` when a
request failed in a way the server may be to blame for, and :meth:`~ServiceSupervisor.watch` runs
the same check every few seconds in a thread, so that a dead server comes back even while its
clients only wait (a Gym model server that retries a vanished vLLM until it answers again finishes
its requests in flight on its own; the loop's gives up after a few seconds instead, so that the
caller re-dispatches, and can tell which input kills the server, below).
:meth:`~ServiceSupervisor.ensure_healthy` probes the server, restarts it when its process is gone
or it failed ``probe_attempts`` probes in a row, and returns the server's **generation**: 0 for the first
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

**Several servers.** A supervisor can watch a group (the vLLM replicas of a run behind one Gym
model server): each is probed and restarted on its own, and the generation counts the group's
restarts. A caller does not know which replica served its request (Gym spreads sessions over them),
so a restart of any replica counts as "restarted under" a request that failed meanwhile: at worst
an innocent request is re-dispatched, or dispatched alone once.

**An input that kills the server.** A video that crashes vLLM's decoder would, re-dispatched
after every restart, spend the whole restart budget and end the run. So requests go through
:meth:`~ServiceSupervisor.dispatch` with a key naming their input (the rollout client uses the
prompt), and the supervisor keeps the evidence: every restart that happened while an input was in
flight is a *strike* against it. An input with ``crash_budget`` strikes is a suspect and is
dispatched *alone* (no other request is in flight meanwhile); if the server dies then, the input
is convicted: this and every later dispatch of it raises :class:`InputCrashedServer` (a row
failure, with the reason), and the restarts it caused no longer count against ``max_restarts``.
A suspect that runs alone without a crash is cleared. Innocent inputs that were in flight with a
guilty one run alone once, and are never convicted::

    with supervisor.dispatch(key) as dispatch:
        try:
            answer = post(row)
        except ConnectionError:
            if supervisor.restarted_under(dispatch):  # raises InputCrashedServer when convicted
                ...  # re-dispatch: the server was restarted under this request
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from rl_bridge.services.process import ManagedProcess, ServiceError

__all__ = [
    "Dispatch",
    "InputCrashedServer",
    "RestartPolicy",
    "RestartRecord",
    "Restartable",
    "ServiceSupervisor",
]


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
    """Restarts over the supervisor's life, not counting those of convicted inputs nor one while a
    suspect runs alone; the next failure after them raises ``ServiceError``. An input's first
    ``crash_budget`` restarts count until it is convicted: keep ``max_restarts >= crash_budget`` so
    that one bad input never ends a run."""
    crash_budget: int = 1
    """Restarts an input may be in flight for, among other requests, before it is dispatched alone
    (where one more restart convicts it)."""
    probe_timeout_s: float = 5.0
    """Longest wait for one health answer, seconds."""
    probe_attempts: int = 3
    """Failed health probes in a row, the process still running, before a hung server is restarted
    (a dead process is restarted at once)."""
    probe_interval_s: float = 1.0
    """Wait between two failed probes, seconds."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.probe_attempts < 1 or self.crash_budget < 1:
            raise ValueError(
                f"RestartPolicy: max_restarts={self.max_restarts} must be >= 0, "
                f"probe_attempts={self.probe_attempts} >= 1 and crash_budget={self.crash_budget} >= 1"
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
    server: str
    """The restarted server's process name."""
    reason: str
    """Why the server was judged down (exit code, or the last probe error)."""
    restart_s: float
    """Seconds from stopping the old server to the new one answering its health check."""


class InputCrashedServer(Exception):
    """The input was convicted of killing the server (see the module docstring); the message says
    how often and the last restart's reason."""


@dataclass
class Dispatch:
    """One request in flight under :meth:`ServiceSupervisor.dispatch`."""

    key: str
    generation: int
    """The server's generation when the request went out."""
    alone: bool
    """Dispatched alone, as a suspect: no other request was in flight meanwhile."""
    crashed: bool = False
    """The server was restarted under the request (set by :meth:`ServiceSupervisor.restarted_under`)."""


class _Gate:
    """Many shared holders or one exclusive holder; a waiting exclusive holder goes first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._exclusive_waiting = 0

    @property
    def exclusive(self) -> bool:
        """An exclusive holder holds the gate now."""
        return self._exclusive

    @contextlib.contextmanager
    def hold(self, *, exclusive: bool) -> Iterator[None]:
        with self._cond:
            if exclusive:
                self._exclusive_waiting += 1
                self._cond.wait_for(lambda: not self._exclusive and self._shared == 0)
                self._exclusive_waiting -= 1
                self._exclusive = True
            else:
                self._cond.wait_for(lambda: not self._exclusive and self._exclusive_waiting == 0)
                self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                if exclusive:
                    self._exclusive = False
                else:
                    self._shared -= 1
                self._cond.notify_all()


class ServiceSupervisor(Generic[ServerT]):
    """Restarts ``server`` (or each server of a group) when it is down; see the module docstring.
    Thread-safe."""

    def __init__(
        self,
        server: ServerT | Sequence[ServerT],
        policy: RestartPolicy | None = None,
        *,
        on_restart: Callable[[ServerT], None] | None = None,
    ) -> None:
        """
        Args:
            server: a running server, or several; the supervisor restarts each in place
                (``server.restart()``).
            policy: when to restart and give up (``max_restarts`` over the whole group); ``None``
                means the defaults.
            on_restart: called with the restarted server (under the supervisor's lock, before
                waiting callers resume) after each successful restart, e.g. to load the latest
                weights into a new vLLM. An exception from it counts as a failed restart.
        """
        self.servers: tuple[ServerT, ...] = tuple(server) if isinstance(server, Sequence) else (server,)
        if not self.servers:
            raise ValueError("ServiceSupervisor: no server to supervise")
        self.server = self.servers[0]
        """The first server (the only one, unless a group was given)."""
        self.policy = policy or RestartPolicy()
        self.on_restart = on_restart
        """The restart hook; may be set after construction (e.g. by the loop that owns the weights)."""
        self._lock = threading.Lock()
        self._generation = 0
        self._restarts: list[RestartRecord] = []
        self._gave_up: str | None = None
        self._gate = _Gate()
        self._triage_lock = threading.Lock()  # not the restart lock: a restart takes minutes
        self._strikes: dict[str, set[int]] = {}
        """Per input key: the generations started by restarts while it was in flight."""
        self._convicted: dict[str, str] = {}
        """Per convicted input key: why."""
        self._excused: set[int] = set()
        """Generations started by restarts that a convicted input caused."""

    @property
    def generation(self) -> int:
        """0 for the server as given, +1 per restart."""
        return self._generation

    @property
    def restarts(self) -> tuple[RestartRecord, ...]:
        """Every restart so far, oldest first."""
        return tuple(self._restarts)

    def probe(self) -> str | None:
        """One health check of every server: ``None`` when each answers 200, else why the first
        that does not is down."""
        return next(filter(None, map(self._probe, self.servers)), None)

    def _probe(self, server: ServerT) -> str | None:
        if (exited := self._exited(server)) is not None:
            return exited
        url = server.health_url
        try:
            with urllib.request.urlopen(url, timeout=self.policy.probe_timeout_s) as response:
                return None if response.status == 200 else f"{url} answered HTTP {response.status}"
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
            # A server being killed resets the connection before its process can be reaped: the
            # exit, once visible, is the better reason.
            return self._exited(server) or f"{url} did not answer: {error!r}"

    @staticmethod
    def _exited(server: ServerT) -> str | None:
        exit_code = server.process.poll()
        return None if exit_code is None else f"{server.process.name} exited with code {exit_code}"

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
            for server in self.servers:
                problem = self._down_reason(server)
                if problem is not None:
                    self._restart(server, problem)
            return self._generation

    @property
    def convicted(self) -> dict[str, str]:
        """The inputs convicted of killing the server, with the reason (a copy)."""
        with self._triage_lock:
            return dict(self._convicted)

    @contextlib.contextmanager
    def dispatch(self, key: str) -> Iterator[Dispatch]:
        """Hold while a request for input ``key`` is in flight; a suspect holds the server alone.

        Raises:
            InputCrashedServer: ``key`` was convicted; nothing is dispatched.
        """
        with self._triage_lock:
            if key in self._convicted:
                raise InputCrashedServer(self._convicted[key])
            alone = len(self._strikes.get(key, ())) >= self.policy.crash_budget
        with self._gate.hold(exclusive=alone):
            with self._triage_lock:
                if key in self._convicted:  # convicted while this dispatch waited for the gate
                    raise InputCrashedServer(self._convicted[key])
                dispatch = Dispatch(key, self._generation, alone)
            yield dispatch
            if alone and not dispatch.crashed:
                with self._triage_lock:
                    self._strikes.pop(key, None)

    def restarted_under(self, dispatch: Dispatch) -> bool:
        """After ``dispatch``'s request failed: make sure the server is up (:meth:`ensure_healthy`)
        and say whether it was restarted under the request, recording the strike.

        Raises:
            InputCrashedServer: the request ran alone and the server died: ``dispatch.key`` is
                convicted, its restarts excused.
            ServiceError: as :meth:`ensure_healthy`.
        """
        generation = self.ensure_healthy()
        if generation == dispatch.generation:
            return False
        dispatch.crashed = True
        with self._triage_lock:
            strikes = self._strikes.setdefault(dispatch.key, set())
            strikes.update(range(dispatch.generation + 1, generation + 1))
            if not dispatch.alone:
                return True
            self._excused.update(strikes)
            self._convicted[dispatch.key] = (
                f"{self._restarts[-1].server} was restarted {len(strikes)} times while this input was in "
                f"flight, the last time while it ran alone (so it killed the server: "
                f"{self._restarts[-1].reason}); it is not dispatched again"
            )
            raise InputCrashedServer(self._convicted[dispatch.key])

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

    def _down_reason(self, server: ServerT) -> str | None:
        """``None`` when healthy; else why ``server`` counts as down (after ``probe_attempts``)."""
        problem: str | None = None
        for attempt in range(self.policy.probe_attempts):
            if attempt:
                time.sleep(self.policy.probe_interval_s)
            problem = self._probe(server)
            if problem is None:
                return None
            if (exited := self._exited(server)) is not None:
                return exited
        return problem

    def _restart(self, server: ServerT, reason: str) -> None:
        counted = len(self._restarts) - len(self._excused)
        # A restart while a suspect runs alone is the suspect's: its conviction excuses it.
        if counted >= self.policy.max_restarts and not self._gate.exclusive:
            excused = f", besides {len(self._excused)} caused by convicted inputs" if self._excused else ""
            self._gave_up = (
                f"{server.process.name} is down ({reason}) and was already restarted "
                f"{counted} times{excused} (max_restarts={self.policy.max_restarts}); giving up"
            )
            raise ServiceError(self._gave_up)
        started = time.monotonic()
        try:
            server.restart()
            if self.on_restart is not None:
                self.on_restart(server)
        except Exception as error:
            self._gave_up = f"restarting {server.process.name} after '{reason}' failed: {error}"
            raise ServiceError(self._gave_up) from error
        self._generation += 1
        self._restarts.append(
            RestartRecord(self._generation, server.process.name, reason, time.monotonic() - started)
        )

    def __repr__(self) -> str:
        servers = self.server if len(self.servers) == 1 else list(self.servers)
        return f"ServiceSupervisor({servers!r}, generation={self._generation})"
