"""The policy through Megatron-Bridge and real megatron-core equals HF transformers on a video prompt.

Runs on CPU (gloo, world size 1) with :mod:`rl_bridge.megatron.cpu_support`; also checks that the
Transformer Engine stand-in and the CPU support leave nothing behind and stay off on CUDA hosts.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoProcessor, BatchFeature, Qwen2_5_VLForConditionalGeneration

from rl_bridge.megatron import cpu_support
from rl_bridge.megatron.te_standin import import_megatron_bridge, transformer_engine_installed

pytestmark = pytest.mark.integration

MAX_ABS_LOGIT_DIFF = 1e-4
NUM_FRAMES, FRAME_SIZE = 4, 56


@pytest.fixture(scope="module")
def video_batch(tiny_qwen25vl: Path) -> BatchFeature:
    """Two identical chat prompts, each with a 4-frame 56x56 video: random frames, then reversed."""
    processor = AutoProcessor.from_pretrained(tiny_qwen25vl)
    shape = (NUM_FRAMES, FRAME_SIZE, FRAME_SIZE, 3)
    frames = np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)
    content = [{"type": "video"}, {"type": "text", "text": "What happens in the video?"}]
    messages = [{"role": "user", "content": content}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(
        text=[text, text], videos=[frames, frames[::-1].copy()], do_sample_frames=False, return_tensors="pt"
    )


@pytest.fixture(scope="module")
def hf_logits(tiny_qwen25vl: Path, video_batch: BatchFeature) -> torch.Tensor:
    """HF reference logits ``[2, S, V]`` in fp32 (with ``mm_token_type_ids`` for 3D positions)."""
    assert "mm_token_type_ids" in video_batch and "second_per_grid_ts" in video_batch, sorted(video_batch)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwen25vl, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**video_batch).logits


def _megatron_logits(model: list[torch.nn.Module], batch: BatchFeature) -> torch.Tensor:
    from rl_bridge.megatron.model import forward_logits

    with torch.no_grad():
        return forward_logits(
            model,
            input_ids=batch["input_ids"],
            pixel_values_videos=batch["pixel_values_videos"],
            video_grid_thw=batch["video_grid_thw"],
            second_per_grid_ts=batch["second_per_grid_ts"],
        ).cpu()


@pytest.mark.parametrize("layer_spec", ["auto", "local"])
def test_logits_match_hf_on_video_prompt(
    megatron_runtime: None,
    tiny_qwen25vl: Path,
    video_batch: BatchFeature,
    hf_logits: torch.Tensor,
    layer_spec: str,
) -> None:
    from rl_bridge.megatron.attention import SDPADotProductAttention
    from rl_bridge.megatron.model import build_policy

    model = build_policy(tiny_qwen25vl, dtype=torch.float32, layer_spec=layer_spec)
    model[0].eval()
    core_attention = model[0].language_model.decoder.layers[0].self_attention.core_attention
    if layer_spec == "auto" and not transformer_engine_installed():
        assert isinstance(core_attention, SDPADotProductAttention)
    if layer_spec == "local":
        assert type(core_attention).__name__ == "DotProductAttention"

    logits = _megatron_logits(model, video_batch)

    assert logits.shape == hf_logits.shape  # vocabulary padding sliced off
    max_diff = (logits - hf_logits).abs().max().item()
    assert max_diff <= MAX_ABS_LOGIT_DIFF, f"max |Megatron - HF| logit difference {max_diff:.3g}"

    # Same text, different frames: equal up to the first video token, different after it.
    video_token_id = model[0].config.video_token_id
    first_video = int((video_batch["input_ids"][0] == video_token_id).nonzero()[0])
    torch.testing.assert_close(logits[0, :first_video], logits[1, :first_video], rtol=0, atol=0)
    video_effect = (logits[0, first_video:] - logits[1, first_video:]).abs().max().item()
    assert video_effect > 100 * MAX_ABS_LOGIT_DIFF, f"the frames barely change logits ({video_effect:.3g})"


def test_mrope_section_is_read_from_the_checkpoint(
    megatron_runtime: None,
    tiny_qwen25vl: Path,
    video_batch: BatchFeature,
    hf_logits: torch.Tensor,
    tmp_path: Path,
) -> None:
    """A non-default split of the rotary frequencies (the bridge alone would keep (16, 24, 24))."""
    from rl_bridge.megatron.model import build_policy

    checkpoint = shutil.copytree(tiny_qwen25vl, tmp_path / "mrope-2-31-31")
    config = json.loads((checkpoint / "config.json").read_text())
    config["text_config"]["rope_parameters"]["mrope_section"] = [2, 31, 31]
    (checkpoint / "config.json").write_text(json.dumps(config))
    hf_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf_model(**video_batch).logits
    assert (reference - hf_logits).abs().max().item() > 10 * MAX_ABS_LOGIT_DIFF  # the split matters

    model = build_policy(checkpoint, dtype=torch.float32)
    model[0].eval()
    max_diff = (_megatron_logits(model, video_batch) - reference).abs().max().item()
    assert max_diff <= MAX_ABS_LOGIT_DIFF, f"max |Megatron - HF| logit difference {max_diff:.3g}"


def test_mrope_section_must_fit_the_head_size() -> None:
    from rl_bridge.megatron.model import mrope_section

    config = SimpleNamespace(rope_parameters={"mrope_section": [16, 24, 24]}, head_dim=128)
    assert mrope_section(config) == [16, 24, 24]
    with pytest.raises(ValueError, match="sums to 64, but head_dim / 2 is 32"):
        mrope_section(SimpleNamespace(rope_parameters={"mrope_section": [16, 24, 24]}, head_dim=64))
    with pytest.raises(ValueError, match="no mrope_section"):
        mrope_section(SimpleNamespace(rope_parameters={"rope_type": "default"}, head_dim=128))


def test_ddp_wrapped_policy_matches_hf(
    megatron_runtime: None, tiny_qwen25vl: Path, video_batch: BatchFeature, hf_logits: torch.Tensor
) -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from rl_bridge.megatron.model import build_policy

    model = build_policy(tiny_qwen25vl, dtype=torch.float32, ddp_config=DistributedDataParallelConfig())
    assert isinstance(model[0], DistributedDataParallel)
    model[0].eval()
    max_diff = (_megatron_logits(model, video_batch) - hf_logits).abs().max().item()
    assert max_diff <= MAX_ABS_LOGIT_DIFF, f"max |Megatron - HF| logit difference {max_diff:.3g}"


def test_freeze_options_reach_the_vision_tower(megatron_runtime: None, tiny_qwen25vl: Path) -> None:
    from rl_bridge.megatron.model import build_policy

    model = build_policy(tiny_qwen25vl, dtype=torch.float32, freeze_vision=True, freeze_projector=False)
    visual = model[0].visual
    assert not any(p.requires_grad for p in visual.blocks.parameters())
    assert not any(p.requires_grad for p in visual.patch_embed.parameters())
    assert all(p.requires_grad for p in visual.merger.parameters())
    assert all(p.requires_grad for p in model[0].language_model.parameters())


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "boolean-mask"])
def test_sdpa_core_attention_equals_local_dot_product_attention(megatron_runtime: None, masked: bool) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rl_bridge.megatron.attention import SDPADotProductAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
        attention_dropout=0.0, use_cpu_initialization=True,
    )  # fmt: skip
    seq, batch, heads, groups, head_dim = 7, 2, 4, 2, 32
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(seq, batch, heads, head_dim, generator=generator, requires_grad=True)
    key = torch.randn(seq, batch, groups, head_dim, generator=generator, requires_grad=True)
    value = torch.randn(seq, batch, groups, head_dim, generator=generator, requires_grad=True)
    mask = None
    if masked:  # causal plus the last two keys of the second sequence hidden (True = masked)
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).repeat(batch, 1, 1, 1)
        mask[1, :, :, -2:] = True

    outputs, grads = [], []
    for cls in (DotProductAttention, SDPADotProductAttention):
        attention = cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        out = attention(query, key, value, attention_mask=mask)
        outputs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (query, key, value)))

    assert outputs[1].shape == (seq, batch, heads * head_dim)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-5)
    for sdpa_grad, local_grad in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(sdpa_grad, local_grad, rtol=0, atol=1e-4)


def test_te_standin_is_gone_after_import() -> None:
    bridge = import_megatron_bridge()
    assert hasattr(bridge, "AutoBridge")
    assert not any(type(finder).__name__ == "_StandinFinder" for finder in sys.meta_path)
    if transformer_engine_installed():
        import transformer_engine

        assert "transformer_engine" in sys.modules and transformer_engine.__file__
        return
    assert "transformer_engine" not in sys.modules
    assert "transformer_engine.pytorch" not in sys.modules
    from megatron.bridge.models.glm import glm45_bridge
    from megatron.bridge.peft import lora_layers
    from megatron.core.utils import get_te_version

    # Only lora_layers saw the stand-in; other TE probes found TE absent.
    with pytest.raises(ImportError, match="Transformer Engine is not installed"):
        lora_layers.te.Linear()
    assert glm45_bridge.HAVE_TE is False
    assert str(get_te_version()) == "0.0.0"


def test_cpu_support_changes_nothing_when_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    tracker = mcore_random._CUDA_RNG_STATE_TRACKER
    modes = torch._C._len_torch_function_stack()

    assert not cpu_support.cpu_support_needed()
    with cpu_support.cpu_execution() as active:
        assert active is False
        assert torch.cuda.current_device is current_device
        assert mcore_random._CUDA_RNG_STATE_TRACKER is tracker
        assert torch._C._len_torch_function_stack() == modes


def test_cpu_support_applies_and_restores_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    current_device = torch.cuda.current_device
    tracker = mcore_random._CUDA_RNG_STATE_TRACKER
    modes = torch._C._len_torch_function_stack()

    with cpu_support.cpu_execution() as active:
        assert active is True
        assert cpu_support.cpu_execution_active()
        assert torch.cuda.current_device() == "cpu"
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        cpu_tensor = torch.ones(1)
        assert cpu_tensor.cuda() is cpu_tensor
        assert cpu_tensor.type() == "torch.cuda.FloatTensor"  # what gradient clipping asserts
    assert torch.cuda.current_device is current_device
    assert mcore_random._CUDA_RNG_STATE_TRACKER is tracker
    assert torch._C._len_torch_function_stack() == modes
