"""MegatronPolicy on the tiny Qwen2.5-VL with real videos: logprobs, GRPO step, export, resume.

Runs real megatron-core and Megatron-Bridge on CPU (gloo, world size 1, see
:mod:`rl_bridge.megatron.cpu_support`). The batch mixes two videos of different sizes and lengths,
so one micro-batch concatenates unequal media and right-pads unequal sequences.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rl_bridge.grpo import GRPOLossConfig
from rl_bridge.megatron.batch import MediaTokens, PolicySample, collate
from rl_bridge.megatron.hf_export import chunk_by_bytes
from rl_bridge.megatron.policy import MegatronPolicy, PolicyConfig
from rl_bridge.megatron.policy_loss import GRPOPolicyLoss, TrainStepMetrics
from rl_bridge.processors import ProcessedMedia, load_processor
from rl_bridge.services.process import free_port
from video_grpo_demo.synthetic import indexed_frames, write_video
from vllm_video_plugin.cache import DecodeCache

pytestmark = pytest.mark.integration

LOGPROB_TOLERANCE = 1e-5
LEARNING_RATE = 1e-3
# (video, response, advantage): two responses per video, advantages of both signs per video.
TRAJECTORIES = (
    ("first", "The colour cycles through six hues.", 1.0),
    ("second", "Nothing happens", -1.0),
    ("first", "A barcode counts up", -1.0),
    ("second", "Red, then yellow, then green.", 1.0),
)


@pytest.fixture(scope="module")
def videos(sample_video: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The session's 112x112 sample video and a shorter, non-square 84x56 one."""
    second = write_video(
        tmp_path_factory.mktemp("policy-media") / "second.mp4",
        indexed_frames(12, width=84, height=56),
        fps=8,
        gop=4,
    ).path
    return {"first": sample_video, "second": second}


@pytest.fixture(scope="module")
def samples(tiny_qwen25vl: Path, videos: dict[str, Path]) -> list[PolicySample]:
    """One chat prompt per video (placeholders expanded) followed by a response; targets = response."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_qwen25vl)
    media_processor = load_processor(tiny_qwen25vl)
    decode_cache = DecodeCache()
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    template = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = []
    for video_name, response, advantage in TRAJECTORIES:
        frames = decode_cache.get_or_decode(videos[video_name].read_bytes(), media_processor.contract)
        video = media_processor.process_video(frames.data, frames.sample)
        prompt = template.replace(processor.video_token, processor.video_token * video.num_placeholders)
        prompt_ids = processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = processor.tokenizer(response + "<|im_end|>", add_special_tokens=False)["input_ids"]
        input_ids = torch.tensor(prompt_ids + response_ids)
        target_mask = torch.zeros(len(input_ids), dtype=torch.bool)
        target_mask[len(prompt_ids) :] = True
        out.append(
            PolicySample(
                input_ids=input_ids,
                target_mask=target_mask,
                advantage=advantage,
                media=(video,),
            )
        )
    grids = {tuple(s.media[0].tensors["video_grid_thw"][0].tolist()) for s in out}
    assert len(grids) == 2, f"the two videos should have different grids, got {grids}"
    return out


def hf_logprobs(model_dir: Path, samples: list[PolicySample]) -> list[torch.Tensor]:
    """Reference: HF transformers' full log-softmax, one sample at a time, 0 off the targets (any
    Qwen-VL checkpoint: the video placeholders are typed for its 3D positions)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    video_token_id = model.config.video_token_id
    out = []
    for sample in samples:
        input_ids = sample.input_ids[None]
        with torch.no_grad():
            logits = model(
                input_ids=input_ids,
                **sample.media[0].tensors,
                mm_token_type_ids=(input_ids == video_token_id).long() * 2,
            ).logits[0]
        logprobs = torch.zeros(len(sample.input_ids))
        logprobs[1:] = torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, sample.input_ids[1:, None])[
            :, 0
        ]
        out.append(torch.where(sample.target_mask, logprobs, 0.0))
    return out


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def cloned_weights(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in policy.export_hf_weights()}


def step_gradients(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    """The gradients of the last step, as DDP left them in its buffers (``main_grad``)."""
    module = policy.model[0].module
    return {name: p.main_grad.clone() for name, p in module.named_parameters() if p.requires_grad}


@dataclass(frozen=True)
class Trained:
    """A policy after one GRPO step (micro-batches of 2) and what was observed around the step."""

    policy: MegatronPolicy
    batch: list[PolicySample]
    old_logprobs: list[torch.Tensor]
    new_logprobs: list[torch.Tensor]
    weights_before: dict[str, torch.Tensor]
    weights_after: dict[str, torch.Tensor]
    gradients: dict[str, torch.Tensor]
    metrics: TrainStepMetrics


def policy_config(**overrides: object) -> PolicyConfig:
    return PolicyConfig(**{"learning_rate": LEARNING_RATE, "micro_batch_size": 2, **overrides})


@pytest.fixture(scope="module")
def trained(megatron_runtime: None, tiny_qwen25vl: Path, samples: list[PolicySample]) -> Trained:
    policy = MegatronPolicy(tiny_qwen25vl, policy_config())
    old_logprobs = policy.logprobs(samples)
    weights_before = cloned_weights(policy)
    batch = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(samples, old_logprobs, strict=True)]
    metrics = policy.train_step(batch, GRPOPolicyLoss(GRPOLossConfig()))
    return Trained(
        policy=policy,
        batch=batch,
        old_logprobs=old_logprobs,
        new_logprobs=policy.logprobs(samples),
        weights_before=weights_before,
        weights_after=cloned_weights(policy),
        gradients=step_gradients(policy),
        metrics=metrics,
    )


def test_logprobs_through_the_schedule_equal_hf(
    trained: Trained, tiny_qwen25vl: Path, samples: list[PolicySample]
) -> None:
    reference = hf_logprobs(tiny_qwen25vl, samples)

    difference = max_diff(trained.old_logprobs, reference)
    assert difference <= LOGPROB_TOLERANCE, f"max |Megatron - HF| logprob {difference:.3g}"
    for sample, logprobs in zip(samples, trained.old_logprobs, strict=True):
        assert logprobs.shape == sample.input_ids.shape and logprobs.dtype == torch.float32
        assert torch.all(logprobs[~sample.target_mask] == 0)
        assert torch.all(logprobs[sample.target_mask] < 0)


def test_train_step_moves_each_response_in_the_sign_of_its_advantage(
    trained: Trained, samples: list[PolicySample]
) -> None:
    for index, (sample, old, new) in enumerate(
        zip(samples, trained.old_logprobs, trained.new_logprobs, strict=True)
    ):
        change = (new - old)[sample.target_mask].sum().item()
        assert math.copysign(1.0, change) == math.copysign(1.0, sample.advantage) and abs(change) > 1e-3, (
            f"sample {index}: advantage {sample.advantage}, response logprob change {change:.4g}"
        )

    metrics = trained.metrics
    targets = [s.num_target_tokens for s in samples]
    # On-policy first step: every ratio is 1, so the token-mean loss is -sum(A_i * n_i) / sum(n_i).
    expected_loss = -sum(s.advantage * n for s, n in zip(samples, targets, strict=True)) / sum(targets)
    assert metrics.loss == pytest.approx(expected_loss, abs=1e-6)
    assert metrics.loss_metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics.step == 1 and trained.policy.step == 1
    assert metrics.num_samples == len(samples) and metrics.num_target_tokens == sum(targets)
    assert metrics.num_tokens == sum(len(s.input_ids) for s in samples)
    assert metrics.learning_rate == LEARNING_RATE and not metrics.update_skipped
    assert metrics.grad_norm is not None and metrics.grad_norm > 0
    assert metrics.as_dict()["train/loss"] == metrics.loss


def test_a_forward_only_reference_holds_only_its_weights_and_gives_the_same_logprobs(
    trained: Trained, tiny_qwen25vl: Path, samples: list[PolicySample]
) -> None:
    reference = MegatronPolicy(tiny_qwen25vl, policy_config(trainable=False))
    # The checkpoint's weights: the trainable policy's logprobs before its step.
    assert max_diff(reference.logprobs(samples), trained.old_logprobs) <= 1e-6
    held = reference.state_bytes()
    parameters = sum(p.numel() for p in reference.model[0].parameters())
    nothing_else = {"gradients": 0, "optimizer": 0, "optimizer_host": 0}
    assert held == {"parameters": 4 * parameters, **nothing_else}  # fp32, nothing else
    assert not any(p.requires_grad for p in reference.model[0].parameters())
    # The trained policy after one Adam step: fp32 weights, an fp32 gradient buffer, two moments.
    policy = trained.policy.state_bytes()
    assert policy["parameters"] == held["parameters"]
    assert policy["gradients"] >= held["parameters"] and policy["optimizer"] >= 2 * held["parameters"]
    per_parameter = sum(policy.values()) / parameters
    assert per_parameter >= 16 and sum(held.values()) / parameters == 4
    with pytest.raises(RuntimeError, match="forward-only"):
        reference.train_step(trained.batch, GRPOPolicyLoss(GRPOLossConfig()))
    assert reference.learning_rate == 0.0


def test_gradient_accumulation_does_not_depend_on_the_micro_batch_split(
    trained: Trained, tiny_qwen25vl: Path
) -> None:
    policy = MegatronPolicy(tiny_qwen25vl, policy_config(micro_batch_size=1))
    metrics = policy.train_step(trained.batch, GRPOPolicyLoss(GRPOLossConfig()))

    assert metrics.loss == pytest.approx(trained.metrics.loss, abs=1e-6)
    assert metrics.grad_norm == pytest.approx(trained.metrics.grad_norm, rel=1e-5)
    gradients = step_gradients(policy)
    assert gradients.keys() == trained.gradients.keys()
    for name, gradient in gradients.items():
        reference = trained.gradients[name]
        scale = reference.abs().max().item()
        assert scale > 0, f"no gradient reached {name}"
        # Summation order differs between the splits; the gradients agree to float32 rounding.
        torch.testing.assert_close(
            gradient, reference, rtol=0, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_normaliser_counts_the_weighted_sequences_whatever_the_split(
    trained: Trained, tiny_qwen25vl: Path
) -> None:
    """Sequence-mean loss with one sample masked (weight 0): one micro-batch of four and four of one
    give the loss of the three weighted sequences and the same gradient."""
    config = GRPOLossConfig(loss_agg_mode="seq-mean-token-mean")
    batch = [dataclasses.replace(s, loss_weight=0.0) if i == 1 else s for i, s in enumerate(trained.batch)]
    runs = {}
    for micro_batch_size in (4, 1):
        policy = MegatronPolicy(tiny_qwen25vl, policy_config(micro_batch_size=micro_batch_size))
        metrics = policy.train_step(batch, GRPOPolicyLoss(config))
        runs[micro_batch_size] = (metrics, step_gradients(policy))
    # On-policy (ratio 1): -(mean of the weighted sequences' advantages) = -(1 - 1 + 1) / 3.
    for metrics, _ in runs.values():
        assert metrics.loss == pytest.approx(-1 / 3, abs=1e-6)
    (one, one_grads), (four, four_grads) = runs[4], runs[1]
    assert four.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    for name, gradient in four_grads.items():
        scale = one_grads[name].abs().max().item()
        torch.testing.assert_close(gradient, one_grads[name], rtol=0, atol=1e-5 * max(scale, 1e-12))


def test_training_forward_returns_pi_old_without_a_separate_pass(
    trained: Trained, tiny_qwen25vl: Path
) -> None:
    """With one optimizer step per rollout batch the step's own forward gives ``pi_old``: the same
    values as :meth:`MegatronPolicy.logprobs` before the step, and the same update as with them."""
    policy = MegatronPolicy(tiny_qwen25vl, policy_config())
    no_old = [dataclasses.replace(s, old_logprobs=None) for s in trained.batch]
    metrics = policy.train_step(no_old, GRPOPolicyLoss(GRPOLossConfig()), return_logprobs=True)
    assert metrics.logprobs is not None
    assert max_diff(metrics.logprobs, trained.old_logprobs) <= LOGPROB_TOLERANCE
    assert metrics.loss == pytest.approx(trained.metrics.loss, abs=1e-6)
    assert metrics.grad_norm == pytest.approx(trained.metrics.grad_norm, rel=1e-5)
    assert max_diff(policy.logprobs(trained.batch), trained.new_logprobs) <= LOGPROB_TOLERANCE


def test_gradient_clipping_acts_on_cpu(trained: Trained, tiny_qwen25vl: Path) -> None:
    """megatron-core's gradient clipping runs on CPU as on GPUs: a bound over the step's gradient
    norm leaves the step as unclipped, one under it rescales the gradient (a different Adam update
    where epsilon matters), and the norm reported is the one before clipping."""
    norm = trained.metrics.grad_norm
    assert norm is not None and norm > 1.0, norm
    loss = GRPOPolicyLoss(GRPOLossConfig())
    steps = {}
    for clip in (0.0, 2 * norm, norm / 4):
        policy = MegatronPolicy(tiny_qwen25vl, policy_config(clip_grad=clip, adam_eps=1e-2))
        metrics = policy.train_step(trained.batch, loss)
        assert metrics.grad_norm == pytest.approx(norm, rel=1e-5)
        steps[clip] = (policy.logprobs(trained.batch), step_gradients(policy))
    unclipped_logprobs, unclipped_gradients = steps[0.0]
    assert max_diff(steps[2 * norm][0], unclipped_logprobs) == 0.0
    clipped_logprobs, clipped_gradients = steps[norm / 4]
    for name, gradient in clipped_gradients.items():  # the step's gradient, scaled by the clip
        torch.testing.assert_close(gradient, unclipped_gradients[name] / 4, rtol=1e-4, atol=1e-9)
    assert max_diff(clipped_logprobs, unclipped_logprobs) > 1e-3


def test_with_several_minibatches_the_clip_acts_and_clipped_tokens_get_no_gradient(
    megatron_runtime: None, tiny_qwen25vl: Path, samples: list[PolicySample]
) -> None:
    """PPO mini-batches: after the first mini-batch's update the second mini-batch is off-policy,
    its ratios leave the trust region and the clip takes the gradient of exactly those tokens."""
    from rl_bridge.grpo import grpo_loss

    config = GRPOLossConfig(eps_low=0.02, eps_high=0.02)
    policy = MegatronPolicy(tiny_qwen25vl, policy_config(learning_rate=2e-2))
    old = policy.logprobs(samples)
    batch = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(samples, old, strict=True)]
    first = policy.train_step(batch[:2], GRPOPolicyLoss(config))
    assert first.loss_metrics["clip/frac"] == 0.0  # on-policy: every ratio is 1
    current = policy.logprobs(batch[2:])
    second = policy.train_step(batch[2:], GRPOPolicyLoss(config))
    assert second.loss_metrics["clip/frac"] > 0.0, second.loss_metrics

    # The same loss on the same logprobs, as leaves: zero gradient exactly on the clipped tokens.
    micro = collate(batch[2:], pad_token_id=policy.pad_token_id, media_tokens=policy.media_tokens)
    width = micro.input_ids.shape[1]
    logprobs = torch.stack([torch.nn.functional.pad(lp, (0, width - len(lp))) for lp in current])
    logprobs.requires_grad_()
    loss, metrics = grpo_loss(
        logprobs, micro.advantages, micro.target_mask, config, old_logprobs=micro.old_logprobs
    )
    loss.backward()
    ratio = (logprobs.detach() - micro.old_logprobs).exp()
    adv = micro.advantages.unsqueeze(-1)
    clipped = micro.target_mask & (
        ((ratio > 1 + config.eps_high) & (adv > 0)) | ((ratio < 1 - config.eps_low) & (adv < 0))
    )
    assert clipped.any() and metrics["clip/frac"].item() == pytest.approx(
        second.loss_metrics["clip/frac"], abs=1e-6
    )
    assert torch.all(logprobs.grad[clipped] == 0)
    assert torch.all(logprobs.grad[micro.target_mask & ~clipped] != 0)


def test_exported_weights_have_hf_names_and_the_saved_directory_loads_in_transformers(
    trained: Trained, tiny_qwen25vl: Path, samples: list[PolicySample], tmp_path: Path
) -> None:
    with safe_open(tiny_qwen25vl / "model.safetensors", framework="pt") as source:
        source_shapes = {name: tuple(source.get_slice(name).get_shape()) for name in source.keys()}  # noqa: SIM118
    policy = trained.policy
    exported = list(policy.export_hf_weights())
    names = [name for name, _ in exported]
    assert len(names) == len(set(names)) and set(names) == set(source_shapes)
    assert all(tuple(tensor.shape) == source_shapes[name] for name, tensor in exported)
    unchanged = [
        name for name in names if torch.equal(trained.weights_before[name], trained.weights_after[name])
    ]
    assert not unchanged, f"weights not moved by the step: {unchanged}"

    max_chunk_bytes = 256 * 1024
    chunks = list(chunk_by_bytes(policy.export_hf_weights(), max_chunk_bytes))
    assert len(chunks) > 1 and [name for chunk in chunks for name, _ in chunk] == names
    for chunk in chunks:
        assert len(chunk) == 1 or sum(t.numel() * t.element_size() for _, t in chunk) <= max_chunk_bytes

    sharded = policy.save_hf_checkpoint(tmp_path / "sharded", max_shard_bytes=2 * 1024**2)
    single = policy.save_hf_checkpoint(tmp_path / "single")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(names) and len(set(index["weight_map"].values())) > 1
    with safe_open(single / "model.safetensors", framework="pt") as saved:
        assert all(torch.equal(saved.get_tensor(name), trained.weights_after[name]) for name in names)
    for source_file in tiny_qwen25vl.iterdir():
        if source_file.suffix != ".safetensors":
            assert (single / source_file.name).read_bytes() == source_file.read_bytes(), source_file.name
    with pytest.raises(FileExistsError, match="not empty"):
        policy.save_hf_checkpoint(single)

    current = policy.logprobs(samples)
    difference = max_diff(current, hf_logprobs(sharded, samples))
    assert difference <= LOGPROB_TOLERANCE, f"max |Megatron - HF(saved)| logprob {difference:.3g}"
    assert max_diff(current, trained.old_logprobs) > 100 * LOGPROB_TOLERANCE  # the saved weights are new ones


def test_resume_reproduces_the_next_step_exactly(
    trained: Trained, tiny_qwen25vl: Path, tmp_path: Path
) -> None:
    loss_fn = GRPOPolicyLoss(GRPOLossConfig())
    policy = trained.policy
    checkpoint = policy.save_checkpoint(tmp_path / "checkpoint")
    rng_at_save = torch.get_rng_state()
    logprobs = policy.logprobs(trained.batch)
    batch = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(trained.batch, logprobs, strict=True)]
    expected = policy.train_step(batch, loss_fn)
    expected_weights = cloned_weights(policy)

    torch.manual_seed(1234)
    resumed = MegatronPolicy(tiny_qwen25vl, policy_config())
    assert resumed.load_checkpoint(checkpoint) == 1 and resumed.step == 1
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert max_diff(resumed.logprobs(trained.batch), logprobs) == 0.0
    metrics = resumed.train_step(batch, loss_fn)

    assert metrics.step == expected.step == 2
    assert metrics.loss == expected.loss, f"resumed loss {metrics.loss!r} != {expected.loss!r}"
    assert metrics.grad_norm == expected.grad_norm
    weights = dict(resumed.export_hf_weights())
    mismatched = [name for name, tensor in expected_weights.items() if not torch.equal(weights[name], tensor)]
    assert not mismatched, (
        f"weights differ after the resumed step (optimizer state not restored?): {mismatched}"
    )


def test_resume_restores_the_distributed_optimizers_state(
    megatron_runtime: None, tiny_qwen25vl: Path, samples: list[PolicySample], tmp_path: Path
) -> None:
    """megatron-core's distributed optimizer leaves its master weights and moments out of its
    ``state_dict`` and, without Apex or Transformer Engine, loads one ``step`` tensor shared by
    every parameter (each parameter's update then advanced it: the bias correction ran as if ~50
    steps had passed). The checkpoint saves the first beside the state dict and gives every
    parameter its own step: the resumed Adam state equals the saved one and the next step is
    bitwise the uninterrupted one's."""
    loss_fn = GRPOPolicyLoss(GRPOLossConfig())
    config = policy_config(distributed_optimizer=True)
    policy = MegatronPolicy(tiny_qwen25vl, config)
    logprobs = policy.logprobs(samples)
    batch = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(samples, logprobs, strict=True)]
    policy.train_step(batch, loss_fn)
    checkpoint = policy.save_checkpoint(tmp_path / "checkpoint")
    rng_at_save = torch.get_rng_state()

    resumed = MegatronPolicy(tiny_qwen25vl, config)
    assert resumed.load_checkpoint(checkpoint) == 1
    saved, loaded = policy._optimizer.optimizer, resumed._optimizer.optimizer  # the inner torch Adam
    pairs = zip(
        (p for group in saved.param_groups for p in group["params"]),
        (p for group in loaded.param_groups for p in group["params"]),
        strict=True,
    )
    for before, after in pairs:
        assert torch.equal(before, after)
        assert saved.state[before].keys() == loaded.state[after].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in saved.state[before].items():
            assert torch.equal(loaded.state[after][key], value), key
    steps = [state["step"] for state in loaded.state.values()]
    assert len({step.untyped_storage().data_ptr() for step in steps}) == len(steps)

    torch.set_rng_state(rng_at_save)  # both continue from the saved generator state
    current = policy.logprobs(batch)
    batch = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(batch, current, strict=True)]
    expected = policy.train_step(batch, loss_fn)
    expected_weights = cloned_weights(policy)
    torch.set_rng_state(rng_at_save)
    metrics = resumed.train_step(batch, loss_fn)
    assert metrics.step == expected.step == 2
    assert (metrics.loss, metrics.grad_norm) == (expected.loss, expected.grad_norm)
    weights = dict(resumed.export_hf_weights())
    mismatched = [name for name, tensor in expected_weights.items() if not torch.equal(weights[name], tensor)]
    assert not mismatched, f"weights differ after the resumed step: {mismatched}"


# Two gloo ranks, each holding half of a padded 12-column vocabulary (the real one has 11 tokens).
_VOCAB_PARALLEL_WORKER = """
import json, sys, torch, torch.distributed as dist
from rl_bridge.megatron.logprobs import token_logprobs
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
generator = torch.Generator().manual_seed(0)
vocab, padded, rows, temperature = 11, 12, 9, 0.7
logits = torch.randn(rows, padded, generator=generator)
targets = torch.randint(0, vocab, (rows,), generator=generator)
upstream = torch.randn(rows, generator=generator)
local = slice(rank * padded // 2, (rank + 1) * padded // 2)
shard = logits[:, local].clone().requires_grad_()
values = token_logprobs(shard, targets, vocab_size=vocab, temperature=temperature,
                        tp_group=dist.group.WORLD, max_chunk_elements=12)
(values * upstream).sum().backward()
full = logits.clone().requires_grad_()
reference = torch.log_softmax(full[:, :vocab] / temperature, dim=-1).gather(-1, targets[:, None])[:, 0]
(reference * upstream).sum().backward()
result = {"value": (values - reference).abs().max().item(),
          "grad": (shard.grad - full.grad[:, local]).abs().max().item(),
          "padding_grad": shard.grad[:, vocab - local.start:].abs().max().item() if rank else 0.0}
# Restricted to a support across both shards, and to one that rank 1's shard does not hold.
for name, support in (("support", torch.tensor([1, 4, 7, 9])), ("support_one_shard", torch.tensor([0, 2]))):
    picked = support[torch.randint(0, len(support), (rows,), generator=generator)]
    shard = logits[:, local].clone().requires_grad_()
    values = token_logprobs(shard, picked, vocab_size=vocab, temperature=temperature,
                            tp_group=dist.group.WORLD, support=support, max_chunk_elements=12)
    (values * upstream).sum().backward()
    full = logits.clone().requires_grad_()
    masked = torch.full_like(full, float("-inf"))
    masked[:, support] = full[:, support]
    reference = torch.log_softmax(masked / temperature, dim=-1).gather(-1, picked[:, None])[:, 0]
    (reference * upstream).sum().backward()
    result[name] = max((values - reference).abs().max().item(),
                       (shard.grad - full.grad[:, local]).abs().max().item())
# The entropy of the same distributions, with its gradient, over the vocabulary and each support.
entropy_upstream = torch.randn(rows, generator=generator)
for name, support in (("entropy", None), ("entropy_support", torch.tensor([1, 4, 7, 9])),
                      ("entropy_support_one_shard", torch.tensor([0, 2]))):
    picked = (targets if support is None
              else support[torch.randint(0, len(support), (rows,), generator=generator)])
    shard = logits[:, local].clone().requires_grad_()
    values, entropy = token_logprobs(shard, picked, vocab_size=vocab, temperature=temperature,
                                     tp_group=dist.group.WORLD, support=support, max_chunk_elements=12,
                                     return_entropy=True)
    (values * upstream + entropy * entropy_upstream).sum().backward()
    full = logits.clone().requires_grad_()
    masked = torch.full_like(full, -1e4)  # probability exactly 0, no inf arithmetic
    columns = torch.arange(vocab) if support is None else support
    masked[:, columns] = full[:, columns]
    log_p = torch.log_softmax(masked / temperature, dim=-1)
    reference = log_p.gather(-1, picked[:, None])[:, 0]
    naive_entropy = -(log_p.exp() * log_p).sum(dim=-1)
    (reference * upstream + naive_entropy * entropy_upstream).sum().backward()
    result[name] = max((entropy - naive_entropy).abs().max().item(),
                       (shard.grad - full.grad[:, local]).abs().max().item())
print(json.dumps(result))
dist.destroy_process_group()
"""


def test_vocab_parallel_logprobs_equal_the_full_log_softmax() -> None:
    """Tensor-parallel path of token_logprobs (all-reduces, shard offsets, padding, chunks, temperature,
    a support over both shards and one held by one shard only), and of its entropy with gradient."""
    port = str(free_port())
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _VOCAB_PARALLEL_WORKER, str(rank), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for rank, worker in enumerate(workers):
        stdout, stderr = worker.communicate(timeout=120)
        assert worker.returncode == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
        result = json.loads(stdout.strip().splitlines()[-1])
        assert result["value"] <= 1e-6 and result["grad"] <= 1e-6 and result["padding_grad"] == 0.0, (
            rank,
            result,
        )
        assert result["support"] <= 1e-6 and result["support_one_shard"] <= 1e-6, (rank, result)
        assert max(result[k] for k in ("entropy", "entropy_support", "entropy_support_one_shard")) <= 1e-5, (
            rank,
            result,
        )


def test_collate_pads_right_concatenates_media_and_checks_placeholders() -> None:
    media_tokens = MediaTokens(video_token_id=9, image_token_id=8, spatial_merge_size=2)

    def sample(num_video_tokens: int, grid: list[int], response: int) -> PolicySample:
        ids = torch.tensor([1] + [9] * num_video_tokens + [2] * response)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[-response:] = True
        patches = grid[0] * grid[1] * grid[2]
        return PolicySample(
            input_ids=ids,
            target_mask=mask,
            media=(
                ProcessedMedia(
                    "video",
                    {
                        "pixel_values_videos": torch.full((patches, 3), float(patches)),
                        "video_grid_thw": torch.tensor([grid]),
                        "second_per_grid_ts": torch.ones(1),
                    },
                    9,
                    (num_video_tokens,),
                ),
            ),
        )

    short, long = sample(2, [2, 2, 2], 1), sample(4, [1, 4, 4], 3)
    batch = collate([short, long], pad_token_id=0, media_tokens=media_tokens)

    assert batch.input_ids.tolist() == [[1, 9, 9, 2, 0, 0, 0, 0], [1, 9, 9, 9, 9, 2, 2, 2]]
    assert batch.target_mask.sum(dim=1).tolist() == [1, 3] and batch.lengths.tolist() == [4, 8]
    assert batch.media["video_grid_thw"].tolist() == [[2, 2, 2], [1, 4, 4]]
    assert batch.media["pixel_values_videos"][:, 0].tolist() == [8.0] * 8 + [16.0] * 16
    assert batch.media["second_per_grid_ts"].tolist() == [1.0, 1.0]
    assert batch.old_logprobs is None

    broken = dataclasses.replace(long, input_ids=torch.tensor([1] + [9] * 3 + [2] * 4))
    with pytest.raises(ValueError, match=r"sample 1 has 3 video placeholder tokens .* need 4"):
        collate([short, broken], pad_token_id=0, media_tokens=media_tokens)
    with pytest.raises(ValueError, match="samples \\[0\\] have no old_logprobs"):
        collate(
            [short, dataclasses.replace(long, old_logprobs=torch.zeros(8))],
            pad_token_id=0,
            media_tokens=media_tokens,
        )
