"""The supervised warm start's pieces: its loss, its demonstrations and its recipe checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rl_bridge.loop.warm_start import (
    SupervisedLoss,
    demonstration_samples,
    first_turn_messages,
    warm_start_batches,
)
from rl_bridge.megatron.batch import MediaTokens, collate
from rl_bridge.megatron.policy_loss import StepCounts
from rl_bridge.recipe import load_recipe
from rl_bridge.tasks import action_choices, demonstration, hermes_tool_call
from video_grpo_demo.rows import video_segment_question_rows
from video_grpo_demo.synthetic.tasks import ClipConfig

pytestmark = pytest.mark.unit

NO_MEDIA = MediaTokens(video_token_id=-1, image_token_id=-2, spatial_merge_size=2)


def _batch(lengths: list[int], targets: list[int], weights: list[float]):
    from rl_bridge.megatron.batch import PolicySample

    samples = []
    for length, target, weight in zip(lengths, targets, weights, strict=True):
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length - target :] = True
        samples.append(PolicySample(torch.arange(length) % 7, mask, loss_weight=weight))
    return samples


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(3, 9), st.integers(1, 2), st.sampled_from([0.0, 1.0, 0.5])),
        min_size=2,
        max_size=6,
    ),
    st.integers(1, 3),
)
def test_supervised_loss_is_token_mean_nll_whatever_the_split(shape, parts) -> None:
    lengths, targets, weights = (list(column) for column in zip(*shape, strict=True))
    if not any(weights):
        weights[0] = 1.0
    samples = _batch(lengths, targets, weights)
    torch.manual_seed(0)
    logprobs = [-torch.rand(length, dtype=torch.float64) for length in lengths]
    loss = SupervisedLoss()
    # By hand: every weighted target token's NLL, times its weight, over the weighted targets.
    numerator = sum(
        -w * float(lp[s.target_mask].sum()) for s, lp, w in zip(samples, logprobs, weights, strict=True)
    )
    tokens = sum(int(s.target_mask.sum()) for s, w in zip(samples, weights, strict=True) if w > 0)
    expected = numerator / tokens

    chunks = [list(range(len(samples)))[i::parts] for i in range(parts)]
    chunks = [c for c in chunks if c]
    batches = [collate([samples[i] for i in c], pad_token_id=0, media_tokens=NO_MEDIA) for c in chunks]
    normalizer = sum(loss.denominator(b) for b in batches)
    assert normalizer == tokens
    counts = StepCounts(num_target_tokens=tokens, num_target_sequences=len(samples), normalizer=normalizer)
    total = 0.0
    for chunk, batch in zip(chunks, batches, strict=True):
        padded = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
        for row, i in enumerate(chunk):
            padded[row, : lengths[i]] = logprobs[i]
        padded = padded * batch.target_mask
        part, metrics = loss(padded, batch.target_mask, batch, counts)
        total += float(part)
        trained = any(weights[i] > 0 for i in chunk)
        assert (
            (0.0 < float(metrics["target_prob"]) <= 1.0) if trained else float(metrics["target_prob"]) == 0.0
        )
    assert total == pytest.approx(expected, rel=1e-9)


def test_supervised_loss_gradient_raises_the_targets() -> None:
    samples = _batch([5, 6], [2, 1], [1.0, 1.0])
    batch = collate(samples, pad_token_id=0, media_tokens=NO_MEDIA)
    logits = torch.zeros(*batch.input_ids.shape, 7, requires_grad=True)
    logprobs = (
        torch.log_softmax(logits, -1).gather(-1, batch.input_ids.unsqueeze(-1)).squeeze(-1)
        * batch.target_mask
    )
    loss = SupervisedLoss()
    counts = StepCounts(num_target_tokens=3, num_target_sequences=2, normalizer=loss.denominator(batch))
    part, _ = loss(logprobs, batch.target_mask, batch, counts)
    part.backward()
    grad = logits.grad
    targets = batch.target_mask.nonzero().tolist()
    for row, col in targets:  # descending the loss raises each target's logit
        assert grad[row, col, batch.input_ids[row, col]] < 0
    untrained = ~batch.target_mask
    assert torch.all(grad[untrained] == 0)


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("segments")
    config = ClipConfig(width=56, height=56, num_frames=8, fps=4.0)
    return video_segment_question_rows(
        root, 6, seed=3, num_segments=3, num_options=6, config=config, subdir="t"
    )


def test_demonstration_is_the_named_segments_call_as_the_grammar_writes_it(rows: list[dict]) -> None:
    task = load_recipe(Path("recipes/tiny_cpu_agentic.yaml")).task
    for row in rows:
        action = demonstration(task, row)
        assert action == hermes_tool_call("watch_segment", {"segment": row["named_segment"]})
        assert action in action_choices(task, calls_only=True)
    with pytest.raises(ValueError, match="names no segment"):
        demonstration(task, {"task_id": "mcqa-1"})


def test_demonstration_samples_train_the_action_and_end_token_only(
    rows: list[dict], tiny_qwen25vl: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen25vl)
    task = load_recipe(Path("recipes/tiny_cpu_agentic.yaml")).task
    actions = [demonstration(task, row) for row in rows]
    samples = demonstration_samples(tokenizer, rows, actions)
    for sample, row, action in zip(samples, rows, actions, strict=True):
        targets = sample.input_ids[sample.target_mask].tolist()
        assert targets == [*tokenizer.encode(action, add_special_tokens=False), tokenizer.eos_token_id]
        prompt = tokenizer.decode(sample.input_ids[~sample.target_mask])
        assert f"Which colour fills segment {row['named_segment']}?" in prompt
        assert "<tools>\nwatch_segment\n</tools>" in prompt  # the tool is in the rendered prompt
        assert prompt.endswith("<|im_start|>assistant\n")
        assert not sample.target_mask[: (~sample.target_mask).sum()].any()  # targets come last


def test_a_prompt_with_video_has_no_demonstration(rows: list[dict]) -> None:
    row = {**rows[0]}
    params = row["responses_create_params"]
    row["responses_create_params"] = {
        **params,
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_video", "video_url": "t/x.mp4"}, *params["input"][0]["content"]],
            }
        ],
    }
    with pytest.raises(ValueError, match="text only.*input_video"):
        first_turn_messages(row)
    messages, tools = first_turn_messages(rows[0])
    assert [m["role"] for m in messages] == ["user"] and tools[0]["function"]["name"] == "watch_segment"


def test_warm_start_batches_are_seeded_passes_over_the_rows() -> None:
    rows = [{"i": i} for i in range(10)]
    batches = warm_start_batches(rows, steps=5, per_step=4, seed=1)
    assert [len(b) for b in batches] == [4] * 5
    flat = [r["i"] for b in batches for r in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert batches == warm_start_batches(rows, steps=5, per_step=4, seed=1)
    assert batches != warm_start_batches(rows, steps=5, per_step=4, seed=2)


def test_warm_start_needs_an_environment_with_demonstrations() -> None:
    with pytest.raises(ValidationError, match="warm_start.steps=5: only task.environment='agentic'"):
        load_recipe(None, ["warm_start.steps=5"])
    recipe = load_recipe(Path("recipes/tiny_cpu_agentic.yaml"), ["warm_start.steps=5"])
    assert recipe.warm_start.steps == 5


def test_demonstrations_carry_the_first_turn_grammar_s_masks(rows: list[dict], tiny_qwen25vl: Path) -> None:
    from transformers import AutoTokenizer

    from rl_bridge.structured_outputs import GrammarMasks, unpack_bitmask

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen25vl)
    task = load_recipe(Path("recipes/tiny_cpu_agentic.yaml")).task
    grammar = GrammarMasks(tiny_qwen25vl, action_choices(task, calls_only=True))
    actions = [demonstration(task, row) for row in rows]
    for sample in demonstration_samples(tokenizer, rows, actions, grammar):
        targets = sample.input_ids[sample.target_mask]
        assert sample.allowed_tokens is not None and sample.allowed_tokens.shape == (
            len(targets),
            grammar.words,
        )
        allowed = unpack_bitmask(sample.allowed_tokens, len(tokenizer))
        assert all(bool(allowed[i, token]) for i, token in enumerate(targets.tolist()))
        # The segment number is a choice among the three calls; the tokens before it are forced.
        assert int(allowed.sum(-1).max()) > 1
