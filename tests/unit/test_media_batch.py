"""Per-turn media of trajectories: dedup, placeholder checks, masking and the policy batch.

Uses the real tiny Qwen2.5-VL processor and real encoded videos; trajectories are shaped as Gym
output items with placeholder runs of the sizes the processor gives (the real-vLLM version is
``tests/integration/test_trajectory_vllm.py``).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from gym_video_env.hookspecs import MediaSettings
from rl_bridge.media_batch import MediaStore, check_placeholders, placeholder_runs
from rl_bridge.megatron.batch import MediaTokens, PolicySample, collate
from rl_bridge.policy_inputs import PolicyInputBuilder
from rl_bridge.processors import ProcessedMedia, load_processor
from rl_bridge.processors.qwen import QwenVLProcessor
from rl_bridge.trajectory import parse_trajectory
from tests.fixtures.media import MakeVideo
from vllm_video_plugin.cache import DecodeCache
from vllm_video_plugin.decode import decode_frames

pytestmark = pytest.mark.unit

GROUP_SIZE = 4


@pytest.fixture(scope="module")
def processor(tiny_qwen25vl: Path) -> QwenVLProcessor:
    loaded = load_processor(tiny_qwen25vl)
    assert isinstance(loaded, QwenVLProcessor)
    return loaded


@pytest.fixture
def media(make_video: MakeVideo) -> dict[str, Path]:
    """Three clips of different sizes and lengths, in one media root."""
    return {
        "prompt": make_video(name="prompt", num_frames=16, width=112, height=112),
        "left": make_video(name="left", num_frames=8, width=84, height=56),
        "right": make_video(name="right", num_frames=12, width=56, height=84),
    }


def _builder(processor: QwenVLProcessor, root: Path) -> PolicyInputBuilder:
    return PolicyInputBuilder(processor, MediaSettings(media_root=root), decode_cache=DecodeCache())


def _video(path: Path) -> dict[str, Any]:
    return {"type": "input_video", "video_url": path.as_uri()}


def _tokens(processor: QwenVLProcessor, store: MediaStore, paths: list[Path]) -> list[int]:
    """A turn's new prompt tokens: text, then each clip's placeholder run wrapped in markers."""
    ids = [11, 12]
    for path in paths:
        part = parse_trajectory([_call([1], [2])], prompt=[_user([_video(path)])]).media[0]
        ids += [20, *[processor.video_token_id] * store.get(part).num_placeholders, 21]
    return ids + [13]


def _user(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": content}


def _call(prompt_ids: list[int], generation: list[int]) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "x"}],
        "prompt_token_ids": prompt_ids,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.25] * len(generation),
    }


def _rollout(
    processor: QwenVLProcessor,
    store: MediaStore,
    prompt: Path,
    later: list[Path],
    *,
    drop_later: bool = False,
) -> dict[str, Any]:
    """Two turns: the prompt clip, then a user message injecting ``later`` clips after a tool call.

    ``drop_later`` removes the first later clip from the message but keeps vLLM's tokens for it.
    """
    first = _tokens(processor, store, [prompt])
    generation = [30, 31]
    second = first + generation + _tokens(processor, store, later)
    shown = later[1:] if drop_later else later
    output = [
        _call(first, generation),
        {
            "type": "function_call_output",
            "call_id": "c",
            "output": "[moved to the next user message: 2 videos]",
        },
        _user([{"type": "input_text", "text": "next"}, *[_video(p) for p in shown]]),
        _call(second, [40, 41, 42]),
    ]
    return {
        "responses_create_params": {"input": [_user([{"type": "input_text", "text": "q"}, _video(prompt)])]},
        "response": {"output": output},
    }


def test_group_media_are_processed_once_and_shared(
    processor: QwenVLProcessor, media: dict[str, Path]
) -> None:
    builder = _builder(processor, media["prompt"].parent)
    prompt_processed = builder.processed_prompt_media([_user([_video(media["prompt"])])])
    assert builder.store.stats().processed == 1
    # G samples of one prompt; each injects two clips, which recur across samples.
    later = [[media["left"], media["right"]], [media["right"], media["left"]]] * (GROUP_SIZE // 2)
    samples = [builder.build(_rollout(processor, builder.store, media["prompt"], clips)) for clips in later]

    assert [s.mask_reason for s in samples] == [None] * GROUP_SIZE
    stats = builder.store.stats()
    assert stats.processed == 3, "three distinct clips, each processed once"
    for sample in samples:
        assert sample.media[0] is prompt_processed[0], "the prompt clip is one shared object"
        assert sample.media[0].tensors["pixel_values_videos"].data_ptr() == (
            prompt_processed[0].tensors["pixel_values_videos"].data_ptr()
        )
    assert samples[0].media[1] is samples[1].media[2], "a clip recurring in another sample is shared"
    referenced = sum(m.nbytes for s in samples for m in s.media)
    unique = {id(m): m.nbytes for s in samples for m in s.media}
    assert stats.unique_bytes == sum(unique.values()) < referenced / 3
    assert builder.metrics.as_dict()["media/placeholder_pass_rate"] == 1.0
    assert builder.metrics.turns_checked == 2 * GROUP_SIZE


def test_turn_tokens_targets_and_logprobs(processor: QwenVLProcessor, media: dict[str, Path]) -> None:
    builder = _builder(processor, media["prompt"].parent)
    record = _rollout(processor, builder.store, media["prompt"], [media["left"], media["right"]])
    rollout = builder.build(record)
    (sample,) = rollout.sequences
    last = record["response"]["output"][-1]
    assert sample.token_ids.tolist() == last["prompt_token_ids"] + last["generation_token_ids"]
    targets = sample.token_ids[sample.target_mask].tolist()
    assert targets == [30, 31, 40, 41, 42]
    assert sample.behaviour_logprobs[sample.target_mask].tolist() == [-0.25] * 5
    assert float(sample.behaviour_logprobs[~sample.target_mask].abs().sum()) == 0.0
    trajectory = rollout.trajectory
    assert trajectory is not None
    assert [[m.ref.value for m in turn.media] for turn in trajectory.turns] == [
        [str(media["prompt"])],
        [str(media["left"]), str(media["right"])],
    ]
    (policy_sample,) = rollout.to_policy_samples(advantage=0.5)
    assert policy_sample.media == sample.media and policy_sample.advantage == 0.5
    assert torch.equal(policy_sample.behaviour_logprobs, sample.behaviour_logprobs)


def test_a_re_tokenised_conversation_trains_as_two_sequences(
    processor: QwenVLProcessor, media: dict[str, Path]
) -> None:
    builder = _builder(processor, media["prompt"].parent)
    record = _rollout(processor, builder.store, media["prompt"], [media["left"]])
    second = record["response"]["output"][-1]
    first_length = len(record["response"]["output"][0]["prompt_token_ids"])
    second["prompt_token_ids"][first_length] = 99  # the first generation re-tokenised differently
    rollout = builder.build(record)

    assert rollout.mask_reason is None, rollout.mask_detail
    first, retokenised = rollout.sequences
    assert retokenised.token_ids.tolist() == second["prompt_token_ids"] + second["generation_token_ids"]
    assert retokenised.media[0] is first.media[0], "the prompt clip, restated, is the same tensor"
    assert [len(s.media) for s in rollout.sequences] == [1, 2]
    assert [s.token_ids[s.target_mask].tolist() for s in rollout.sequences] == [[30, 31], [40, 41, 42]]
    assert len(rollout.to_policy_samples(advantage=1.0)) == 2


def test_a_trajectory_with_a_clip_removed_is_masked_and_counted(
    processor: QwenVLProcessor, media: dict[str, Path]
) -> None:
    builder = _builder(processor, media["prompt"].parent)
    good = builder.build(_rollout(processor, builder.store, media["prompt"], [media["left"], media["right"]]))
    corrupted = _rollout(
        processor, builder.store, media["prompt"], [media["left"], media["right"]], drop_later=True
    )
    masked = builder.build(corrupted)  # never raises

    assert good.mask_reason is None and masked.mask_reason == "placeholder_mismatch"
    assert masked.loss_weight == 0.0 and masked.media == () and masked.sequences == ()
    assert masked.mask_detail is not None and masked.mask_detail.startswith("turn 1 (output[3])")
    assert masked.to_policy_samples(advantage=1.0) == []
    metrics = builder.metrics.as_dict()
    assert metrics["media/samples"] == 2 and metrics["media/masked_samples"] == 1
    assert metrics["media/masked/placeholder_mismatch"] == 1
    assert metrics["media/placeholder_turns_checked"] == 4 and metrics["media/placeholder_turns_passed"] == 3


def test_a_generated_media_placeholder_token_masks_the_sample(
    processor: QwenVLProcessor, media: dict[str, Path]
) -> None:
    """A random-weight 3B policy sampled the video placeholder id on the GPU (step 5 of 16 x 8): the
    trainer's collate then found 1,025 placeholders for 1,024 video tokens and the run stopped."""
    builder = _builder(processor, media["prompt"].parent)
    record = _rollout(processor, builder.store, media["prompt"], [media["left"]])
    record["response"]["output"][-1]["generation_token_ids"] = [40, processor.video_token_id, 42]
    masked = builder.build(record)  # never raises

    assert masked.mask_reason == "generated_media_token"
    assert masked.to_policy_samples(advantage=1.0) == []
    assert masked.mask_detail is not None and masked.mask_detail.startswith("turn 1 (output[3]) generated")
    assert (
        f"token {processor.video_token_id} (1 time(s), first at generated position 1)" in masked.mask_detail
    )
    assert builder.metrics.as_dict()["media/masked/generated_media_token"] == 1


def test_unloadable_media_are_masked_with_their_reason(
    processor: QwenVLProcessor, media: dict[str, Path], tmp_path: Path
) -> None:
    builder = _builder(processor, media["prompt"].parent)
    (tmp_path / "garbage.mp4").write_bytes(b"\x00not a video" * 10)
    cases = {
        "media_unavailable": [_video(tmp_path / "missing.mp4"), _video(Path("/etc/hostname"))],
        "media_undecodable": [_video(tmp_path / "garbage.mp4")],
    }
    cases["media_unavailable"].append({"type": "input_video", "video_url": "https://example.com/a.mp4"})
    for reason, parts in cases.items():
        for part in parts:
            record = {
                "responses_create_params": {"input": [_user([part])]},
                "response": {"output": [_call([1, 2], [3])]},
            }
            sample = builder.build(record)
            assert sample.mask_reason == reason, (part, sample.mask_detail)
            assert "input[0].content[0]" in (sample.mask_detail or "")
    bad = builder.build({"responses_create_params": {"input": "q"}, "response": {"output": [_call([1], [])]}})
    assert bad.mask_reason == "no_trainable_turn"
    assert builder.metrics.as_dict()["media/masked/media_unavailable"] == 3


def test_the_same_content_is_one_entry_whatever_its_source(
    processor: QwenVLProcessor, media: dict[str, Path], tmp_path: Path
) -> None:
    """A file, its ``file://`` URL, its ``data:`` URL and a frame manifest of its frames."""
    root = media["prompt"].parent
    store = MediaStore(processor, MediaSettings(media_root=root), decode_cache=DecodeCache())
    clip = media["left"]
    data_url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
    frames = decode_frames(clip, range(8))
    (root / "frames").mkdir()
    for index, frame in enumerate(frames.data):
        Image.fromarray(np.asarray(frame)).save(root / "frames" / f"{index}.png")
    manifest = {
        "format": "video_grpo.frames/v1",
        "source_fps": frames.source.fps,
        "total_frames": 8,
        "frames": [{"path": f"frames/{i}.png", "index": i} for i in range(8)],
    }
    (root / "clip.json").write_text(json.dumps(manifest))
    parts = [
        {"type": "input_video", "path": clip.name},
        _video(clip),
        {"type": "input_video", "video": data_url},
        {"type": "input_video", "frames_manifest": "clip.json"},
    ]
    got = [store.get(p) for p in parse_trajectory([_call([1], [2])], prompt=[_user(parts)]).media]
    assert got[0] is got[1] is got[2], "one content, one entry"
    assert got[3] is not got[0]
    assert torch.equal(got[3].tensors["pixel_values_videos"], got[0].tensors["pixel_values_videos"])
    assert store.stats().processed == 2 and store.stats().requests == 4

    image = io.BytesIO()
    Image.fromarray(np.full((30, 40, 3), 200, np.uint8)).save(image, format="PNG")
    image_url = "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()
    (part,) = parse_trajectory(
        [_call([1], [2])], prompt=[_user([{"type": "input_image", "image_url": image_url}])]
    ).media
    processed = store.get(part)
    assert processed.kind == "image" and processed.placeholder_token_id == processor.image_token_id


def _fake(token: int, runs: tuple[int, ...]) -> ProcessedMedia:
    return ProcessedMedia("video", {"x": torch.zeros(sum(runs), 2)}, token, runs)


def test_placeholder_check_compares_runs_in_order() -> None:
    small, large = _fake(9, (2,)), _fake(9, (3,))
    ids = [1, 9, 9, 2, 9, 9, 9, 3]
    assert placeholder_runs(ids, frozenset({9})) == [(9, 2), (9, 3)]
    assert check_placeholders(ids, [small, large], frozenset({9})) is None
    swapped = check_placeholders(ids, [large, small], frozenset({9}))
    assert swapped is not None and "[2x9, 3x9]" in swapped and "[3x9, 2x9]" in swapped
    assert check_placeholders(ids, [small], frozenset({9})) is not None
    per_patch = _fake(9, (2, 3))  # one item, two runs (a Qwen3-VL video of two temporal patches)
    assert check_placeholders(ids, [per_patch], frozenset({9})) is None


def test_collate_references_shared_media_until_the_forward(
    processor: QwenVLProcessor, media: dict[str, Path]
) -> None:
    builder = _builder(processor, media["prompt"].parent)
    samples = [
        builder.build(_rollout(processor, builder.store, media["prompt"], [media["left"]])).to_policy_samples(
            1.0
        )[0]
        for _ in range(2)
    ]
    tokens = MediaTokens(
        video_token_id=processor.video_token_id, image_token_id=processor.image_token_id, spatial_merge_size=2
    )
    alone = collate(samples[:1], pad_token_id=0, media_tokens=tokens)
    assert alone.media["video_grid_thw"].shape == (2, 3)
    pair = collate(samples, pad_token_id=0, media_tokens=tokens)
    assert pair.media["video_grid_thw"].shape == (4, 3) and pair.media["second_per_grid_ts"].shape == (4,)
    assert pair.media["pixel_values_videos"].shape[0] == 2 * alone.media["pixel_values_videos"].shape[0]

    clip = samples[0].media[0]
    ids = torch.tensor([1] + [processor.video_token_id] * clip.num_placeholders + [2])
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[-1] = True
    single = collate(
        [PolicySample(input_ids=ids, target_mask=mask, media=(clip,))], pad_token_id=0, media_tokens=tokens
    )
    assert single.media["pixel_values_videos"] is clip.tensors["pixel_values_videos"], "passed by reference"
    broken = PolicySample(input_ids=samples[0].input_ids, target_mask=samples[0].target_mask, media=(clip,))
    with pytest.raises(ValueError, match="video placeholder tokens .* but its media need"):
        collate([broken], pad_token_id=0, media_tokens=tokens)


def test_a_bounded_store_drops_the_least_recently_used_and_reprocesses_on_return(
    processor: QwenVLProcessor, media: dict[str, Path]
) -> None:
    root = media["prompt"].parent
    unbounded = MediaStore(processor, MediaSettings(media_root=root), decode_cache=DecodeCache())

    def part(path: Path):
        return parse_trajectory([_call([1], [2])], prompt=[_user([_video(path)])]).media[0]

    sizes = {name: unbounded.get(part(path)).nbytes for name, path in media.items()}
    # Room for the two largest clips together, not for all three.
    bound = sum(sizes.values()) - min(sizes.values()) // 2
    store = MediaStore(processor, MediaSettings(media_root=root), decode_cache=DecodeCache(), max_bytes=bound)
    first = store.get(part(media["prompt"]))
    store.get(part(media["left"]))
    assert store.get(part(media["prompt"])) is first  # a hit makes "prompt" the most recent
    store.get(part(media["right"]))  # over the bound: "left", the least recently used, goes
    stats = store.stats()
    assert stats.evicted == 1 and stats.processed == 3 and stats.unique_bytes <= bound
    assert stats.unique_bytes == sizes["prompt"] + sizes["right"]
    assert store.get(part(media["prompt"])) is first  # still held
    again = store.get(part(media["left"]))  # dropped: processed again, same tensors
    assert store.stats().processed == 4 and store.stats().unique_bytes <= bound
    assert torch.equal(
        again.tensors["pixel_values_videos"],
        unbounded.get(part(media["left"])).tensors["pixel_values_videos"],
    )
    # One entry larger than the bound stays (the newest always does) and evicts the rest.
    tiny = MediaStore(processor, MediaSettings(media_root=root), decode_cache=DecodeCache(), max_bytes=1)
    tiny.get(part(media["left"]))
    tiny.get(part(media["right"]))
    assert tiny.stats().evicted == 1 and tiny.stats().unique_bytes == sizes["right"]
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        MediaStore(processor, MediaSettings(media_root=root), max_bytes=0)
