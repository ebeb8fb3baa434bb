"""What ``video-grpo train`` shows: the project's own progress on the console, everything else in
the run's log.

A run imports torch, vLLM, transformers, Megatron-Core and Megatron-Bridge into the trainer process,
and each speaks on import or while the policy is built: Apex and Transformer Engine fallbacks (this
package runs without either on purpose), Megatron-Bridge's INFO record of an optional FP8 symbol
with its traceback, the DDP parameter list, config dumps. None of it is a fault, and on the
console it buried the run's own lines (99 lines before the first progress bar). So:

1. :func:`capture` (the CLI calls it before torch loads): the root logger gets a memory buffer, Python
   warnings go through logging, and the ``rl_bridge`` logger (this project's) prints its INFO lines
   to stderr as ``[video-grpo] ...``;
2. :func:`attach_run_log` (the loop calls it once the run directory exists) writes the buffer and
   everything after it to ``<run_dir>/logs/trainer.log``, takes over the loggers of libraries that
   print through their own handlers (vLLM, torch, transformers) and, inside
   :func:`stdout_to_run_log`, what libraries print to stdout while the task and roles start.

Nothing is dropped: a warning that was on the console is in the log, with its time and logger.
Errors of this project still reach the console (``rl_bridge`` WARNING and above, and exceptions).
Without :func:`capture` (a script of one's own calling ``run_sync``) logging is left as it is.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "PROJECT_LOGGER",
    "RUN_LOG",
    "adopt_library_loggers",
    "attach_run_log",
    "capture",
    "stdout_to_run_log",
]

PROJECT_LOGGER = "rl_bridge"
RUN_LOG = Path("logs") / "trainer.log"
"""The trainer process's log, relative to the run directory."""

#: Libraries that install handlers of their own (and stop propagation) when they are imported.
_SELF_HANDLED = ("vllm", "torch", "transformers", "megatron")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _State:
    buffer: logging.handlers.MemoryHandler | None = None
    file: logging.FileHandler | None = None


def capture() -> None:
    """Hold every log record and warning in memory until :func:`attach_run_log`, and show this
    project's INFO lines on stderr. Call before heavy imports; idempotent."""
    if _State.buffer is not None or _State.file is not None:
        return
    import os

    # vLLM, imported by the trainer for its weight-transfer API, otherwise installs a console
    # handler of its own at import; the servers it starts set this back (services.vllm_server).
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    root = logging.getLogger()
    buffer = logging.handlers.MemoryHandler(
        capacity=1 << 20, flushLevel=logging.CRITICAL + 1, flushOnClose=False
    )
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(buffer)  # a later logging.basicConfig (megatron.training does one) is a no-op
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("[video-grpo] %(message)s"))
    console.setLevel(logging.INFO)
    project = logging.getLogger(PROJECT_LOGGER)
    project.setLevel(logging.INFO)
    project.addHandler(console)
    _State.buffer = buffer
    import torch  # noqa: F401  (installs torch's handlers, taken over here before it logs)
    import transformers.utils.logging as transformers_logging

    _adopt("torch")
    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()


def _adopt(name: str) -> None:
    """Route a library's loggers that print through handlers of their own (``name`` and every
    logger under it) through the root, the run log."""
    names = [name, *(n for n in logging.Logger.manager.loggerDict if n.startswith(name + "."))]
    for logger in map(logging.getLogger, names):
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True


def attach_run_log(run_dir: Path) -> Path | None:
    """Write what :func:`capture` held, and every later record, to ``run_dir / RUN_LOG``; returns
    that path, or ``None`` when :func:`capture` was not called (logging then stays as it was)."""
    buffer = _State.buffer
    if buffer is None:
        return None
    path = run_dir / RUN_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT))
    for name in _SELF_HANDLED:
        _adopt(name)
    root = logging.getLogger()
    buffer.setTarget(handler)
    buffer.flush()
    root.removeHandler(buffer)
    root.addHandler(handler)
    _State.buffer, _State.file = None, handler
    return path


def adopt_library_loggers() -> None:
    """Take over the library loggers again (a library imported after :func:`attach_run_log`
    installs its handlers then); a no-op without a run log."""
    if _State.file is not None:
        for name in _SELF_HANDLED:
            _adopt(name)


@contextlib.contextmanager
def stdout_to_run_log() -> Iterator[None]:
    """Inside the block, what is printed to stdout or stderr goes to the run log (Megatron prints
    its parameter counts and bucket lists while the policy is built, and Megatron-Bridge gives a
    logger a console handler of its own when imported: created in here, it writes to the log);
    without a run log, nothing changes. This project's console lines and an exception raised in
    the block still reach the console."""
    handler = _State.file
    if handler is None:
        yield
        return
    handler.flush()
    try:
        with contextlib.redirect_stdout(handler.stream), contextlib.redirect_stderr(handler.stream):
            yield
    finally:
        handler.flush()
        adopt_library_loggers()
