"""The trainer's side of vLLM's structured outputs: the token masks each generated token was sampled under.

A recipe may constrain decoding with vLLM's structured outputs (``rollout.action_choices``: "an
option letter, or one well-formed tool call", sent as the request's ``structured_outputs.grammar``,
the EBNF grammar vLLM builds for a ``choice``; :func:`choice_grammar`),
so that a random tiny model emits only valid actions while it learns which to take. vLLM applies
the grammar's token bitmask to the logits before it samples, so the distribution it samples from
and the logprobs it reports are the softmax over the allowed tokens of each position. That masked
distribution is the policy being trained: the trainer must compute its logprobs under the same
mask at every generated position, or the ratio, the mismatch metrics and the gradient describe
another policy.

:class:`GrammarMasks` replays a turn's generated tokens through xgrammar, the backend the loop's
vLLM is pinned to (``--structured-outputs-config {"backend": "xgrammar"}``), built as vLLM builds
it: the tokenizer's vocabulary at the checkpoint's vocabulary size, the stop tokens vLLM adds to a
request (the tokenizer's EOS and the generation config's ``eos_token_id``), and the same grammar
(:func:`choice_grammar`). Before each token it records the bitmask xgrammar
fills (packed: bit ``j`` of int32 word ``w`` allows token ``32 * w + j``), then accepts the token.
A token the grammar rejects means the trainer's grammar is not vLLM's: :class:`ConstraintError`,
which the policy-input builder turns into a masked sample (``constraint_mismatch``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ConstraintError",
    "GrammarMasks",
    "canonical_action_tokens",
    "choice_grammar",
    "choice_request_body",
    "unpack_bitmask",
]

STRUCTURED_OUTPUTS_BACKEND = "xgrammar"
"""The backend the loop's vLLM runs structured outputs with (and the trainer replays)."""


class ConstraintError(ValueError):
    """A generated token that the replayed grammar does not allow at its position."""


def choice_grammar(choices: Sequence[str]) -> str:
    """The EBNF grammar whose sentences are exactly ``choices``: what vLLM 0.31 and later compile
    for ``structured_outputs.choice`` (``choice_as_grammar``), every string literal escaped
    (``\\``, ``"``, newline, carriage return, tab, other control characters as ``\\uXXXX``).

    The loop sends this grammar rather than the choice: vLLM before 0.31 escapes only ``"`` and
    ``\\`` in a choice (:func:`vllm_video_plugin.compat.choice_escapes_control_characters`), so a
    choice holding a raw newline (a hermes tool call) made a literal xgrammar refuses. A grammar
    is compiled as given on every supported release.
    """
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def literal(text: str) -> str:
        out = []
        for char in text:
            if char in escapes:
                out.append(escapes[char])
            elif ord(char) < 0x20 or ord(char) == 0x7F:
                out.append(f"\\u{ord(char):04x}")
            else:
                out.append(char)
        return '"' + "".join(out) + '"'

    if not choices:
        raise ValueError("choice_grammar: choices must not be empty")
    return "root ::= " + " | ".join(literal(choice) for choice in choices)


def choice_request_body(choices: Sequence[str]) -> dict[str, Any]:
    """The chat-completion fields that make vLLM decode exactly one of ``choices`` (the grammar
    of :func:`choice_grammar`)."""
    return {"structured_outputs": {"grammar": choice_grammar(choices)}}


def _spellings(text: str, pieces: dict[int, str]) -> int:
    """How many sequences of ``pieces`` (token id -> its text) spell ``text`` exactly."""
    ways = [1] + [0] * len(text)
    for start in range(len(text)):
        if ways[start]:
            for piece in pieces.values():
                if piece and text.startswith(piece, start):
                    ways[start + len(piece)] += ways[start]
    return ways[-1]


def canonical_action_tokens(model_dir: str | Path, choices: Sequence[str]) -> list[int]:
    """The tokens that spell each of ``choices`` one way only: the tokenizer's own encoding of every
    choice, plus its end token (one stop token, so the end is spelled one way too).

    A grammar over characters lets a model spell an action in any tokenisation that decodes to it:
    a byte-level vocabulary offers millions of spellings of a 60-character tool call. Sent as vLLM's
    ``allowed_token_ids`` beside the structured-outputs choice, this set leaves the spelling the
    chat template writes when it re-renders the action in the next prompt, so a trajectory stays
    one token sequence, and every position of an action but its decisions (which action, which
    argument) has one allowed token, probability 1 and no gradient. The trainer computes its
    logprobs over the same tokens (``PolicyConfig.token_support``).

    Raises:
        ValueError: ``choices`` is empty, the tokenizer has no end token, or a choice has more than
            one spelling over the set (the message names it and the count).
    """
    from transformers import AutoTokenizer

    if not choices:
        raise ValueError("canonical_action_tokens: choices must not be empty")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"canonical_action_tokens: the tokenizer of {model_dir} has no end token")
    tokens = {
        int(token) for choice in choices for token in tokenizer.encode(choice, add_special_tokens=False)
    }
    pieces = {token: tokenizer.decode([token]) for token in tokens}
    for choice in choices:
        spellings = _spellings(choice, pieces)
        if spellings != 1:
            raise ValueError(
                f"action {choice!r} has {spellings} spellings over the tokens of the actions' own "
                f"encodings in {model_dir}'s tokenizer, not one: its vocabulary needs merges that "
                "cover the action (see video_grpo_demo.tiny_models.tokenizer)"
            )
    return sorted(tokens | {int(tokenizer.eos_token_id)})


def _stop_token_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """The stop tokens vLLM adds to every request: the tokenizer's EOS and the generation config's."""
    stops = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text(encoding="utf-8")).get("eos_token_id")
        stops.update([eos] if isinstance(eos, int) else list(eos or ()))
    return sorted(stops)


def _vocab_size(model_dir: Path) -> int:
    """The checkpoint's vocabulary size (the text config's, for a vision-language model)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    for section in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        if isinstance(section.get("vocab_size"), int):
            return int(section["vocab_size"])
    raise ValueError(f"{model_dir / 'config.json'} has no vocab_size")


class GrammarMasks:
    """Per-token masks of one structured-outputs choice for one checkpoint; see the module docstring.

    Thread-safe: the grammar is compiled once, each call replays with its own matcher.
    """

    def __init__(self, model_dir: str | Path, choices: Sequence[str]) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        if not choices:
            raise ValueError("GrammarMasks: choices must not be empty")
        model_dir = Path(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size = _vocab_size(model_dir)
        self.stop_token_ids = _stop_token_ids(model_dir, tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        self._grammar = xgr.GrammarCompiler(info).compile_grammar(choice_grammar(list(choices)))
        self._xgr = xgr
        self._lock = threading.Lock()

    @property
    def words(self) -> int:
        """int32 words per packed mask row."""
        return (self.vocab_size + 31) // 32

    def bitmasks(self, token_ids: Sequence[int]) -> torch.Tensor:
        """``[len(token_ids), words]`` int32: the mask each token was sampled under, packed.

        Tokens after the grammar terminated (it accepted a stop token) were not constrained:
        their rows allow every token, as vLLM leaves them.

        Raises:
            ConstraintError: a token the grammar does not allow at its position.
        """
        xgr = self._xgr
        matcher = xgr.GrammarMatcher(self._grammar, override_stop_tokens=self.stop_token_ids)
        masks = torch.full((len(token_ids), self.words), -1, dtype=torch.int32)
        for position, token in enumerate(token_ids):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(masks, position)
            if not matcher.accept_token(int(token)):
                raise ConstraintError(
                    f"generated token {int(token)} at position {position} is not allowed by the "
                    "structured-outputs grammar the trainer replays (is vLLM's grammar the recipe's?)"
                )
        return masks


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` bool from ``[rows, words]`` int32 packed masks (xgrammar's layout)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    unpacked = (bitmask.unsqueeze(-1) >> bits) & 1
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
