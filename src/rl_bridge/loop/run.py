"""What both loops do around their steps: start a run, log each step, end it.

:class:`Run` announces the run, prepares the task (:func:`rl_bridge.tasks.prepare_task`),
starts the roles (:func:`rl_bridge.backends.launch.start_roles`: vLLM, the Gym servers, the
policy) and builds the stages (:class:`~rl_bridge.loop.step.Stages`), timing it all as
``time/setup_s``; :meth:`Run.begin` opens the metrics (TensorBoard and ``metrics.jsonl``), the
progress bar and validation (:class:`~rl_bridge.loop.report.RunReport`), and takes the warm start
and the first validation of a fresh run; :meth:`Run.step_done` adds each step's total time and
memory (on GPUs the policy's CUDA memory, ``gpu/policy_*``, and the device's peak in use by every
process, ``gpu/device_peak_used_gib``); :meth:`Run.end` validates after the last step and draws
the curves; :meth:`Run.summary` writes ``summary.json``.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from rl_bridge.console import attach_run_log, stdout_to_run_log
from rl_bridge.loop.metrics import DeviceMemoryMonitor, RunMetrics, curves_title, write_curves
from rl_bridge.loop.report import RunReport, announce_run
from rl_bridge.loop.step import Stages
from rl_bridge.loop.timing import timed
from rl_bridge.recipe import Recipe

__all__ = ["Run", "requests_served"]


def requests_served(urls: list[str] | tuple[str, ...]) -> list[int]:
    """Requests each vLLM server has finished since it (last) started, by its Prometheus counter
    ``vllm:request_success_total``, in the order of ``urls``."""
    counts = []
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            text = response.read().decode()
        finished = (
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total")
        )
        counts.append(round(sum(finished)))
    return counts


class Run:
    """One run's setup, per-step logging and end (see the module docstring)."""

    def __init__(self, recipe: Recipe, run_dir: Path, stack: ExitStack) -> None:
        """Write ``recipe.json``, announce the run and set it up; what it starts is stopped when
        ``stack`` closes."""
        from rl_bridge.backends.launch import start_roles
        from rl_bridge.tasks import prepare_task

        self.recipe = recipe
        self.run_dir = run_dir
        self._stack = stack
        self._started = time.monotonic()
        (run_dir / "recipe.json").write_text(recipe.model_dump_json(indent=2, by_alias=True))
        announce_run(recipe, run_dir, attach_run_log(run_dir))
        self._setup: dict[str, float] = {}
        with self.setting_up():
            data = prepare_task(recipe)
            self.stages = Stages.build(recipe, data, start_roles(recipe, data, stack))

    @contextmanager
    def setting_up(self) -> Iterator[None]:
        """A part of the setup: its time counts in ``setup_s``, its output goes to the run's log."""
        with timed("setup", self._setup, add=True), stdout_to_run_log():
            yield

    def begin(self, *, desc: str, resumed_at: int | None = None) -> None:
        """Open the metrics and the report; a fresh run (``resumed_at=None``) takes its warm start
        and validates before the first step. ``resumed_at``: the step a resumed run restarts after
        (its later metrics are dropped)."""
        from rl_bridge.loop.warm_start import warm_start

        self.metrics = RunMetrics(self.run_dir, append=resumed_at is not None, drop_after=resumed_at)
        self._stack.callback(self.metrics.close)
        self.report = RunReport(
            self.recipe,
            self.stages.validate,
            self.metrics,
            desc=desc,
            started=self._started,
            initial_step=resumed_at or 0,
        )
        if resumed_at is None:
            if self.recipe.warm_start.steps:  # a resumed run's checkpoint holds the warm-started weights
                self.metrics.log(0, warm_start(self.stages))
            self.report.start()
        self._memory = DeviceMemoryMonitor()
        self._stack.callback(self._memory.close)
        self._memory.take_peak()
        self.stages.roles.policy.memory_stats(reset=True)

    def step_done(self, step: int, metrics: dict[str, float], timings: dict[str, float]) -> bool:
        """Log a step's metrics with its timings, ``time/step_s`` (their sum) and memory; whether
        the run should stop (:meth:`RunReport.step_done`)."""
        timings["time/step_s"] = sum(value for name, value in timings.items() if name.startswith("time/"))
        policy = self.stages.roles.policy.memory_stats(reset=True)
        gpu = {f"gpu/policy_{name}": value for name, value in policy.items()}
        if (peak := self._memory.take_peak()) is not None:
            gpu["gpu/device_peak_used_gib"] = peak
        return self.report.step_done(step, {**metrics, **timings, **gpu})

    def end(self, step: int) -> dict[str, Any]:
        """Validate after the last step (unless just done) and draw ``curves.png``; returns what
        the summary says about the servers: the version served, the placement and the requests
        each server finished."""
        self.report.finish(step)
        write_curves(
            self.metrics.history,
            self.run_dir / "curves.png",
            chance=1.0 / self.recipe.task.num_options,
            title=curves_title(self.recipe, self.run_dir),
        )
        roles = self.stages.roles
        return {
            "served_version": self.stages.refit.served_weight_version(),
            "placement": roles.placement,
            "vllm_requests": requests_served(roles.vllm_base_urls),
        }

    def summary(self, step: int, **extra: Any) -> dict[str, Any]:
        """The run's summary after ``step`` steps, also written to ``summary.json``."""
        return self.report.summary(steps=step, setup_s=self._setup["time/setup_s"], **extra)
