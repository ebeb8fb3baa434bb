"""Run metrics: scalars per step to TensorBoard and ``metrics.jsonl``, and the PNG curves."""

from __future__ import annotations

import json
import math
import os
import resource
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["STAGES", "DeviceMemoryMonitor", "RunMetrics", "read_metrics", "resident_mb", "step_totals", "write_curves"]

#: The timed stages of a step, in order (``time/<stage>_s`` metrics). A colocated GPU run also
#: times ``sleep``, ``release`` and ``wake`` (:meth:`.controller.Controller.sleeping_generation`).
STAGES = ("rollout", "preprocess", "logprobs", "sleep", "train", "release", "wake", "refit", "validation")


class RunMetrics:
    """Scalars per step to TensorBoard and ``metrics.jsonl``; the history feeds the PNG curves."""

    def __init__(self, run_dir: Path, *, append: bool = False, drop_after: int | None = None) -> None:
        """
        Args:
            run_dir: where ``metrics.jsonl`` and the ``tensorboard`` directory go.
            append: continue a resumed run's ``metrics.jsonl`` (its records are read into
                :attr:`history`) instead of starting a new one.
            drop_after: with ``append``, first drop the records of steps after this one (steps
                logged after the checkpoint a run resumes from, which it trains again); ``None``:
                keep every record.
        """
        from torch.utils.tensorboard import SummaryWriter

        path = run_dir / "metrics.jsonl"
        self.history: list[dict[str, float]] = read_metrics(path) if append and path.exists() else []
        if drop_after is not None:
            self.history = [r for r in self.history if r["step"] <= drop_after]
            path.write_text("".join(json.dumps(r) + "\n" for r in self.history), encoding="utf-8")
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.jsonl = path.open("a" if append else "w", encoding="utf-8")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        record = {"step": float(step), **{k: float(v) for k, v in scalars.items()}}
        for name, value in scalars.items():
            self.writer.add_scalar(name, float(value), step)
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        self.history.append(record)

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()


def _series(history: Sequence[Mapping[str, float]], name: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[name]) for r in history if name in r and math.isfinite(r[name])]
    return [p[0] for p in points], [p[1] for p in points]


def write_curves(history: Sequence[Mapping[str, float]], out: Path, *, chance: float | None = None) -> Path:
    """Draw the run's curves into one PNG: reward and validation accuracy, vLLM/trainer mismatch,
    masked and failed rows, and the step time per stage (stacked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    ax.plot(*_series(history, "rollout/reward_mean"), label="train reward (sampled)")
    ax.plot(*_series(history, "val/accuracy"), marker="o", label="held-out accuracy (greedy)")
    for name, label, style in (
        ("warm_start/before/val/accuracy", "held-out accuracy before the warm start", "x"),
        ("warm_start/before/val/tool_call_precision", "held-out calls to the named segment before it", "+"),
        ("val/tool_call_precision", "held-out calls to the named segment (greedy)", "s--"),
        ("rollout/tool_call_precision", "sampled calls to the named segment", ":"),
    ):
        steps, values = _series(history, name)
        if values:
            ax.plot(steps, values, style, label=label)
    if chance is not None:
        ax.axhline(chance, color="gray", linestyle=":", label="chance")
    ax.set(title="Reward", xlabel="step", ylim=(-0.02, 1.02))
    ax.legend(fontsize="small")
    ax = axes[0][1]
    for name in ("mismatch/token_mult_prob_error", "mismatch/seq_mult_prob_error_max"):
        ax.plot(*_series(history, name), marker=".", label=name.removeprefix("mismatch/"))
    ax.set(title="vLLM vs trainer probability error (1 = identical)", xlabel="step")
    ax.legend()
    ax = axes[1][0]
    reasons = sorted({name for record in history for name in record if name.startswith("masked/")})
    for name in (
        "preprocess/masked",
        *reasons,
        "rollout/retries",
        "rollout/redispatches",
        "rollout/server_restarts",
        "rollout/crashed_server",
    ):
        ax.plot(*_series(history, name), marker=".", label=name)
    ax.set(title="Masked samples (by reason), retries and restarts", xlabel="step")
    ax.legend()
    ax = axes[1][1]
    bottom: list[float] | None = None
    for stage in STAGES:
        steps, values = _series(history, f"time/{stage}_s")
        if not steps:
            continue
        by_step = dict(zip(steps, values, strict=True))
        all_steps = sorted({r["step"] for r in history if "time/rollout_s" in r or "time/validation_s" in r})
        heights = [by_step.get(s, 0.0) for s in all_steps]
        base = bottom if bottom is not None and len(bottom) == len(heights) else [0.0] * len(heights)
        ax.bar(all_steps, heights, bottom=base, label=stage)
        bottom = [b + h for b, h in zip(base, heights, strict=True)]
    ax.set(title="Step time by stage", xlabel="step", ylabel="seconds")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The records of a ``metrics.jsonl`` file, in order."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def step_totals(history: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """Summary figures over the training steps of ``history`` (records with ``time/step_s``):
    mean seconds per stage and per step (``mean_stage_time_s``), rollout rows, rows ``ok`` and
    masked samples."""
    steps = [r for r in history if "time/step_s" in r]
    colocated = ("sleep", "release", "wake")  # timed only where vLLM sleeps while the policy trains
    mean_time = {
        stage: sum(r.get(f"time/{stage}_s", 0.0) for r in steps) / max(len(steps), 1)
        for stage in (*STAGES[:-1], "step")
        if stage not in colocated or any(f"time/{stage}_s" in r for r in steps)
    }
    return {
        "mean_stage_time_s": mean_time,
        "rows": sum(int(r.get("rollout/rows", 0)) for r in steps),
        "rows_ok": sum(int(r.get("rollout/ok", 0)) for r in steps),
        "masked": sum(int(r.get("preprocess/masked", 0)) for r in steps),
    }


def resident_mb() -> float:
    """This process's resident memory now, MiB (``/proc/self/statm``; where there is none, the
    peak from ``getrusage``)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class DeviceMemoryMonitor:
    """The most memory GPU 0 of this host had in use, every process together (vLLM's and the
    policy's), sampled through NVML every ``interval_s`` on a daemon thread while the monitor runs:
    the figure that decides whether a colocated run fits, which neither process can see alone.
    Without NVML or a GPU it measures nothing and :meth:`take_peak` returns ``None``."""

    def __init__(self, interval_s: float = 0.05, device: int = 0) -> None:
        self.interval_s = interval_s
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        except Exception:  # no NVML library or no GPU: nothing to measure
            return
        self._thread = threading.Thread(target=self._sample, name="device-memory", daemon=True)
        self._thread.start()

    def _used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            used = self._used()
            with self._lock:
                self._peak = max(self._peak, used)

    def take_peak(self) -> float | None:
        """The peak in GiB since the last call (``None`` when nothing is measured); starts a new
        interval."""
        if self._handle is None:
            return None
        with self._lock:
            peak, self._peak = max(self._peak, self._used()), 0
        return peak / 2**30

    def close(self) -> None:
        self._stop.set()
