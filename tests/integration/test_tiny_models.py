"""Tiny model builders: HF transformers runs them on a video prompt; builds are deterministic, cached."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import av
import numpy as np
import pydantic
import pytest
import torch
from numpy.typing import NDArray
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer
from transformers.video_utils import VideoMetadata

from video_grpo_demo.tiny_models import MANIFEST_NAME, Qwen25VLSpec, build_tiny_model
from video_grpo_demo.tiny_models.qwen import QWEN_SPECIAL_TOKENS, RELEASED_PADDING_ROWS

pytestmark = pytest.mark.integration


def _decode(path: Path) -> tuple[NDArray[np.uint8], float]:
    """All frames of ``path`` as (N, H, W, 3) RGB, and the stream's frame rate in frames per second."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
        return frames, float(stream.average_rate)


def _file_digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("fixture_name", ["tiny_qwen25vl", "tiny_qwen3vl"])
def test_hf_forward_on_video_prompt(
    fixture_name: str, sample_video: Path, request: pytest.FixtureRequest
) -> None:
    model_dir: Path = request.getfixturevalue(fixture_name)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    frames, fps = _decode(sample_video)
    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What color is the clip?"}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text.count("<|vision_start|><|video_pad|><|vision_end|>") == 1
    metadata = VideoMetadata(total_num_frames=len(frames), fps=fps, frames_indices=list(range(len(frames))))
    inputs = processor(
        text=[text], videos=[frames], video_metadata=[metadata], do_sample_frames=True, return_tensors="pt"
    )

    merge = processor.video_processor.merge_size
    expected_video_tokens = int(inputs["video_grid_thw"].prod()) // merge**2
    assert expected_video_tokens > 0
    assert int((inputs["input_ids"] == processor.video_token_id).sum()) == expected_video_tokens

    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer))
    assert model.config.text_config.vocab_size == len(processor.tokenizer)
    assert torch.isfinite(logits).all()


def test_qwen25vl_matches_megatron_bridge_constraints(tiny_qwen25vl: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_qwen25vl)
    text = config.text_config
    assert text.hidden_size // text.num_attention_heads == 128
    assert text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert config.vision_config.out_hidden_size == text.hidden_size
    assert config.architectures == ["Qwen2_5_VLForConditionalGeneration"]

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen25vl)
    assert len(tokenizer) < 512
    config_ids = {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    for name, token in config_ids.items():
        assert getattr(config, name) == tokenizer.convert_tokens_to_ids(token), name
    assert tokenizer.eos_token == "<|im_end|>"
    assert (
        tokenizer.decode(tokenizer.encode("What color is the video? red")) == "What color is the video? red"
    )


def test_nemotron_vl_config_and_remote_code(tiny_nemotron_vl: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_nemotron_vl, trust_remote_code=True)
    assert config.architectures == ["NemotronH_Nano_VL_V2"]
    assert config.auto_map["AutoConfig"] == "configuration_nemotron_vl.NemotronH_Nano_VL_V2_Config"
    assert config.llm_config.hybrid_override_pattern == "M*-"
    assert config.vision_config.args == {"model": "vit_small_patch16_224"}
    tokenizer = AutoTokenizer.from_pretrained(tiny_nemotron_vl, trust_remote_code=True)
    assert config.img_context_token_id == tokenizer.convert_tokens_to_ids("<image>")
    assert config.llm_config.vocab_size == len(tokenizer)
    assert not any(p.suffix == ".safetensors" for p in tiny_nemotron_vl.iterdir())


def test_same_spec_gives_identical_files(tmp_path: Path) -> None:
    first = build_tiny_model("qwen2_5_vl", out_dir=tmp_path / "a", seed=7)
    second = build_tiny_model("qwen2_5_vl", out_dir=tmp_path / "b", seed=7)
    other_seed = build_tiny_model("qwen2_5_vl", out_dir=tmp_path / "a", seed=8)

    assert first.name == second.name
    assert _file_digests(first) == _file_digests(second)
    assert other_seed.name != first.name
    assert _file_digests(other_seed)["model.safetensors"] != _file_digests(first)["model.safetensors"]
    assert _file_digests(other_seed)["tokenizer.json"] == _file_digests(first)["tokenizer.json"]


def test_cache_is_reused_and_overrides_change_the_key(tmp_path: Path) -> None:
    built = build_tiny_model("qwen2_5_vl", out_dir=tmp_path)
    mtime = (built / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    again = build_tiny_model("qwen2_5_vl", out_dir=tmp_path)
    assert time.perf_counter() - start < 0.5
    assert again == built
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime

    manifest = json.loads((built / MANIFEST_NAME).read_text())
    assert manifest["spec"] == Qwen25VLSpec().model_dump(mode="json")
    assert built.name.endswith(manifest["cache_key"][:12])

    wider = build_tiny_model("qwen2_5_vl", out_dir=tmp_path, text_intermediate_size=640)
    assert wider != built
    assert AutoConfig.from_pretrained(wider).text_config.intermediate_size == 640
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([built.name, wider.name])


def test_bad_requests_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model family 'llama'"):
        build_tiny_model("llama", out_dir=tmp_path)
    with pytest.raises(pydantic.ValidationError, match="text_hidden_sise"):
        build_tiny_model("qwen2_5_vl", out_dir=tmp_path, text_hidden_sise=64)
    with pytest.raises(pydantic.ValidationError, match="must sum to text_head_dim / 2"):
        build_tiny_model("qwen2_5_vl", out_dir=tmp_path, text_head_dim=64)
    with pytest.raises(pydantic.ValidationError, match="must equal text_head_dim \\* text_num_heads"):
        build_tiny_model("qwen2_5_vl", out_dir=tmp_path, text_hidden_size=512)
    with pytest.raises(pydantic.ValidationError, match="has no Mamba layer"):
        build_tiny_model("nemotron_vl", out_dir=tmp_path, hybrid_override_pattern="*-")
    assert list(tmp_path.iterdir()) == []


def test_full_size_vocabulary_tied_embeddings_and_bf16_weights(tmp_path: Path) -> None:
    """A full-size model is built with the local tokenizer, its regular vocabulary filled with
    decodable filler tokens so that only the released padding rows lie past the tokenizer (a random
    model's samples decode, as a trained model's do), the embedding tied to the output layer and
    saved in bfloat16."""
    built = build_tiny_model(
        "qwen2_5_vl", out_dir=tmp_path, vocab_size=1000, tie_word_embeddings=True, weights_dtype="bfloat16"
    )
    config = AutoConfig.from_pretrained(built)
    tokenizer = AutoTokenizer.from_pretrained(built)
    tokens = len(tokenizer)
    assert config.text_config.vocab_size == 1000 == tokens + RELEASED_PADDING_ROWS
    specials = [tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS]
    assert specials == list(range(tokens - len(QWEN_SPECIAL_TOKENS) - 2, tokens - 2))  # after the regular
    assert config.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert tokenizer.decode([500, 501]) == " t500 t501"
    trained = Qwen25VLSpec().bpe_vocab_size
    assert all(i < trained for i in tokenizer(" t500 t501")["input_ids"])  # no merge spells a filler
    assert config.tie_word_embeddings
    model = AutoModelForImageTextToText.from_pretrained(built, dtype="auto")
    assert model.get_input_embeddings().weight.shape[0] == 1000
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    with pytest.raises(pydantic.ValidationError, match="smaller than the tokenizer"):
        build_tiny_model("qwen2_5_vl", out_dir=tmp_path, vocab_size=100)
