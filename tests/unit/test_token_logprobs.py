"""token_logprobs without tensor parallelism: against the naive log-softmax, over the vocabulary or a support,
and its entropy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_bridge.megatron.logprobs import token_logprobs

pytestmark = pytest.mark.unit


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 7),
    temperature=st.floats(0.2, 2.0),
    support_size=st.integers(1, 6),
    chunk=st.integers(1, 64),
)
def test_support_restricted_logprobs_equal_the_softmax_over_the_support(
    seed: int, rows: int, temperature: float, support_size: int, chunk: int
) -> None:
    """What vLLM reports with ``allowed_token_ids`` and ``processed_logprobs``: the log-softmax of
    the temperature-scaled logits over the allowed tokens, with zero gradient elsewhere."""
    vocab, padded = 11, 12
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, padded, generator=generator) * 3
    support = torch.randperm(vocab, generator=generator)[:support_size]
    targets = support[torch.randint(0, support_size, (rows,), generator=generator)]
    upstream = torch.randn(rows, generator=generator)
    fast_in = logits.clone().requires_grad_()
    values = token_logprobs(
        fast_in, targets, vocab_size=vocab, temperature=temperature, support=support, max_chunk_elements=chunk
    )
    (values * upstream).sum().backward()
    naive_in = logits.clone().requires_grad_()
    masked = torch.full_like(naive_in, float("-inf"))
    masked[:, support] = naive_in[:, support]
    reference = torch.log_softmax(masked / temperature, dim=-1).gather(-1, targets[:, None])[:, 0]
    (reference * upstream).sum().backward()
    torch.testing.assert_close(values, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_in.grad, naive_in.grad, rtol=1e-5, atol=1e-5)
    outside = torch.ones(padded, dtype=torch.bool)
    outside[support] = False
    assert torch.all(fast_in.grad[:, outside] == 0)


def test_a_target_outside_the_support_is_refused() -> None:
    with pytest.raises(ValueError, match="outside the support"):
        token_logprobs(torch.zeros(2, 5), torch.tensor([1, 3]), vocab_size=5, support=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="support must be"):
        token_logprobs(torch.zeros(1, 5), torch.tensor([1]), vocab_size=5, support=torch.tensor([1, 7]))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 7),
    temperature=st.floats(0.2, 2.0),
    support_size=st.integers(1, 11),
    chunk=st.integers(1, 64),
    masked_rows=st.booleans(),
)
def test_entropy_equals_the_naive_entropy_of_the_sampling_distribution(
    seed: int, rows: int, temperature: float, support_size: int, chunk: int, masked_rows: bool
) -> None:
    """``return_entropy``: the entropy (and its gradient) of the distribution the logprobs are of,
    under a support and per-row grammar masks; a row with one allowed token has entropy 0."""
    vocab, padded = 11, 12
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, padded, generator=generator) * 3
    support = torch.randperm(vocab, generator=generator)[:support_size]
    targets = support[torch.randint(0, support_size, (rows,), generator=generator)]
    allowed = None
    if masked_rows:
        allowed = torch.rand(rows, vocab, generator=generator) < 0.5
        allowed[torch.arange(rows), targets] = True
    upstream = torch.randn(rows, generator=generator)
    fast_in = logits.clone().requires_grad_()
    values, entropy = token_logprobs(
        fast_in,
        targets,
        vocab_size=vocab,
        temperature=temperature,
        support=support,
        allowed=allowed,
        max_chunk_elements=chunk,
        return_entropy=True,
    )
    (entropy * upstream).sum().backward()
    naive_in = logits.clone().requires_grad_()
    keep = torch.zeros(rows, padded, dtype=torch.bool)
    keep[:, support] = True
    if allowed is not None:
        keep[:, :vocab] &= allowed
    # Excluded columns at -1e4: their probability underflows to exactly 0, with no inf arithmetic.
    log_p = torch.log_softmax(torch.where(keep, naive_in, -1e4) / temperature, dim=-1)
    naive = -(log_p.exp() * log_p).sum(dim=-1)
    (naive * upstream).sum().backward()
    torch.testing.assert_close(
        values, log_p.gather(-1, targets[:, None])[:, 0].detach(), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(entropy, naive, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_in.grad, naive_in.grad, rtol=1e-5, atol=1e-5)
    single = keep.sum(dim=-1) == 1
    assert torch.all(entropy[single] == 0)


# Formerly rl_bridge.grpo.selective_log_softmax's tests: the same oracle and refusals, through
# token_logprobs (which replaced it) on the positions flattened to rows.


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 9)),
    vocab=st.integers(2, 50),
    temperature=st.floats(0.1, 3.0),
    chunk_tokens=st.integers(1, 8),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_token_logprobs_equal_the_naive_oracle(
    seed: int, shape: tuple[int, int], vocab: int, temperature: float, chunk_tokens: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen) * 5).to(dtype).requires_grad_()
    ids = torch.randint(vocab, shape, generator=gen)
    fast = token_logprobs(
        logits.reshape(-1, vocab),
        ids.reshape(-1),
        vocab_size=vocab,
        temperature=temperature,
        max_chunk_elements=chunk_tokens * vocab,
    ).reshape(ids.shape)
    naive = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert fast.dtype == torch.float32 and fast.shape == ids.shape
    torch.testing.assert_close(fast, naive, rtol=1e-5, atol=1e-5)
    # gradients land in the logits' dtype, where bf16 rounding of two different fp32 paths may
    # differ by an ulp or two
    (fast_grad,) = torch.autograd.grad(fast.sum(), logits)
    (naive_grad,) = torch.autograd.grad(naive.sum(), logits)
    tolerance = (
        {"rtol": 1e-5, "atol": 1e-5 / temperature}
        if dtype == torch.float32
        else {"rtol": 2e-2, "atol": 1e-3 / temperature}
    )
    torch.testing.assert_close(fast_grad.float(), naive_grad.float(), **tolerance)


def test_token_logprobs_rejects_bad_inputs_and_handles_empty() -> None:
    logits = torch.zeros(6, 5)
    with pytest.raises(ValueError, match="leading shape"):
        token_logprobs(logits, torch.zeros(8, dtype=torch.long), vocab_size=5)
    with pytest.raises(ValueError, match="integer"):
        token_logprobs(logits, torch.zeros(6), vocab_size=5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits, torch.zeros(6, dtype=torch.long), vocab_size=5, temperature=0.0)
    empty = token_logprobs(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), vocab_size=5)
    assert empty.shape == (0,)
