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

__all__ = [
    "STAGES",
    "DeviceMemoryMonitor",
    "RunMetrics",
    "curves_title",
    "read_metrics",
    "resident_mb",
    "step_totals",
    "write_curves",
]

#: The timed stages of a step, in order (``time/<stage>_s`` metrics). A colocated GPU run also
#: times ``sleep``, ``release`` and ``wake`` (:meth:`.stages.refit.Refitter.generation_asleep`).
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


#: Plain-language names of the metrics the curves show.
_LABELS: dict[str, str] = {
    "val/accuracy": "held-out accuracy (greedy)",
    "warm_start/before/val/accuracy": "held-out accuracy before the warm start",
    "warm_start/before/val/tool_call_precision": "held-out calls to the named segment, before the warm start",
    "val/tool_call_precision": "held-out calls to the named segment (greedy)",
    "rollout/tool_call_precision": "sampled calls to the named segment",
    "rollout/reward_mean": "mean reward of the step's samples",
    "rollout/accuracy": "sampled answers that are correct",
    "mismatch/token_mult_prob_error": "per token: mean of exp(|logprob difference|)",
    "mismatch/seq_mult_prob_error_max": "worst sequence: exp(|sum of logprob differences|)",
    "preprocess/masked": "samples masked (all reasons)",
    "rollout/retries": "rollouts retried",
    "rollout/redispatches": "rollouts sent again after a vLLM restart",
    "rollout/server_restarts": "vLLM restarts",
    "rollout/crashed_server": "prompts that crashed vLLM",
    "gpu/device_peak_used_gib": "GPU 0, every process (peak)",
    "gpu/policy_peak_allocated_gib": "policy tensors (peak)",
    "gpu/policy_peak_reserved_gib": "policy allocator (peak)",
}


def curves_title(recipe: Any, run_dir: Path) -> str:
    """The curves' title: the run directory's name, the mode, the model, the task and the batch."""
    model = recipe.model.path or f"tiny {recipe.model.family}"
    r = recipe.rollout
    return (
        f"{run_dir.name}: {recipe.mode} GRPO, {model}, task {recipe.task.name} ({recipe.task.environment}), "
        f"{r.prompts_per_step} prompts x {r.group_size} samples a step"
    )


def _label(name: str) -> str:
    if name.startswith("masked/"):
        return "masked: " + name.removeprefix("masked/").replace("_", " ")
    return _LABELS.get(name, name)


def write_curves(
    history: Sequence[Mapping[str, float]],
    out: Path,
    *,
    chance: float | None = None,
    title: str | None = None,
) -> Path:
    """Draw the run's curves into one PNG, titled ``title`` (the run and its recipe): held-out
    accuracy, the sampled reward, vLLM/trainer probability error, masked and failed rollouts, the
    step time per stage (stacked) and, on GPUs, memory. Steps are whole numbers; a panel without
    data says so instead of drawing an empty axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    panels = iter(axes.flat)

    def lines(ax, names: Sequence[str], *, style: str = ".-") -> bool:  # type: ignore[no-untyped-def]
        drawn = False
        for name in names:
            steps, values = _series(history, name)
            if values:
                ax.plot(steps, values, style, label=_label(name))
                drawn = True
        return drawn

    steps_seen = [r["step"] for r in history if "step" in r]

    def finish(ax, drawn: bool, *, title: str, ylabel: str, empty: str) -> None:  # type: ignore[no-untyped-def]
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if steps_seen:  # whole steps, the same span on every panel
            ax.set_xlim(min(steps_seen) - 0.5, max(steps_seen) + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.set(ylim=(0, 1), yticks=[])
            ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color="gray")

    ax = next(panels)
    drawn = lines(
        ax,
        [
            "val/accuracy",
            "warm_start/before/val/accuracy",
            "warm_start/before/val/tool_call_precision",
            "val/tool_call_precision",
        ],
        style="o-",
    )
    if chance is not None and drawn:
        ax.axhline(chance, color="gray", linestyle=":", label=f"chance ({chance:.2f})")
    ax.set(ylim=(-0.02, 1.02))
    finish(
        ax, drawn, title="Held-out accuracy", ylabel="fraction of held-out rows", empty="no validation yet"
    )

    ax = next(panels)
    drawn = lines(ax, ["rollout/reward_mean", "rollout/accuracy", "rollout/tool_call_precision"])
    finish(ax, drawn, title="Training rollouts", ylabel="reward / fraction", empty="no training step yet")

    ax = next(panels)
    drawn = lines(ax, ["mismatch/token_mult_prob_error", "mismatch/seq_mult_prob_error_max"])
    finish(
        ax,
        drawn,
        title="vLLM vs trainer probability ratio",
        ylabel="probability ratio (1 = identical)",
        empty="not measured",
    )

    ax = next(panels)
    reasons = sorted({name for record in history for name in record if name.startswith("masked/")})
    counted = ["preprocess/masked", *reasons, "rollout/retries", "rollout/redispatches",
               "rollout/server_restarts", "rollout/crashed_server"]  # fmt: skip
    nonzero = [n for n in counted if any(r.get(n, 0.0) for r in history)]
    finish(
        ax,
        lines(ax, nonzero),
        title="Masked samples, retries and restarts",
        ylabel="count per step",
        empty="none: every rollout was trained",
    )

    ax = next(panels)
    all_steps = sorted({r["step"] for r in history if "time/rollout_s" in r or "time/validation_s" in r})
    bottom = [0.0] * len(all_steps)
    for stage in STAGES:
        steps, values = _series(history, f"time/{stage}_s")
        if not steps:
            continue
        by_step = dict(zip(steps, values, strict=True))
        heights = [by_step.get(s, 0.0) for s in all_steps]
        ax.bar(all_steps, heights, bottom=bottom, label=stage)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    finish(ax, bool(all_steps), title="Step time by stage", ylabel="seconds", empty="no step yet")

    ax = next(panels)
    drawn = lines(
        ax, ["gpu/device_peak_used_gib", "gpu/policy_peak_allocated_gib", "gpu/policy_peak_reserved_gib"]
    )
    finish(ax, drawn, title="GPU memory", ylabel="GiB", empty="no GPU in this run")

    if title:
        fig.suptitle(title)
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
