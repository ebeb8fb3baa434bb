"""Per-token log-probabilities from (vocabulary-parallel) logits, without a full-vocabulary log-softmax.

A policy-gradient step needs ``log p(token)`` at the generated positions only, yet the usual
``log_softmax(logits.float()).gather(...)`` materialises an fp32 ``[tokens, vocab]`` tensor for every
position, and autograd keeps it for the backward pass (for a 151,936-token vocabulary that is
0.6 MB per position). :func:`token_logprobs` instead:

* works on the rows (positions) it is asked for only;
* computes ``logit[target] - logsumexp(logits)`` in fp32 one chunk of rows at a time, so at most one
  chunk is ever held in fp32;
* saves the logits in their own dtype plus one fp32 log-normaliser per row for backward, and
  recomputes the softmax chunk by chunk there (gradient ``(onehot - softmax) * grad / T``);
* under tensor parallelism takes logits sharded over the vocabulary (megatron-core's
  ``parallel_output=True``): the row maximum, the sum of exponentials and the target logit are
  all-reduced over the tensor-parallel group, as in megatron-core's
  ``vocab_parallel_cross_entropy``; the backward pass needs no communication.

Vocabulary padding (megatron-core pads the output layer to a multiple of
``make_vocab_size_divisible_by * TP``) is excluded: columns at or beyond the real vocabulary size
take no part in the normaliser and receive zero gradient.

A ``support`` (the token ids sampling was restricted to, e.g. vLLM's ``allowed_token_ids``) makes
the distribution the softmax over those columns only: the policy that actually sampled the tokens,
whose logprobs vLLM reports with ``--logprobs-mode processed_logprobs``. An ``allowed`` mask does
the same per row: the tokens a structured-outputs grammar allowed at that position
(:mod:`rl_bridge.structured_outputs`), which vLLM applies to the logits before it samples.

With ``return_entropy`` it also returns each row's entropy over the same distribution (for the
loss's optional entropy bonus and the ``loss/entropy`` metric), computed in the same chunks with
three more all-reduced row values and differentiable the same way (recomputed in backward, no
communication there).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "token_logprobs"]

DEFAULT_CHUNK_ELEMENTS = 1 << 24
"""Logit elements converted to fp32 at a time (64 MiB of fp32)."""


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


class _TokenLogprobs(torch.autograd.Function):
    """``log_softmax(logits / T)[target]`` per row; see :func:`token_logprobs`."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        local_targets: torch.Tensor,
        in_shard: torch.Tensor,
        inv_temperature: float,
        group: dist.ProcessGroup | None,
        chunk_rows: int,
    ) -> torch.Tensor:
        rows = logits.size(0)
        logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
        log_normalizers = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            scaled = logits[start:end].float() * inv_temperature
            row_max = scaled.max(dim=-1).values
            _all_reduce(row_max, dist.ReduceOp.MAX, group)
            sum_exp = (scaled - row_max.unsqueeze(-1)).exp_().sum(dim=-1)
            _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
            target_logit = scaled.gather(-1, local_targets[start:end].unsqueeze(-1)).squeeze(-1)
            target_logit = torch.where(in_shard[start:end], target_logit, 0.0)
            _all_reduce(target_logit, dist.ReduceOp.SUM, group)
            log_normalizers[start:end] = row_max + sum_exp.log()
            logprobs[start:end] = target_logit - log_normalizers[start:end]
        ctx.save_for_backward(logits, local_targets, in_shard, log_normalizers)
        ctx.inv_temperature = inv_temperature
        ctx.chunk_rows = chunk_rows
        return logprobs

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        logits, local_targets, in_shard, log_normalizers = ctx.saved_tensors
        inv_temperature, chunk_rows = ctx.inv_temperature, ctx.chunk_rows
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for start in range(0, logits.size(0), chunk_rows):
            end = min(start + chunk_rows, logits.size(0))
            grad = grad_logprobs[start:end].float()
            scaled = logits[start:end].float() * inv_temperature
            # d logprob / d logit_j = (onehot_j - softmax_j) / T
            chunk_grad = (scaled - log_normalizers[start:end].unsqueeze(-1)).exp_().mul_(-grad.unsqueeze(-1))
            chunk_grad.scatter_add_(
                -1, local_targets[start:end].unsqueeze(-1), (grad * in_shard[start:end]).unsqueeze(-1)
            )
            grad_logits[start:end] = chunk_grad.mul_(inv_temperature)
        return grad_logits, None, None, None, None, None


class _TokenEntropy(torch.autograd.Function):
    """``H(softmax(logits / T))`` per row, over the columns given (``-inf`` columns excluded)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        inv_temperature: float,
        group: dist.ProcessGroup | None,
        chunk_rows: int,
    ) -> torch.Tensor:
        rows = logits.size(0)
        entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
        log_normalizers = torch.empty(rows, dtype=torch.float32, device=logits.device)
        expected = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            scaled = logits[start:end].float() * inv_temperature
            row_max = scaled.max(dim=-1).values
            _all_reduce(row_max, dist.ReduceOp.MAX, group)
            weights = (scaled - row_max.unsqueeze(-1)).exp_()
            sums = torch.stack(  # sum of exp, sum of exp * logit (excluded columns: exp 0, no -inf * 0)
                [weights.sum(dim=-1), torch.where(weights > 0, weights * scaled, 0.0).sum(dim=-1)]
            )
            _all_reduce(sums, dist.ReduceOp.SUM, group)
            log_normalizers[start:end] = row_max + sums[0].log()
            expected[start:end] = sums[1] / sums[0]  # E_p[logit / T]
            # H = log Z - E_p[logit / T]
            entropy[start:end] = log_normalizers[start:end] - expected[start:end]
        ctx.save_for_backward(logits, log_normalizers, expected)
        ctx.inv_temperature = inv_temperature
        ctx.chunk_rows = chunk_rows
        return entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        logits, log_normalizers, expected = ctx.saved_tensors
        inv_temperature, chunk_rows = ctx.inv_temperature, ctx.chunk_rows
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for start in range(0, logits.size(0), chunk_rows):
            end = min(start + chunk_rows, logits.size(0))
            scaled = logits[start:end].float() * inv_temperature
            probs = (scaled - log_normalizers[start:end].unsqueeze(-1)).exp_()
            # d H / d s_j = p_j (E_p[s] - s_j), with s = logit / T
            shift = torch.where(probs > 0, expected[start:end].unsqueeze(-1) - scaled, 0.0)
            chunk_grad = probs.mul_(shift).mul_(grad_entropy[start:end].float().unsqueeze(-1))
            grad_logits[start:end] = chunk_grad.mul_(inv_temperature)
        return grad_logits, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    support: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    max_chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits / temperature)[target]`` for each row, over the real vocabulary
    (or over ``support``).

    Args:
        logits: ``[rows, local_vocab]``, any float dtype, any strides. Without tensor parallelism
            ``local_vocab`` is the (padded) vocabulary; with it, this rank's contiguous shard
            ``[rank * local_vocab, (rank + 1) * local_vocab)`` of the padded vocabulary.
        targets: ``[rows]`` integer token ids in ``[0, vocab_size)`` (global ids).
        vocab_size: real vocabulary size; padded columns beyond it are ignored.
        temperature: the sampling temperature the logits are divided by (> 0). vLLM's
            ``--logprobs-mode raw_logprobs`` (its default) reports logprobs of the unscaled
            logits, ``processed_logprobs`` after temperature (and after top-k/top-p and penalties,
            which this function does not apply): pass the sampling temperature with
            ``processed_logprobs`` and 1.0 with ``raw_logprobs``, so the trainer's logprobs are
            comparable with vLLM's. The GRPO loss's importance weights and mismatch metrics
            assume vLLM's logprobs are those of the distribution the tokens were sampled from, so
            sampling at a temperature other than 1 calls for ``processed_logprobs`` (without
            top-k/top-p) and the same temperature here.
        tp_group: the tensor-parallel group the vocabulary is sharded over; ``None`` (or a group
            of size 1) means ``logits`` hold the whole vocabulary.
        support: ``[K]`` distinct global token ids the softmax runs over (every other column takes
            no part and gets zero gradient); ``None``: the whole real vocabulary.
        allowed: ``[rows, vocab_size]`` bool: per row, the global token ids the softmax runs over
            (on top of ``support``); ``None``: no per-row restriction.
        max_chunk_elements: at most this many logits are held in fp32 at a time.
        return_entropy: also return each row's entropy (nats) of the same distribution.

    Returns:
        ``[rows]`` fp32 log-probabilities, identical on every rank of ``tp_group``. Differentiable
        with respect to ``logits`` (the gradient has ``logits``' dtype). With ``return_entropy``,
        ``(logprobs, entropy)``, both ``[rows]`` and differentiable.

    Raises:
        ValueError: mismatched shapes, non-integer targets, a non-positive temperature, a target outside the
            vocabulary, outside ``support`` or not ``allowed`` in its row, or a shard layout that
            does not cover ``vocab_size``.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"token_logprobs: logits must be [rows, vocab] and targets [rows] (the leading shape of "
            f"logits), got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"token_logprobs: targets must be an integer tensor, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    if targets.numel() and not (0 <= int(targets.min()) and int(targets.max()) < vocab_size):
        raise ValueError(
            f"token_logprobs: target ids span [{int(targets.min())}, {int(targets.max())}], "
            f"outside the vocabulary [0, {vocab_size})"
        )
    local_vocab = logits.size(-1)
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    if local_vocab * tp_size < vocab_size:
        raise ValueError(
            f"token_logprobs: {tp_size} shard(s) of {local_vocab} columns cannot hold "
            f"a vocabulary of {vocab_size}"
        )
    vocab_start = tp_rank * local_vocab
    # Padding sits at the end of the padded vocabulary, so this shard's real columns are a prefix.
    real_columns = max(0, min(local_vocab, vocab_size - vocab_start))
    if real_columns == 0:
        raise ValueError(
            f"token_logprobs: tensor-parallel rank {tp_rank} holds only vocabulary padding "
            f"(columns from {vocab_start}, vocabulary {vocab_size})"
        )
    if allowed is not None:
        if allowed.dtype != torch.bool or allowed.shape != (logits.size(0), vocab_size):
            raise ValueError(
                f"token_logprobs: allowed must be a bool [{logits.size(0)}, {vocab_size}] tensor, "
                f"got {allowed.dtype} {tuple(allowed.shape)}"
            )
        allowed = allowed.to(logits.device)
        rows = torch.arange(logits.size(0), device=logits.device)
        if targets.numel() and not bool(allowed[rows, targets.long().to(logits.device)].all()):
            raise ValueError("token_logprobs: a target id is not allowed in its row")
        local_allowed = allowed[:, vocab_start : vocab_start + real_columns]
    local_targets = targets.long() - vocab_start
    in_shard = (local_targets >= 0) & (local_targets < real_columns)
    local_targets = torch.where(in_shard, local_targets, 0)
    columns = logits[:, :real_columns]
    if support is not None:
        ids = torch.unique(support.to(device=logits.device, dtype=torch.long))  # sorted
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"token_logprobs: support must be non-empty ids in [0, {vocab_size})")
        if targets.numel() and not bool(torch.isin(targets.long().to(ids.device), ids).all()):
            raise ValueError("token_logprobs: a target id lies outside the support it was sampled from")
        local_ids = ids[(ids >= vocab_start) & (ids < vocab_start + real_columns)] - vocab_start
        if local_ids.numel():
            position = torch.searchsorted(local_ids, local_targets).clamp(max=local_ids.numel() - 1)
            in_shard = in_shard & (local_ids[position] == local_targets)
            local_targets = torch.where(in_shard, position, 0)
            columns = columns.index_select(1, local_ids)
            if allowed is not None:
                local_allowed = local_allowed.index_select(1, local_ids)
        else:  # this rank holds none of the support: one column that adds nothing
            in_shard = torch.zeros_like(in_shard)
            local_targets = torch.zeros_like(local_targets)
            columns = logits[:, :1] * 0.0 - float("inf")  # connected to the graph, zero gradient
            allowed = None  # nothing left to mask
    if allowed is not None:
        columns = columns.masked_fill(~local_allowed, float("-inf"))
    # Every rank of the group must take the same chunks (each chunk all-reduces), so the chunk size
    # comes from widths all ranks share, not from this shard's own column count.
    width = local_vocab if support is None else min(local_vocab, int(ids.numel()))
    chunk_rows = max(1, max_chunk_elements // width)
    group = tp_group if tp_size > 1 else None
    logprobs = _TokenLogprobs.apply(columns, local_targets, in_shard, 1.0 / temperature, group, chunk_rows)
    if not return_entropy:
        return logprobs
    return logprobs, _TokenEntropy.apply(columns, 1.0 / temperature, group, chunk_rows)
