"""The trainer's replay of vLLM's structured outputs: grammar masks, their packing, and logprobs
under them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_bridge.megatron.batch import MediaTokens, PolicySample, collate
from rl_bridge.megatron.logprobs import token_logprobs
from rl_bridge.structured_outputs import (
    ConstraintError,
    GrammarMasks,
    canonical_action_tokens,
    choice_grammar,
    choice_request_body,
    unpack_bitmask,
)
from rl_bridge.tasks import hermes_tool_call

pytestmark = pytest.mark.unit

CHOICES = ["A", "B", "C", *(hermes_tool_call("watch_segment", {"segment": k}) for k in (1, 2))]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2.5-VL tokenizer with the files vLLM reads its vocabulary and stop tokens from."""
    from video_grpo_demo.tiny_models.qwen import Qwen25VLSpec

    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer = Qwen25VLSpec()._tokenizer()
    tokenizer.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({"text_config": {"vocab_size": len(tokenizer)}}))
    eos = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory


def _allowed(masks: torch.Tensor, vocab_size: int) -> list[set[int]]:
    return [set(row.nonzero().flatten().tolist()) for row in unpack_bitmask(masks, vocab_size)]


def test_a_tool_call_is_decoded_under_the_masks_of_the_choice(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    grammar = GrammarMasks(tokenizer_dir, CHOICES)
    ids = tokenizer.encode(CHOICES[4], add_special_tokens=False) + [tokenizer.eos_token_id]
    allowed = _allowed(grammar.bitmasks(ids), grammar.vocab_size)

    letters = {tokenizer.convert_tokens_to_ids(letter) for letter in "ABC"}
    call_start = tokenizer.convert_tokens_to_ids("<tool_call>")
    # First token: a letter, the tool-call marker, or "<" (the marker spelled out byte by byte).
    assert allowed[0] == letters | {call_start, tokenizer.convert_tokens_to_ids("<")}
    assert all(token in row for token, row in zip(ids, allowed, strict=True))
    # Once the call is complete only the stop tokens vLLM adds are allowed.
    assert allowed[-1] == {tokenizer.eos_token_id, tokenizer.pad_token_id}
    # The segment number is a choice among the segments in range.
    digit = next(i for i, token in enumerate(ids) if tokenizer.decode([token]).strip() == "2")
    assert {tokenizer.decode([t]).strip() for t in allowed[digit]} >= {"1", "2"}
    assert "3" not in {tokenizer.decode([t]).strip() for t in allowed[digit]}


def test_a_letter_then_the_end_token_and_nothing_is_constrained_after(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    grammar = GrammarMasks(tokenizer_dir, CHOICES)
    ids = [tokenizer.convert_tokens_to_ids("B"), tokenizer.eos_token_id, tokenizer.pad_token_id]
    masks = grammar.bitmasks(ids)
    assert masks.shape == (3, grammar.words) and masks.dtype == torch.int32
    allowed = _allowed(masks, grammar.vocab_size)
    assert allowed[1] == {tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert allowed[2] == set(range(grammar.vocab_size))  # after termination vLLM masks nothing


def test_a_token_the_grammar_forbids_is_a_constraint_error(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    grammar = GrammarMasks(tokenizer_dir, CHOICES)
    with pytest.raises(ConstraintError, match="position 0"):
        grammar.bitmasks([tokenizer.convert_tokens_to_ids("D")])
    assert choice_request_body(CHOICES) == {"structured_outputs": {"grammar": choice_grammar(CHOICES)}}


def test_the_choice_grammar_is_vllms_own_where_vllm_escapes_choices() -> None:
    """The grammar sent is what vLLM 0.31 and later build for the same ``choice``; older releases
    built one with the tool calls' raw newlines inside its string literals, which xgrammar refuses
    (the reason the loop sends the grammar)."""
    import xgrammar as xgr
    from vllm.v1.structured_output.utils import choice_as_grammar

    from vllm_video_plugin import compat

    grammar = choice_grammar(CHOICES)
    assert "\n" not in grammar and "\\n" in grammar  # every newline escaped
    assert grammar.count(" | ") == len(CHOICES) - 1
    assert choice_grammar(['a"b\\c\tq\x01']) == 'root ::= "a\\"b\\\\c\\tq\\u0001"'
    xgr.Grammar.from_ebnf(grammar)  # compiles
    if compat.choice_escapes_control_characters():
        assert choice_as_grammar(CHOICES) == grammar
    else:
        with pytest.raises(RuntimeError):
            xgr.Grammar.from_ebnf(choice_as_grammar(CHOICES))


def test_canonical_action_tokens_leave_one_spelling_per_action_under_the_grammar(tokenizer_dir: Path) -> None:
    """Grammar masks intersected with the canonical set allow one token at every position of an
    action but its decisions: the first token (which action) and the segment number."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    support = set(canonical_action_tokens(tokenizer_dir, CHOICES))
    grammar = GrammarMasks(tokenizer_dir, CHOICES)
    call = tokenizer.encode(CHOICES[4], add_special_tokens=False)
    assert len(call) <= 21  # the tokenizer's merges cover the call's JSON pieces
    allowed = [
        row & support
        for row in _allowed(grammar.bitmasks([*call, tokenizer.eos_token_id]), grammar.vocab_size)
    ]
    decisions = [i for i, row in enumerate(allowed) if len(row) > 1]
    letters = {tokenizer.convert_tokens_to_ids(letter) for letter in "ABC"}
    assert allowed[0] == letters | {tokenizer.convert_tokens_to_ids("<tool_call>")}
    digit = next(i for i, token in enumerate(call) if tokenizer.decode([token]).strip() == "2")
    assert {tokenizer.decode([t]).strip() for t in allowed[digit]} == {"1", "2"}
    assert decisions == [0, digit]
    assert allowed[-1] == {tokenizer.eos_token_id}  # one end token: the end is spelled one way
    # The spelling left is the one the chat template writes when it re-renders the call.
    rendered = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "watch_segment", "arguments": {"segment": 2}}}
                ],
            },
        ],
        tokenize=True,
        return_dict=False,
    )
    assert _contains(list(rendered), call)


def _contains(sequence: list[int], part: list[int]) -> bool:
    return any(sequence[i : i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


def test_canonical_action_tokens_refuse_a_vocabulary_that_leaves_two_spellings(tokenizer_dir: Path) -> None:
    # "segment" is one merged token; its letters, as actions of their own, spell it again.
    with pytest.raises(ValueError, match=r"'segment' has 2 spellings over the tokens"):
        canonical_action_tokens(tokenizer_dir, ["segment", "s", "e", "g", "m", "n", "t"])
    with pytest.raises(ValueError, match="must not be empty"):
        canonical_action_tokens(tokenizer_dir, [])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 5), vocab=st.integers(1, 100))
def test_unpacking_inverts_xgrammar_s_packing(seed: int, rows: int, vocab: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, vocab, generator=generator) < 0.5
    words = (vocab + 31) // 32
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = mask.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement
    assert torch.equal(unpack_bitmask(packed, vocab), mask)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 7),
    temperature=st.floats(0.2, 2.0),
    chunk=st.integers(1, 64),
)
def test_logprobs_under_per_row_masks_equal_the_masked_softmax(
    seed: int, rows: int, temperature: float, chunk: int
) -> None:
    """What vLLM reports under a grammar with ``processed_logprobs``: the log-softmax of the masked,
    temperature-scaled logits, row by row, with zero gradient at the masked columns."""
    vocab, padded = 11, 12
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, padded, generator=generator) * 3
    allowed = torch.rand(rows, vocab, generator=generator) < 0.4
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    allowed[torch.arange(rows), targets] = True
    upstream = torch.randn(rows, generator=generator)
    fast_in = logits.clone().requires_grad_()
    values = token_logprobs(
        fast_in, targets, vocab_size=vocab, temperature=temperature, allowed=allowed, max_chunk_elements=chunk
    )
    (values * upstream).sum().backward()
    naive_in = logits.clone().requires_grad_()
    keep = torch.zeros(rows, padded, dtype=torch.bool)
    keep[:, :vocab] = allowed
    masked = naive_in.masked_fill(~keep, float("-inf"))
    reference = torch.log_softmax(masked / temperature, dim=-1).gather(-1, targets[:, None])[:, 0]
    (reference * upstream).sum().backward()
    torch.testing.assert_close(values, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_in.grad, naive_in.grad, rtol=1e-5, atol=1e-5)
    assert torch.all(fast_in.grad[~keep] == 0)


def test_masks_combine_with_a_support_and_refuse_a_target_they_forbid() -> None:
    logits = torch.randn(2, 6)
    allowed = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    support = torch.tensor([1, 3, 4])
    values = token_logprobs(logits, torch.tensor([1, 4]), vocab_size=6, support=support, allowed=allowed)
    row0 = torch.log_softmax(logits[0, [1, 3]], -1)[0]
    row1 = torch.log_softmax(logits[1, [1, 3, 4]], -1)[2]
    torch.testing.assert_close(values, torch.stack([row0, row1]))
    with pytest.raises(ValueError, match="not allowed in its row"):
        token_logprobs(logits, torch.tensor([2, 1]), vocab_size=6, allowed=allowed)
    with pytest.raises(ValueError, match="allowed must be a bool"):
        token_logprobs(logits, torch.tensor([1, 1]), vocab_size=6, allowed=allowed[:, :5])


def test_collate_lays_the_masks_out_in_target_order_and_fills_samples_without() -> None:
    tokens = MediaTokens(video_token_id=90, image_token_id=91, spatial_merge_size=2)

    def sample(length: int, targets: list[int], allowed: torch.Tensor | None) -> PolicySample:
        mask = torch.zeros(length, dtype=torch.bool)
        mask[targets] = True
        return PolicySample(input_ids=torch.arange(length), target_mask=mask, allowed_tokens=allowed)

    first = torch.tensor([[5], [6]], dtype=torch.int32)
    third = torch.tensor([[7]], dtype=torch.int32)
    batch = collate(
        [sample(4, [2, 3], first), sample(5, [4], None), sample(3, [1], third)],
        pad_token_id=0,
        media_tokens=tokens,
    )
    assert batch.allowed_tokens is not None
    assert batch.allowed_tokens.flatten().tolist() == [5, 6, -1, 7]
    assert batch.allowed_tokens.size(0) == batch.num_target_tokens
    with pytest.raises(ValueError, match="allowed_tokens must be int32"):
        sample(4, [2, 3], third)
