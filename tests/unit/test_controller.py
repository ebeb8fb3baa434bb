"""The stages of a GRPO step with their services stubbed: PPO mini-batches and epochs,
the skipped ``pi_old`` pass, mismatch masking before the step, DAPO's dynamic sampling, and which
refit each step and restart does."""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
from typing import Any

import pytest
import torch

from rl_bridge.backends.handles import Roles
from rl_bridge.grpo import GRPOLossConfig
from rl_bridge.loop.collect import QueuedRollout, SyncCollector
from rl_bridge.loop.stages.preprocess import StepBatch
from rl_bridge.loop.stages.refit import Refitter
from rl_bridge.loop.stages.rollout import verifier_metrics
from rl_bridge.loop.stages.train import TrainStage
from rl_bridge.loop.step import Stages, learn
from rl_bridge.loop.timing import WakeClock
from rl_bridge.megatron.batch import PolicySample
from rl_bridge.megatron.policy_loss import GRPOPolicyLoss, TrainStepMetrics
from rl_bridge.recipe import load_recipe
from rl_bridge.rollout import RolloutResult, RolloutStats

pytestmark = pytest.mark.unit


_TRAINER_LOGPROBS = torch.tensor([0.0, 0.0, -0.99, -1.99])
"""What the stub policy computes for every sample: vLLM's logprobs of an unshifted sample + 0.01."""


class _Policy:
    """Records the batches it is asked to train on; its logprobs are :data:`_TRAINER_LOGPROBS`."""

    def __init__(self) -> None:
        self.batches: list[list[PolicySample]] = []
        self.logprob_calls = 0
        self.asked_for_logprobs: list[bool] = []

    def logprobs(self, batch: list[PolicySample]) -> list[torch.Tensor]:
        self.logprob_calls += 1
        return [_TRAINER_LOGPROBS.clone() for _ in batch]

    def train_step(self, batch: list[PolicySample], loss_fn: Any, *, return_logprobs: bool = False) -> Any:
        self.batches.append(list(batch))
        self.asked_for_logprobs.append(return_logprobs)
        return TrainStepMetrics(
            step=len(self.batches),
            loss=0.5,
            grad_norm=1.0,
            learning_rate=1e-3,
            num_samples=len(batch),
            num_target_tokens=sum(s.num_target_tokens for s in batch),
            num_tokens=sum(len(s.input_ids) for s in batch),
            update_skipped=False,
            loss_metrics={"clip/frac": 0.1 * (len(self.batches) - 1)},
            logprobs=[_TRAINER_LOGPROBS.clone() for _ in batch] if return_logprobs else None,
        )


def _with_policy(stages: Stages, policy: Any, urls: tuple[str, ...] = ("http://unused",)) -> Stages:
    """``stages`` over ``policy`` (and servers at ``urls``), the refit's clients and state kept."""
    stages.roles = Roles(vllm_base_urls=urls, agent_url="http://unused", policy=policy, reference=None)
    stages.train = TrainStage(stages.recipe, policy, GRPOPolicyLoss(stages.recipe.train.loss))
    stages.train._minibatch_rng = random.Random(0)
    stages.refit.roles = stages.roles
    return stages


def _controller(*overrides: str) -> tuple[Stages, _Policy]:
    recipe = load_recipe(None, list(overrides))
    policy = _Policy()
    roles = Roles(vllm_base_urls=("http://unused",), agent_url="http://unused", policy=policy, reference=None)
    stages = Stages(
        recipe=recipe,
        data=type("Data", (), {"train_rows": [{}]})(),
        roles=roles,
        rollout=None,  # type: ignore[arg-type]
        preprocess=None,  # type: ignore[arg-type]
        train=None,  # type: ignore[arg-type]
        refit=Refitter(recipe, roles),
    )
    return _with_policy(stages, policy), policy


def _sample(index: int, *, mismatch: float = 0.0) -> PolicySample:
    mask = torch.tensor([False, False, True, True])
    behaviour = torch.tensor([0.0, 0.0, -1.0, -2.0])
    behaviour[2] -= mismatch
    return PolicySample(
        input_ids=torch.tensor([1, 2, 3, index]),
        target_mask=mask,
        advantage=float(index % 3 - 1),  # -1, 0, 1: zero-advantage samples included
        behaviour_logprobs=behaviour,
    )


def test_one_optimizer_step_trains_every_sample_once_and_takes_pi_old_from_its_forward() -> None:
    controller, policy = _controller()
    samples = controller.logprobs([_sample(i) for i in range(6)])
    assert policy.logprob_calls == 0 and all(s.old_logprobs is None for s in samples)
    metrics = controller.train(samples)
    assert [len(b) for b in policy.batches] == [6] and policy.asked_for_logprobs == [True]
    assert metrics["train/optimizer_steps"] == 1.0
    # the zero-advantage samples (index 1 and 4) are trained too
    assert sorted(int(s.input_ids[-1]) for s in policy.batches[0]) == list(range(6))
    assert metrics["mismatch/token_mult_prob_error"] == pytest.approx(torch.tensor(0.01).exp().item())


def test_minibatches_and_epochs_split_a_fresh_order_each_epoch_after_one_pi_old_pass() -> None:
    controller, policy = _controller("train.minibatches=3", "train.epochs=2")
    samples = controller.logprobs([_sample(i) for i in range(7)])
    assert policy.logprob_calls == 1 and all(s.old_logprobs is not None for s in samples)
    metrics = controller.train(samples)
    assert [len(b) for b in policy.batches] == [3, 2, 2, 3, 2, 2]
    assert policy.asked_for_logprobs == [False] * 6  # pi_old was recomputed before the first update
    for epoch in (policy.batches[:3], policy.batches[3:]):
        assert sorted(int(s.input_ids[-1]) for b in epoch for s in b) == list(range(7))
    orders = [
        [int(s.input_ids[-1]) for b in epoch for s in b] for epoch in (policy.batches[:3], policy.batches[3:])
    ]
    assert orders[0] != orders[1]
    assert metrics["train/optimizer_steps"] == 6.0 and metrics["train/step"] == 6.0
    assert metrics["train/clip/frac"] == pytest.approx(sum(0.1 * k for k in range(6)) / 6)


def test_behaviour_proximal_policy_needs_no_pi_old_pass_even_with_minibatches() -> None:
    controller, policy = _controller("train.minibatches=2", "train.loss.proximal_policy=behaviour")
    samples = controller.logprobs([_sample(i) for i in range(4)])
    assert policy.logprob_calls == 0
    controller.train(samples)
    assert policy.asked_for_logprobs == [True, True]  # each sample's first forward, for the mismatch metric


def test_mismatch_masking_happens_before_the_step_and_is_counted() -> None:
    controller, policy = _controller("train.loss.seq_mismatch_threshold=2.0")
    samples = controller.logprobs([_sample(0), _sample(1, mismatch=5.0), _sample(2)])
    metrics = controller.train(samples)
    assert metrics["mismatch/masked_seqs"] == 1.0
    assert [int(s.input_ids[-1]) for s in policy.batches[0]] == [0, 2]


def _results(rewards: list[list[float]]) -> list[RolloutResult]:
    flat = [r for group in rewards for r in group]
    return [RolloutResult(i, "ok", 1, result={"reward": r}) for i, r in enumerate(flat)]


def test_dynamic_sampling_drops_groups_without_signal_and_refills_the_step() -> None:
    controller, _ = _controller(
        "train.dynamic_sampling=true", "rollout.prompts_per_step=3", "rollout.group_size=2"
    )
    # Three rounds of three groups: (signal?) round 1: yes, no, no; round 2: no, yes, no;
    # round 3: yes, yes, yes.
    rounds = iter(
        [
            [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]],
            [[0.0, 0.0], [0.0, 1.0], [1.0, 1.0]],
            [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]],
        ]
    )
    current: list[list[float]] = []

    def rollout(prompts: Any) -> tuple[list[RolloutResult], RolloutStats]:
        current[:] = next(rounds)
        return _results(current), RolloutStats(rows=6)

    def preprocess(results: Any) -> tuple[StepBatch, dict[str, float]]:
        groups = [[_sample(10 * len(current) + g)] for g in range(len(current))]
        return StepBatch(groups=groups, zero_signal=[len(set(g)) == 1 for g in current]), {
            "preprocess/samples": 3.0
        }

    controller.rollout = type("Rollout", (), {"groups": staticmethod(rollout)})()
    controller.preprocess = preprocess  # type: ignore[assignment]
    collect = SyncCollector(controller)
    collect.next_prompts = lambda: []  # type: ignore[method-assign]
    timings: dict[str, float] = {}
    batch, metrics = collect(timings)
    assert len(batch.groups) == 3 and not any(batch.zero_signal)
    assert metrics["dynamic/rounds"] == 3.0
    assert metrics["dynamic/groups_dropped"] == 4.0 and metrics["dynamic/groups_kept"] == 3.0
    assert metrics["rollout/rows"] == 18.0  # every round's rows are accounted for
    assert metrics["rollout/reward_mean"] == pytest.approx(9 / 18)
    assert timings["time/rollout_s"] >= 0 and timings["time/preprocess_s"] >= 0


def test_without_dynamic_sampling_one_round_keeps_every_group() -> None:
    controller, _ = _controller("rollout.prompts_per_step=2", "rollout.group_size=2")
    rollout = staticmethod(lambda prompts: (_results([[1.0, 1.0], [0.0, 1.0]]), RolloutStats(rows=4)))
    controller.rollout = type("Rollout", (), {"groups": rollout})()
    controller.preprocess = lambda results: (  # type: ignore[assignment]
        StepBatch(groups=[[_sample(0)], [_sample(1)]], zero_signal=[True, False]),
        {},
    )
    collect = SyncCollector(controller)
    collect.next_prompts = lambda: []  # type: ignore[method-assign]
    batch, metrics = collect({})
    assert batch.zero_signal == [True, False] and "dynamic/rounds" not in metrics


def test_recipe_fields_of_the_objective_are_checked() -> None:
    with pytest.raises(ValueError, match="dynamic_sampling"):
        load_recipe(None, ["mode=async", "train.dynamic_sampling=true"])
    assert not load_recipe(None, []).needs_old_logprobs
    assert load_recipe(None, ["train.epochs=2"]).needs_old_logprobs
    assert not load_recipe(
        None, ["train.epochs=2", "train.loss.proximal_policy=behaviour"]
    ).needs_old_logprobs
    assert load_recipe(None, ["train.loss.seq_mismatch_threshold=1.5"]).needs_old_logprobs
    assert GRPOLossConfig().proximal_policy == "trainer"
    recipe = load_recipe(None, ["rollout.temperature=0.7"])
    config = recipe.policy_config([5, 7])
    assert config.temperature == 0.7 and config.token_support == (5, 7)


def test_verifier_metrics_count_correct_answers_and_calls_to_the_named_segment() -> None:
    def scored(index: int, **fields: Any) -> RolloutResult:
        return RolloutResult(index, "ok", 1, result={"reward": 0.0, **fields})

    results = [
        scored(0, correct=True, tool_calls=1, named_segment_calls=1),
        scored(1, correct=False, tool_calls=2, named_segment_calls=0),
        scored(2, correct=True, tool_calls=0, named_segment_calls=0),
        RolloutResult(3, "content_failed", 1, error="bad row"),  # counts as wrong, no calls
    ]
    assert verifier_metrics(results, "val") == {
        "val/accuracy": 0.5,
        "val/tool_calls_per_sample": 0.75,
        "val/tool_call_precision": pytest.approx(1 / 3),
    }
    no_calls = verifier_metrics([scored(0, correct=False, tool_calls=0, named_segment_calls=0)], "rollout")
    assert no_calls["rollout/tool_calls_per_sample"] == 0.0 and math.isnan(
        no_calls["rollout/tool_call_precision"]
    )
    assert verifier_metrics([scored(0)], "val") == {}  # a verifier whose reward is the grade


def test_first_call_entropy_tells_a_spread_choice_from_a_collapsed_one() -> None:
    def called(*watched: int) -> RolloutResult:
        fields = {"correct": False, "tool_calls": len(watched), "named_segment_calls": 0}
        return RolloutResult(
            0,
            "ok",
            1,
            result={"reward": 0.0, "segments": ["a", "b", "c"], "watched_segments": list(watched), **fields},
        )

    spread = verifier_metrics([called(1), called(2, 1), called(3)], "rollout")
    assert spread["rollout/first_call_entropy"] == pytest.approx(1.0)  # first calls 1, 2, 3
    collapsed = verifier_metrics([called(2), called(2, 3), called(2)], "rollout")
    assert collapsed["rollout/first_call_entropy"] == pytest.approx(0.0)
    half = verifier_metrics(
        [called(1), called(2), called()], "rollout"
    )  # the sample without a call is left out
    assert half["rollout/first_call_entropy"] == pytest.approx(math.log(2) / math.log(3))
    pushed = called(1)  # a segment the environment pushed (/next_segment), no call: not a choice
    pushed.result["tool_calls"] = 0
    assert "rollout/first_call_entropy" not in verifier_metrics([pushed, pushed], "rollout")


class _RefitClient:
    """Records the control calls a refit makes; ``refit_with`` runs the transfer it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def refit_with(self, load: Any, *, version: str, pause_mode: str = "wait", resume: bool = True) -> Any:
        self.calls.append(("refit_with", version if resume else f"{version}, left paused"))
        load()
        return type("Result", (), {"paused_s": 0.1})()

    def refit(self, path: Any, *, version: str, pause_mode: str = "wait", resume: bool = True) -> Any:
        self.calls.append(("refit", version if resume else f"{version}, left paused"))
        return type("Result", (), {"paused_s": 0.2})()

    def update_weight_version(self, version: str) -> None:
        self.calls.append(("stamp", version))

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", str(level)))

    def wake_up(self, tags: tuple[str, ...] = ()) -> None:
        self.calls.append(("wake", " ".join(tags)))


class _SendingPolicy(_Policy):
    def __init__(self) -> None:
        super().__init__()
        self.sync: list[str] = []

    def connect_vllm(self, base_url: str, **options: Any) -> None:
        self.sync.append(f"connect {options['backend']} {options['bucket_bytes']}")

    def send_weights_to_vllm(self, base_url: str | None = None) -> dict[str, float]:
        self.sync.append("send" if base_url == "http://unused" else f"send {base_url}")
        return {"refit/bytes": 64.0}


@dataclasses.dataclass(frozen=True)
class _Server:
    base_url: str = "http://unused"


def _refitting(
    *overrides: str, urls: tuple[str, ...] = ("http://unused",)
) -> tuple[Stages, _SendingPolicy, _RefitClient]:
    controller, _ = _controller("refit.bucket_mb=1", *overrides)
    policy = _SendingPolicy()
    _with_policy(controller, policy, urls)
    client = _RefitClient()
    controller.refit.clients = [client] * len(urls)  # type: ignore[list-item]
    controller.refit._transfer_backend = "video_grpo_gloo"
    return controller, policy, client


def test_in_memory_refits_connect_once_and_send_every_step_and_a_step_that_trained_nothing_only_stamps() -> (
    None
):
    controller, policy, client = _refitting()
    assert controller.refit(1)["refit/bytes"] == 64.0
    controller.refit(2)
    skipped = controller.refit(3, trained=False)
    assert skipped["refit/skipped"] == 1.0 and "refit/bytes" not in skipped
    assert policy.sync == [f"connect video_grpo_gloo {1024**2}", "send", "send"]
    assert client.calls == [("refit_with", "step-1"), ("refit_with", "step-2"), ("stamp", "step-3")]


def test_after_a_restart_the_policy_reconnects_and_sends_the_served_version_again() -> None:
    controller, policy, client = _refitting()
    controller.refit.reload_served_weights(
        _Server()
    )  # nothing refitted yet: the server serves the checkpoint
    assert client.calls == [] and policy.sync == []
    controller.refit(1)
    controller.refit.reload_served_weights(_Server())
    assert policy.sync == [
        f"connect video_grpo_gloo {1024**2}",
        "send",
        f"connect video_grpo_gloo {1024**2}",
        "send",
    ]
    assert client.calls == [("refit_with", "step-1"), ("refit_with", "step-1")]


def test_a_restart_waits_for_the_step_holding_the_weights() -> None:
    controller, policy, client = _refitting()
    controller.refit(1)
    reloaded = threading.Event()
    with controller.refit.lock:
        worker = threading.Thread(
            target=lambda: (controller.refit.reload_served_weights(_Server()), reloaded.set())
        )
        worker.start()
        assert not reloaded.wait(0.3)  # blocked while the trainer holds the weights
    worker.join(timeout=10)
    assert reloaded.is_set() and policy.sync[-1] == "send"


def test_from_disk_a_refit_exports_and_reloads_and_a_restart_reloads_the_same_directory(
    tmp_path: Any,
) -> None:
    controller, policy, client = _refitting("refit.transport=disk")
    controller.refit.weights_dir = tmp_path / "weights"
    exported: list[Any] = []
    policy.save_hf_checkpoint = lambda target: (target.mkdir(parents=True), exported.append(target))  # type: ignore[attr-defined]
    controller.refit(1)
    controller.refit(2)
    controller.refit.reload_served_weights(_Server())
    assert [p.name for p in exported] == ["step-1", "step-2"]
    assert [p.name for p in controller.refit.weights_dir.iterdir()] == ["step-2"]  # the older one removed
    assert client.calls == [("refit", "step-1"), ("refit", "step-2"), ("refit", "step-2")]
    assert policy.sync == []


def test_with_two_servers_a_refit_sends_to_each_and_a_restart_resends_to_the_restarted_one_only() -> None:
    controller, policy, client = _refitting(urls=("http://a", "http://b"))
    figures = controller.refit(1)
    assert figures["refit/bytes"] == 128.0  # summed over the servers
    controller.refit.reload_served_weights(_Server("http://b"))
    connect = f"connect video_grpo_gloo {1024**2}"
    assert policy.sync == [connect, "send http://a", connect, "send http://b", connect, "send http://b"]
    assert client.calls == [("refit_with", "step-1")] * 3


class _OrderedPolicy(_SendingPolicy):
    """A sending policy that logs its logprob and train calls into a shared event list."""

    def __init__(self, events: list[tuple[str, str]]) -> None:
        super().__init__()
        self.events = events

    def logprobs(self, batch: list[PolicySample]) -> list[torch.Tensor]:
        self.events.append(("logprobs", ""))
        return super().logprobs(batch)

    def train_step(self, batch: list[PolicySample], loss_fn: Any, *, return_logprobs: bool = False) -> Any:
        self.events.append(("train", ""))
        return super().train_step(batch, loss_fn, return_logprobs=return_logprobs)

    def release_memory(self) -> float:
        self.events.append(("release", ""))
        return 1.5


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_colocated_vllm_sleeps_from_the_rollouts_to_the_refit_and_split_never_sleeps(placement: str) -> None:
    controller, _, client = _refitting(f"model.placement={placement}", "train.minibatches=2")
    policy = _OrderedPolicy(client.calls)
    _with_policy(controller, policy)
    timings: dict[str, float] = {}
    with controller.refit.generation_asleep(timings):
        controller.train(controller.logprobs([_sample(i) for i in range(4)]))
    controller.refit(1)
    steps = [name for name, _ in client.calls]
    if placement == "split":
        assert steps == ["logprobs", "train", "train", "refit_with"] and not timings
    else:
        assert client.calls[0] == ("sleep", "1")
        # The policy hands its cached activation memory back before vLLM wakes into it.
        assert steps == ["sleep", "logprobs", "train", "train", "release", "wake", "refit_with"]
        assert set(timings) == {"time/sleep_s", "time/release_s", "time/wake_s", "gpu/policy_released_gib"}
        assert timings["gpu/policy_released_gib"] == 1.5


@pytest.mark.parametrize("transport", ["memory", "disk"])
def test_with_the_next_step_queued_only_the_weights_wake_for_the_refit_and_the_kv_cache_after_it(
    transport: str, tmp_path: Any
) -> None:
    """``rollout.queue_next_step``: the next rollouts go out once vLLM sleeps; the weights wake
    alone, the refit leaves the server paused, and the KV cache wakes last (resuming vLLM), so
    the queued requests cannot start on the old weights."""
    controller, _, client = _refitting("model.placement=colocated", f"refit.transport={transport}")
    policy = _OrderedPolicy(client.calls)
    _with_policy(controller, policy)
    controller.refit.weights_dir = tmp_path / "weights"
    policy.save_hf_checkpoint = lambda target: target.mkdir(parents=True)  # type: ignore[attr-defined]
    timings: dict[str, float] = {}
    woken = WakeClock()

    def queue() -> WakeClock:
        client.calls.append(("queue", ""))
        return woken

    client_wake_up, set_at_wake, wake_at = client.wake_up, [], []

    def wake_up(tags: Any = ()) -> None:
        set_at_wake.append(woken.is_set())
        wake_at.append(time.monotonic())
        client_wake_up(tags)

    client.wake_up = wake_up  # type: ignore[method-assign]
    metrics = learn(controller, 1, [_sample(i) for i in range(4)], timings, queue_next=queue)
    assert set_at_wake == [False, False] and woken.is_set()  # the queued timeout starts after both wakes
    assert woken.since is not None and wake_at[0] < woken.since <= wake_at[1]  # generation: from the KV wake
    refit = "refit_with" if transport == "memory" else "refit"
    assert client.calls == [
        ("sleep", "1"),
        ("queue", ""),
        ("train", ""),
        ("release", ""),
        ("wake", "weights"),
        (refit, "step-1, left paused"),
        ("wake", "kv_cache"),
    ]
    assert "time/wake_kv_cache_s" in timings and metrics["refit/weight_version"] == 1.0
    client.calls.clear()
    learn(controller, 2, [_sample(i) for i in range(4)], timings)  # nothing queued: as before
    assert [call for call in client.calls if call[0] in ("wake", refit)] == [("wake", ""), (refit, "step-2")]


def test_queue_next_step_needs_the_colocated_placement() -> None:
    with pytest.raises(ValueError, match="queue_next_step .* needs model.placement='colocated'"):
        load_recipe("recipes/tiny_cpu_sync.yaml", ["rollout.queue_next_step=true"])


def test_rollouts_queued_ahead_are_the_next_steps_first_round_and_later_rounds_run_as_before() -> None:
    controller, _ = _controller(
        "train.dynamic_sampling=true", "rollout.prompts_per_step=1", "rollout.group_size=2"
    )
    calls: list[str] = []
    release = threading.Event()
    rounds = iter([[[0.0, 0.0]], [[1.0, 0.0]]])  # the queued round has no signal: a second round follows

    def rollout(prompts: Any, clock: Any = None) -> tuple[list[RolloutResult], RolloutStats]:
        calls.append(f"groups {prompts}")
        assert (clock is not None) == (prompts == ["ahead"])  # only the queued round waits for a wake
        if prompts == ["ahead"]:
            release.wait(timeout=10)  # vLLM holds the queued requests until it wakes
        return _results(next(rounds)), RolloutStats(rows=2, wall_s=99.0)

    controller.rollout = type("Rollout", (), {"groups": staticmethod(rollout)})()
    controller.preprocess = lambda results: (  # type: ignore[assignment]
        StepBatch(groups=[[_sample(0)]], zero_signal=[len({r.result["reward"] for r in results}) == 1]),
        {},
    )
    collect = SyncCollector(controller)
    prompts = iter([["ahead"], ["second round"]])
    collect.next_prompts = lambda: next(prompts)  # type: ignore[method-assign]
    woken = collect.queue_next()
    assert isinstance(woken, WakeClock) and not woken.is_set()
    with pytest.raises(RuntimeError, match="not collected"):
        collect.queue_next()
    threading.Timer(0.2, release.set).start()
    batch, metrics = collect({})
    assert calls == ["groups ['ahead']", "groups ['second round']"]
    assert metrics["dynamic/rounds"] == 2.0 and not any(batch.zero_signal)
    assert metrics["rollout/queued_s"] < 1.0
    # The queued round counts the wait for it (about 0.2 s here), not its rollout's own 99 s; the
    # second round, sent when needed, its 99 s.
    assert 99.0 < metrics["rollout/wall_s"] < 99.0 + 1.0


def test_a_queued_rounds_generation_is_timed_from_vllms_wake_however_late_the_loop_waits() -> None:
    """``rollout/wall_s`` of a queued round: from the start of vLLM's wake to its last result, not
    from the wait, which the step's end (its metrics, a validation) may start late."""
    answered = threading.Event()

    def groups(prompts: Any, clock: Any = None) -> tuple[list[RolloutResult], RolloutStats]:
        assert clock.wait(timeout=10)  # vLLM holds the queued requests until it wakes
        time.sleep(0.3)  # their generation
        answered.set()
        return _results([[1.0, 0.0]]), RolloutStats(rows=2, wall_s=99.0)

    queued = QueuedRollout(type("Rollout", (), {"groups": staticmethod(groups)})(), [{"prompt": 0}])
    queued.woken.start(time.monotonic())
    assert answered.wait(timeout=10)
    time.sleep(0.5)  # the loop comes to wait only now
    _, stats, queued_s = queued.wait()
    assert 0.3 <= stats.wall_s < 0.5 and queued_s >= 0.8
