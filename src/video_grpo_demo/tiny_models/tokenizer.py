"""A small byte-level BPE tokenizer trained locally, with a model family's special tokens.

Real video-language checkpoints ship tokenizers with about 150,000 entries; a tiny model trained
with reinforcement learning on a CPU learns far faster over a few hundred. The tokenizer here is
trained with ``tokenizers`` on a fixed English corpus (the words of the synthetic video tasks and
of the chat templates), so the same settings always give the same ``tokenizer.json``. Any text,
including bytes outside the corpus, still encodes: the byte alphabet is always part of the vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib import resources

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

__all__ = ["BYTE_ALPHABET_SIZE", "CORPUS", "build_tokenizer", "load_chat_template"]

#: Number of single-byte tokens every byte-level BPE vocabulary starts with.
BYTE_ALPHABET_SIZE = 256

_WORDS = (
    "red green blue yellow orange purple pink brown black white gray cyan magenta "
    "zero one two three four five six seven eight nine ten eleven twelve "
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 20 30 32 64 100 "
    "yes no true false left right up down top bottom middle center first second third last "
    "before after during start end begin beginning finish early late "
    "frame frames video videos clip clips image images picture second seconds time "
    "color colour colors shape shapes square circle triangle dot ball box line stripe "
    "moves moving moved stays still static fast slow bigger smaller appears disappears "
    "how many which what when where who why is are was were the a an of in on at to from "
    "count counts number order ordered sequence changes change same different "
    "answer answers question watch look see shows shown show tool call result "
    "system user assistant tool You are a helpful assistant. Answer with one word. "
)

# The tool calls the agentic task asks for, written as the Qwen templates write them, twice: their
# JSON pieces ("name", ' "', "watch", "segment", ' {"', "}}" ...) become single merges, so a call is
# 20 tokens instead of 41, and over the tokens of its own encoding each call has exactly one spelling
# (what ``rollout.canonical_actions`` relies on).
_TOOL_CALLS = (
    tuple(
        f'<tool_call>\n{{"name": "watch_segment", "arguments": {{"segment": {k}}}}}\n</tool_call>'
        for k in range(1, 7)
    )
    * 2
)

#: The fixed training text: task vocabulary, chat-template words and short sentences.
CORPUS: tuple[str, ...] = (
    _WORDS,
    "You are a helpful assistant.",
    "What color is the square in the video? Answer with one word.",
    "Which color appears first in the clip? The answer is red.",
    "How many frames show a circle? The answer is three.",
    "Does the ball move left or right? It moves left.",
    "Watch the second clip and tell me what changes.",
    "Call the tool to look at another clip, then answer the question.",
    "The video shows a blue square on a black background for two seconds.",
    "Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.50 seconds:",
    *_TOOL_CALLS,
    "<tool_response>\n</tool_response>",
    "<think>\n</think>",
)


def load_chat_template(name: str) -> str:
    """The Jinja chat template ``chat_templates/<name>.jinja`` shipped with this package."""
    path = resources.files(__package__).joinpath("chat_templates", f"{name}.jinja")
    if not path.is_file():
        raise FileNotFoundError(f"no chat template named {name!r} (looked for {path})")
    return path.read_text(encoding="utf-8")


def build_tokenizer(
    *,
    bpe_vocab_size: int,
    special_tokens: Sequence[str],
    chat_template: str,
    roles: Mapping[str, str],
    extra_special_tokens: Mapping[str, str] | None = None,
    added_tokens: Sequence[str] = (),
    model_max_length: int = 32768,
    regular_vocab_size: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on :data:`CORPUS` and wrap it as a ``PreTrainedTokenizerFast``.

    The regular vocabulary gets ids ``0 .. bpe_vocab_size - 1`` (the byte alphabet first, then
    merges); ``special_tokens`` follow in order, then ``added_tokens``, as in the real checkpoints,
    so the full vocabulary size is ``bpe_vocab_size + len(special_tokens) + len(added_tokens)``
    (``regular_vocab_size`` in place of ``bpe_vocab_size`` when that fills the vocabulary).

    Args:
        bpe_vocab_size: Size of the regular (non-special) vocabulary, at least
            :data:`BYTE_ALPHABET_SIZE`. Training stops early, with a smaller vocabulary, if the
            corpus has no more pairs to merge; that is an error here, so a size always means that size.
        special_tokens: Added tokens, never split and never merged; ids assigned in this order.
        chat_template: Jinja chat template stored with the tokenizer.
        roles: Which special token plays which role: keys among ``bos_token``, ``eos_token``,
            ``pad_token``, ``unk_token``; values must be in ``special_tokens``.
        extra_special_tokens: Named special tokens exposed as tokenizer attributes
            (e.g. ``{"video_token": "<|video_pad|>"}``); values must be in ``special_tokens``.
        added_tokens: Tokens never split but not special: decoding keeps them (Qwen's
            ``<tool_call>`` and ``</tool_call>``, which a tool-call parser finds in the output text).
        model_max_length: The longest sequence, in tokens, the tokenizer reports as supported.
        regular_vocab_size: When above ``bpe_vocab_size``, the regular vocabulary is filled to this
            size with filler tokens (``" t<id>"``) that no merge produces, so the special tokens sit
            after about as many regular ones as a released tokenizer's, and every id a full-size
            random model samples decodes to text as a trained model's samples do (an id no
            tokenizer entry holds costs vLLM's detokenizer about 40 times a known one's).

    Raises:
        ValueError: ``bpe_vocab_size`` is below the byte alphabet or more than the corpus can
            produce, or a role names a token missing from ``special_tokens``.
    """
    if bpe_vocab_size < BYTE_ALPHABET_SIZE:
        raise ValueError(
            f"bpe_vocab_size={bpe_vocab_size} is smaller than the byte alphabet ({BYTE_ALPHABET_SIZE})"
        )
    named = {**roles, **(extra_special_tokens or {})}
    missing = sorted(f"{key}={tok!r}" for key, tok in named.items() if tok not in special_tokens)
    if missing:
        raise ValueError(f"tokens named for roles are not in special_tokens: {', '.join(missing)}")

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    if backend.get_vocab_size() != bpe_vocab_size:
        raise ValueError(
            f"bpe_vocab_size={bpe_vocab_size} is more than the tokenizer corpus supports "
            f"(training stopped at {backend.get_vocab_size()} tokens)"
        )

    if regular_vocab_size is not None and regular_vocab_size > bpe_vocab_size:
        backend = _with_fillers(backend, regular_vocab_size)
    backend.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in special_tokens])
    backend.add_tokens([AddedToken(tok, special=False, normalized=False) for tok in added_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        chat_template=chat_template,
        extra_special_tokens=dict(extra_special_tokens or {}),
        **roles,
    )


def _with_fillers(backend: Tokenizer, size: int) -> Tokenizer:
    """``backend`` (a trained BPE, no added tokens yet) with its vocabulary filled to ``size``
    entries by ``"Ġt<id>"`` tokens (byte-level for " t<id>"): decodable, never produced by encoding."""
    data = json.loads(backend.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for token_id in range(len(vocab), size):
        filler = f"\u0120t{token_id}"
        if filler in vocab:  # a trained merge already spells it (never with the task corpus)
            raise ValueError(f"the filler token {filler!r} is already in the vocabulary")
        vocab[filler] = token_id
    return Tokenizer.from_str(json.dumps(data))
