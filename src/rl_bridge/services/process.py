"""A child process that is always cleaned up: its own process group, a log file, a health check.

Every server this project starts (vLLM, Gym servers) goes through :class:`ManagedProcess`, so
that a failing test, a Ctrl-C or an exception in the trainer never leaves orphans behind:
the child gets its own session, :meth:`ManagedProcess.stop` signals the whole group (SIGTERM,
then SIGKILL), and an ``atexit`` hook stops whatever is still running when the interpreter exits.
"""

from __future__ import annotations

import atexit
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "DEFAULT_PORT_RANGE",
    "PORT_RANGE_ENV",
    "ManagedProcess",
    "ServiceError",
    "free_port",
    "wait_for_http",
]


class ServiceError(RuntimeError):
    """A managed service failed to start, died, or did not become healthy in time."""


# Independent of the run's seeded ``random``: processes seeded alike must not draw alike.
_PORT_DRAWS = random.SystemRandom()
#: Where :func:`free_port` draws from: above Ray's worker ports (10002-19999 by default, which its
#: workers bind as they start) and, on Linux's default range, below the kernel's ephemeral ports.
DEFAULT_PORT_RANGE = range(20_000, 32_768)
#: ``LOW-HIGH``: the ports :func:`free_port` draws from instead, e.g. one slice per concurrent test
#: worker, so that processes drawing at once never draw the same port.
PORT_RANGE_ENV = "VIDEO_GRPO_PORT_RANGE"
# Ports this process handed out: a port is never handed out twice (two servers launched back to
# back, neither bound yet, would otherwise be able to get the same one).
_handed_out: set[int] = set()


def _port_range() -> range:
    spec = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not spec:
        return DEFAULT_PORT_RANGE
    try:
        low, high = (int(v) for v in spec.split("-"))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV}={spec!r}: expected LOW-HIGH, e.g. 20000-26383") from None
    if not 1024 <= low <= high <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV}={spec!r}: expected 1024 <= LOW <= HIGH <= 65535")
    return range(low, high + 1)


def _ephemeral_ports() -> range:
    """The kernel's range for ports it assigns itself (outgoing connections, ``bind(0)``)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now (loopback by default).

    The port is drawn at random from 20000-32767 (or ``$VIDEO_GRPO_PORT_RANGE``) minus the
    kernel's ephemeral range, so that between this call and the server binding it, no outgoing
    connection or ``bind(0)`` socket of any process (gloo pairs, HTTP clients) and no Ray worker
    can be given it: with ``bind(0)`` itself, a vLLM server occasionally lost its port to one and
    failed with "Address already in use". No port is handed out twice by one process. When none of
    64 draws is free, ``bind(0)`` decides. :func:`wait_for_http` checks that the server it waits
    for is the one listening.
    """
    ephemeral = _ephemeral_ports()
    candidates = [p for p in _port_range() if p not in ephemeral and p not in _handed_out]
    for port in _PORT_DRAWS.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_http(
    url: str,
    *,
    timeout_s: float,
    process: ManagedProcess | None = None,
    interval_s: float = 0.5,
) -> None:
    """Poll ``url`` until it answers HTTP 200, ``timeout_s`` passes, or ``process`` dies.

    With ``process``, the answer must come from it: a server that lost its port to another
    process ("Address already in use") while that one answers must not pass for healthy.

    Raises:
        ServiceError: on timeout, when ``process`` exits first, or when another process holds
            the port; the message includes the tail of the process log.
    """
    deadline = time.monotonic() + timeout_s
    last_error: str = "no attempt"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ServiceError(
                f"{process.name} exited with code {process.poll()} before {url} became healthy.\n"
                f"--- last lines of {process.log_path} ---\n{process.log_tail()}"
            )
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                status = response.status
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            last_error = repr(exc)
        else:
            if status == 200:
                if process is not None:
                    process.check_listening(url)
                return
            last_error = f"HTTP {status}"
        time.sleep(interval_s)
    tail = f"\n--- last lines of {process.log_path} ---\n{process.log_tail()}" if process else ""
    raise ServiceError(f"{url} not healthy after {timeout_s:.0f} s (last error: {last_error}).{tail}")


_live: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for proc in list(_live):
        proc.stop()


class ManagedProcess:
    """A subprocess in its own process group, logging to a file, stopped with its whole group.

    Use as a context manager or call :meth:`stop` (safe to call more than once)::

        with ManagedProcess("vllm", [python, "-m", "rl_bridge.services.vllm_serve", ...],
                            log_path=run_dir / "vllm.log") as proc:
            wait_for_http("http://127.0.0.1:8000/health", timeout_s=300, process=proc)
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._env = None if env is None else dict(env)
        self._cwd = cwd
        full_env = dict(os.environ)
        if env is not None:
            full_env.update(env)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=None if cwd is None else str(cwd),
            start_new_session=True,
        )
        _live.add(self)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def check_listening(self, url: str) -> None:
        """Raise :class:`ServiceError` unless this process or one it started listens on ``url``'s
        port (the answer came from another process)."""
        import psutil

        port = urllib.parse.urlsplit(url).port
        listening = (c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN)
        owners = {c.pid for c in listening if c.laddr.port == port}
        try:
            root = psutil.Process(self.pid)
            ours = {self.pid, *(child.pid for child in root.children(recursive=True))}
        except psutil.NoSuchProcess:
            ours = set()
        if owners & ours:
            return
        holders = ", ".join(str(pid) for pid in sorted(p for p in owners if p is not None)) or "unknown"
        raise ServiceError(
            f"{url} answered, but not from {self.name}: port {port} is held by another process "
            f"(pid {holders}).\n--- last lines of {self.log_path} ---\n{self.log_tail()}"
        )

    def poll(self) -> int | None:
        """Exit code, or ``None`` while running."""
        return self._proc.poll()

    def wait(self, timeout_s: float | None = None) -> int:
        """Block until the process exits (or ``timeout_s`` passes: ``subprocess.TimeoutExpired``)."""
        return self._proc.wait(timeout=timeout_s)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the process log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<log unreadable: {exc}>"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, *, timeout_s: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``timeout_s``."""
        if self._proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self._proc.wait(timeout=10)
        # Children that ignored SIGTERM (engine cores, Ray workers) must not survive their leader.
        self._signal_group(signal.SIGKILL)
        if not self._log.closed:
            self._log.close()
        _live.discard(self)

    def respawn(self) -> ManagedProcess:
        """Stop this process (and its group) and start the same command again.

        The new process has this one's name, argv, extra environment and working directory, and
        appends to the same log file. This object stays stopped; use the returned one.
        """
        self.stop()
        return ManagedProcess(self.name, self.argv, log_path=self.log_path, env=self._env, cwd=self._cwd)

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.poll() is None else f"exited({self.poll()})"
        return f"ManagedProcess({self.name!r}, pid={self.pid}, {state}, log={str(self.log_path)!r})"
