"""How far bf16 alone moves the token probabilities of a random-weight model of the 3B recipe's shape.

The loop's token multiplicative probability error (mean over generated tokens of
``exp(|logp_vllm - logp_policy|)``) was 1.14 a step for the random-weight Qwen2.5-VL-3B shape in
bf16 on one GPU, against 1.002 for the tiny model. This script asks what bf16 rounding alone gives
for that shape, with no second implementation involved: one model (transformers' Qwen2 language
model with the 3B recipe's text dimensions: hidden 2048, 16 / 2 heads of 128, MLP 11,008, the
151,936-row tied vocabulary, transformers' random initialisation), the same random token sequence
(1,253 tokens, the 3B run's prompt plus 64 generated), logprobs of its last 64 tokens in fp32, then
with the same weights cast to bf16; the error and the largest per-token difference between them,
for several depths. Random weights give a near-uniform distribution over the vocabulary (mean
logprob about -log(151,936) = -11.9), where small logit errors move every probability.

What it shows is what rounding can do on such a model, not what the loop's 1.14 was: with both
sides in fp32 the loop's error stayed 1.125, and the cause was vLLM 0.26's video time positions
(``vllm_video_plugin.qwen25vl_time``).

On CPU (about 12 GB of memory at 36 layers; 2 min on two cores)::

    envs/main/.venv/bin/python benchmarks/precision.py --layers 2 12 36 \\
        --json benchmarks/results/precision_bf16_random_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

TOKENS = 1253
GENERATED = 64
VOCAB = 151936
TOKENIZER_VOCAB = 151665  # ids a tokenizer of that family produces (the rest is padding)


def token_logprobs(model: Qwen2ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logprob of each of the last ``GENERATED`` tokens of ``ids`` given the ones before it (fp32 softmax)."""
    logits = model(ids).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0][-GENERATED:]


def measure(layers: int, ids: torch.Tensor, seed: int) -> dict[str, float]:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=1e6,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    started = time.perf_counter()
    with torch.no_grad():
        fp32 = token_logprobs(model, ids)
        bf16 = token_logprobs(model.to(torch.bfloat16), ids)
    diff = (fp32 - bf16).abs()
    return {
        "layers": layers,
        "token_mult_prob_error": float(torch.exp(diff).mean()),
        "max_abs_logprob_diff": float(diff.max()),
        "mean_abs_logprob_diff": float(diff.mean()),
        "mean_logprob_fp32": float(fp32.mean()),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 12, 36])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    ids = torch.randint(0, TOKENIZER_VOCAB, (1, TOKENS))
    results = []
    print(f"{'layers':>6} {'token error':>11} {'max |dlogp|':>11} {'mean |dlogp|':>12} {'mean logp':>9}")
    for layers in args.layers:
        r = measure(layers, ids, args.seed + 1)
        results.append(r)
        print(
            f"{layers:>6} {r['token_mult_prob_error']:>11.4f} {r['max_abs_logprob_diff']:>11.4f} "
            f"{r['mean_abs_logprob_diff']:>12.4f} {r['mean_logprob_fp32']:>9.2f}",
            flush=True,
        )
    if args.json:
        report = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "where": f"CPU ({platform.machine()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads)",
            "what": "one random-weight model in fp32 against the same weights in bf16 (one implementation)",
            "tokens": TOKENS,
            "scored_tokens": GENERATED,
            "results": results,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
