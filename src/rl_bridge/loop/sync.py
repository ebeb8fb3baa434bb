"""The synchronous GRPO controller: rollout -> preprocessing -> logprobs -> train -> refit, repeated.

:func:`run_sync` runs a whole :class:`~rl_bridge.loop.config.Recipe` on one host:

1. builds the tiny model and writes the task clips (training and held-out rows);
2. starts vLLM (dev mode, for refits) and the Gym servers on loopback: the ``video_vllm_model``
   model server (which sends ``allowed_token_ids`` with every request when sampling is restricted
   to the option letters), the ``video_mcqa`` resources server and the stock ``simple_agent``;
3. builds the Megatron policy (on CPU inside :func:`~rl_bridge.megatron.cpu_support.cpu_execution`);
4. per step, each stage timed: **rollout** G samples of ``prompts_per_step`` rows through the
   agent's ``/run`` (:func:`rl_bridge.rollout.collect_rollouts`); **preprocess** each answer into
   policy tensors (:class:`rl_bridge.policy_inputs.PolicyInputBuilder`: tokens, vLLM logprobs,
   media with the placeholder check; failures masked) and group advantages; **logprobs** of every
   unmasked sample under the current policy (the proximal policy, and the vLLM/trainer mismatch),
   plus the reference policy's only when the KL weight is non-zero; **train** one optimizer step on
   the samples that carry signal; **refit** vLLM from the exported weights, versioned by step;
5. validates on the held-out rows with greedy decoding before the first step, every
   ``validation.every`` steps and after the last;
6. logs every metric to TensorBoard and ``metrics.jsonl``, draws the PNG curves, saves a checkpoint,
   writes ``summary.json`` and stops everything it started.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from rl_bridge.grpo import group_advantages, needs_reference
from rl_bridge.loop.config import Recipe
from rl_bridge.loop.tasks import option_letters, task_rows
from rl_bridge.rollout import RolloutResult, RolloutSettings, collect_rollouts

__all__ = ["STAGES", "run_sync"]

MODEL_SERVER = "policy_model"
RESOURCES_SERVER = "video_mcqa"
AGENT_SERVER = "video_mcqa_agent"
#: The timed stages of a step, in order (``time/<stage>_s`` metrics).
STAGES = ("rollout", "preprocess", "logprobs", "train", "refit", "validation")


@contextmanager
def _timed(name: str, timings: dict[str, float]) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    finally:
        timings[f"time/{name}_s"] = time.monotonic() - started


def _letter_token_ids(model_dir: Path, letters: str) -> list[int]:
    """The token id of each option letter; each letter must be exactly one token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = []
    for letter in letters:
        encoded = tokenizer.encode(letter, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"option letter {letter!r} is {len(encoded)} tokens {encoded} in {model_dir}, not one")
        ids.append(encoded[0])
    return ids


def _gym_specs(recipe: Recipe, vllm: Any, media_root: Path, letter_ids: Sequence[int]) -> list[Any]:
    from rl_bridge.services.gym_server import GymServerSpec, video_model_server_spec

    extra_body = {"allowed_token_ids": list(letter_ids)} if recipe.rollout.restrict_to_options else None
    model = video_model_server_spec(
        MODEL_SERVER, openai_url=vllm.openai_url, model=vllm.model_name, media_root=media_root, extra_body=extra_body
    )
    resources = GymServerSpec(
        RESOURCES_SERVER,
        "resources_servers",
        "video_mcqa",
        {"domain": "knowledge", "answer_format": recipe.task.answer_format},
    )
    agent = GymServerSpec(
        AGENT_SERVER,
        "responses_api_agents",
        "simple_agent",
        {"resources_server": resources.ref(), "model_server": model.ref(), "max_steps": 1},
    )
    return [model, resources, agent]


def _with_sampling(row: Mapping[str, Any], temperature: float, max_output_tokens: int) -> dict[str, Any]:
    params = {**row["responses_create_params"], "temperature": temperature, "max_output_tokens": max_output_tokens}
    return {**row, "responses_create_params": params}


class _Metrics:
    """Scalars per step to TensorBoard and ``metrics.jsonl``; the history feeds the PNG curves."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.jsonl = (run_dir / "metrics.jsonl").open("w", encoding="utf-8")
        self.history: list[dict[str, float]] = []

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
    if chance is not None:
        ax.axhline(chance, color="gray", linestyle=":", label="chance")
    ax.set(title="Reward", xlabel="step", ylim=(-0.02, 1.02))
    ax.legend()
    ax = axes[0][1]
    for name in ("mismatch/token_mult_prob_error", "mismatch/seq_mult_prob_error_max"):
        ax.plot(*_series(history, name), marker=".", label=name.removeprefix("mismatch/"))
    ax.set(title="vLLM vs trainer probability error (1 = identical)", xlabel="step")
    ax.legend()
    ax = axes[1][0]
    for name in ("preprocess/masked", "rollout/content_failed", "rollout/infra_failed", "rollout/retries"):
        ax.plot(*_series(history, name), marker=".", label=name)
    ax.set(title="Masked samples and failed rows", xlabel="step")
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


class _Controller:
    """One run's state: servers, policy, rows, and the stage functions of a step."""

    def __init__(self, recipe: Recipe, stack: ExitStack) -> None:
        from gym_video_env import MediaSettings
        from rl_bridge.megatron.cpu_support import cpu_execution, single_process_group
        from rl_bridge.megatron.policy import GRPOPolicyLoss, MegatronPolicy, PolicyConfig
        from rl_bridge.paths import project_root
        from rl_bridge.policy_inputs import PolicyInputBuilder
        from rl_bridge.processors import load_processor
        from rl_bridge.services.gym_server import start_gym_servers
        from rl_bridge.services.vllm_server import VLLMServerConfig, start_vllm_server
        from rl_bridge.tiny_models import build_tiny_model
        from vllm_video_plugin.refit import RefitClient

        self.recipe = recipe
        self.run_dir = recipe.run_dir.resolve()
        self.media_root = self.run_dir / "media"
        self.weights_dir = self.run_dir / "weights"
        self.model_dir = build_tiny_model(recipe.model.family, seed=recipe.model.seed, **recipe.model.spec)
        task = recipe.task
        self.train_rows = task_rows(task, self.media_root, task.train_rows, seed=task.seed, subdir="train")
        self.val_rows = task_rows(task, self.media_root, task.val_rows, seed=task.seed + 1, subdir="val")
        letter_ids = _letter_token_ids(self.model_dir, option_letters(task))

        self.vllm = stack.enter_context(
            start_vllm_server(
                VLLMServerConfig(
                    model=self.model_dir,
                    dtype="float32",
                    dev_mode=True,
                    seed=recipe.seed,
                    allowed_local_media_path=self.media_root,
                    startup_timeout_s=900,
                ),
                log_dir=self.run_dir / "logs" / "vllm",
            )
        )
        gym = stack.enter_context(
            start_gym_servers(
                _gym_specs(recipe, self.vllm, self.media_root, letter_ids),
                run_dir=self.run_dir / "logs" / "gym",
                extra_roots=[project_root() / "src"],
                timeout_s=600,
            )
        )
        self.agent_url = gym.url(AGENT_SERVER)
        self.refit_client = RefitClient(self.vllm.base_url)
        self.rollout_settings = RolloutSettings(
            max_in_flight=recipe.rollout.max_in_flight,
            max_attempts=recipe.rollout.max_attempts,
            timeout_s=recipe.rollout.timeout_s,
        )
        self.inputs = PolicyInputBuilder(load_processor(self.model_dir), MediaSettings(media_root=self.media_root))

        stack.enter_context(cpu_execution())
        stack.enter_context(single_process_group(seed=recipe.seed))
        policy_config = PolicyConfig(
            learning_rate=recipe.train.learning_rate,
            weight_decay=recipe.train.weight_decay,
            micro_batch_size=recipe.train.micro_batch_size,
            temperature=1.0,
        )
        self.policy = MegatronPolicy(self.model_dir, policy_config)
        self.reference = (
            MegatronPolicy(self.model_dir, dataclasses.replace(policy_config, learning_rate=0.0))
            if needs_reference(recipe.train.loss)
            else None
        )
        self.loss = GRPOPolicyLoss(recipe.train.loss)
        self._order: list[int] = []
        self._rng = random.Random(recipe.seed)

    # -- data ----------------------------------------------------------------------------------------

    def next_prompts(self) -> list[dict[str, Any]]:
        """The next ``prompts_per_step`` training rows; each pass over the rows is reshuffled."""
        chosen = []
        for _ in range(self.recipe.rollout.prompts_per_step):
            if not self._order:
                self._order = list(range(len(self.train_rows)))
                self._rng.shuffle(self._order)
            chosen.append(self.train_rows[self._order.pop()])
        return chosen

    # -- stages ------------------------------------------------------------------------------------

    def rollout(self, prompts: Sequence[Mapping[str, Any]]) -> tuple[list[RolloutResult], dict[str, float]]:
        """G samples of every prompt (groups contiguous), and the rollout counts."""
        r = self.recipe.rollout
        rows = [_with_sampling(p, r.temperature, r.max_output_tokens) for p in prompts for _ in range(r.group_size)]
        results, stats = collect_rollouts(self.agent_url, rows, self.rollout_settings)
        rewards = [res.reward for res in results if res.reward is not None]
        metrics = stats.as_dict()
        metrics["rollout/reward_mean"] = sum(rewards) / len(rewards) if rewards else float("nan")
        return results, metrics

    def preprocess(self, results: Sequence[RolloutResult]) -> tuple[list[Any], dict[str, float]]:
        """Policy samples with their advantages (masked rollouts left out) and the step's counts."""
        from rl_bridge.media_batch import MediaMetrics

        self.inputs.metrics = MediaMetrics()
        built = [self.inputs.build(res.result) if res.result is not None else None for res in results]
        valid = torch.tensor([b is not None and not b.masked for b in built])
        rewards = torch.tensor([res.reward if res.reward is not None else float("nan") for res in results])
        grouped = group_advantages(
            rewards,
            group_size=self.recipe.rollout.group_size,
            sample_mask=valid,
            normalize_std=self.recipe.train.loss.normalize_std,
            leave_one_out=self.recipe.train.loss.leave_one_out,
            std_eps=self.recipe.train.loss.std_eps,
        )
        samples = [
            sample
            for inputs, advantage in zip(built, grouped.advantages.tolist(), strict=True)
            if inputs is not None and not inputs.masked
            for sample in inputs.to_policy_samples(advantage)
        ]
        metrics = {
            "preprocess/samples": float(len(samples)),
            "preprocess/masked": float(len(results) - int(valid.sum())),
            **{f"preprocess/{k}": float(v) for k, v in grouped.metrics().items()},
            **{f"preprocess/{k}": float(v) for k, v in self.inputs.metrics.as_dict().items()},
        }
        return samples, metrics

    def logprobs(self, samples: list[Any]) -> list[Any]:
        """The samples with ``old_logprobs`` (and ``ref_logprobs`` when the KL weight is non-zero)."""
        old = self.policy.logprobs(samples)
        ref = self.reference.logprobs(samples) if self.reference is not None else [None] * len(samples)
        return [
            dataclasses.replace(s, old_logprobs=o, ref_logprobs=r) for s, o, r in zip(samples, old, ref, strict=True)
        ]

    def train(self, samples: list[Any]) -> dict[str, float]:
        """One optimizer step on the samples with a non-zero advantage (none: no step)."""
        signal = [s for s in samples if s.advantage != 0.0]
        metrics = self._mismatch(samples)
        if not signal:
            return {**metrics, "train/skipped_no_signal": 1.0}
        return {**metrics, **self.policy.train_step(signal, self.loss).as_dict(), "train/skipped_no_signal": 0.0}

    @staticmethod
    def _mismatch(samples: Sequence[Any]) -> dict[str, float]:
        """vLLM vs trainer (before the update) on every unmasked sample: token and worst sequence
        multiplicative probability error, ``exp(|logp_trainer - logp_vllm|)``."""
        if not samples:
            return {}
        token_errors: list[float] = []
        seq_errors: list[float] = []
        for s in samples:
            diff = (s.old_logprobs - s.behaviour_logprobs)[s.target_mask].double()
            token_errors += diff.abs().exp().tolist()
            seq_errors.append(math.exp(abs(float(diff.sum()))))
        return {
            "mismatch/token_mult_prob_error": sum(token_errors) / len(token_errors),
            "mismatch/seq_mult_prob_error_max": max(seq_errors),
        }

    def refit(self, step: int) -> dict[str, float]:
        """Export the weights and load them into vLLM as version ``step-<step>``."""
        target = self.weights_dir / f"step-{step}"
        self.policy.save_hf_checkpoint(target)
        result = self.refit_client.refit(target, version=f"step-{step}")
        for old in self.weights_dir.iterdir():
            if old != target:
                shutil.rmtree(old)
        return {"refit/paused_s": result.paused_s, "refit/weight_version": float(step)}

    def validate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out rows (rows that failed count as wrong)."""
        r = self.recipe.rollout
        rows = [_with_sampling(row, 0.0, r.max_output_tokens) for row in self.val_rows]
        results, stats = collect_rollouts(self.agent_url, rows, self.rollout_settings)
        correct = sum(res.reward or 0.0 for res in results)
        return {"val/accuracy": correct / len(rows), "val/failed": float(len(rows) - stats.outcomes["ok"])}


def run_sync(recipe: Recipe) -> dict[str, Any]:
    """Run ``recipe`` (see the module docstring); returns the summary also written to ``summary.json``.

    Raises:
        rl_bridge.services.process.ServiceError: a server did not start.
        vllm_video_plugin.refit.RefitError: a refit failed.
    """
    run_dir = recipe.run_dir.resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "recipe.json").write_text(recipe.model_dump_json(indent=2))
    chance = 1.0 / recipe.task.num_options
    started = time.monotonic()
    with ExitStack() as stack:
        setup: dict[str, float] = {}
        with _timed("setup", setup):
            controller = _Controller(recipe, stack)
        metrics = _Metrics(run_dir)
        stack.callback(metrics.close)
        val_every = recipe.validation.every
        history_val: list[tuple[int, float]] = []

        def validate(step: int) -> float:
            timings: dict[str, float] = {}
            with _timed("validation", timings):
                scalars = controller.validate()
            metrics.log(step, {**scalars, **timings})
            history_val.append((step, scalars["val/accuracy"]))
            return scalars["val/accuracy"]

        accuracy = validate(0) if val_every else float("nan")
        bar = tqdm(range(1, recipe.train.steps + 1), desc="grpo", unit="step")
        step = 0
        for step in bar:
            timings: dict[str, float] = {}
            with _timed("rollout", timings):
                results, rollout_metrics = controller.rollout(controller.next_prompts())
            with _timed("preprocess", timings):
                samples, preprocess_metrics = controller.preprocess(results)
            with _timed("logprobs", timings):
                samples = controller.logprobs(samples) if samples else []
            with _timed("train", timings):
                train_metrics = controller.train(samples)
            with _timed("refit", timings):
                refit_metrics = controller.refit(step)
            timings["time/step_s"] = sum(timings.values())
            metrics.log(step, {**rollout_metrics, **preprocess_metrics, **train_metrics, **refit_metrics, **timings})
            if val_every and (step % val_every == 0 or step == recipe.train.steps):
                accuracy = validate(step)
            bar.set_postfix(reward=f"{rollout_metrics['rollout/reward_mean']:.2f}", val=f"{accuracy:.2f}")
            if recipe.validation.stop_at_target and accuracy >= recipe.validation.target_accuracy:
                break
        bar.close()
        if recipe.train.checkpoint_at_end:
            controller.policy.save_checkpoint(run_dir / "checkpoint")
        served_version = controller.refit_client.weight_version()
        write_curves(metrics.history, run_dir / "curves.png", chance=chance)

    reached = next((s for s, acc in history_val if acc >= recipe.validation.target_accuracy), None)
    step_records = [r for r in metrics.history if "time/step_s" in r]
    mean_time = {
        stage: sum(r.get(f"time/{stage}_s", 0.0) for r in step_records) / max(len(step_records), 1)
        for stage in (*STAGES[:-1], "step")
    }
    summary = {
        "steps": step,
        "served_weight_version": served_version,
        "chance_accuracy": chance,
        "validation_accuracy": [{"step": s, "accuracy": a} for s, a in history_val],
        "first_step_at_target": reached,
        "target_accuracy": recipe.validation.target_accuracy,
        "mean_stage_time_s": mean_time,
        "setup_s": setup["time/setup_s"],
        "wall_s": time.monotonic() - started,
        "rows": sum(int(r.get("rollout/rows", 0)) for r in step_records),
        "rows_ok": sum(int(r.get("rollout/ok", 0)) for r in step_records),
        "masked": sum(int(r.get("preprocess/masked", 0)) for r in step_records),
        "curves": str(run_dir / "curves.png"),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
