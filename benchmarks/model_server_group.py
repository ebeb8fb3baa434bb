"""When a group's responses leave the model server after vLLM answers: ours against stock Gym.

A GRPO batch's samples all end within a few decode steps of each other, so each model server
replica gets its groups' answers from vLLM at about the same moment and turns each sample's
answer into a Responses API response (stock Gym's chat-completion path: token ids, logprobs, the
response models). This times that hop alone, in process, with vLLM's answer stood in by a canned
one of the 3B rollout benchmark's shape (``--prompt-tokens`` token ids, 64 generated tokens with
their logprobs), so that nothing but the server's own work is measured:

- **ours**: ``video_vllm_model`` with ``--groups`` declared groups of ``--group-size`` samples
  (``gym_video_env.coalesce``), each group answered by one request with ``n`` choices;
- **stock**: Gym's ``vllm_model`` with the same number of samples, each its own request and answer.

Every request goes through the server's whole FastAPI app (its middleware, the route, the
response's serialization) over an in-process ASGI transport. The two servers run in alternating
rounds, so that the machine's drift falls on both. For each it reports when each response reached
the caller, in milliseconds after the first answer from the stand-in vLLM (the median of
``--rounds`` rounds), and the server's time per sample; and the median of the round-by-round
ratios of the last response. Run from the project
root with the Gym environment, on an otherwise idle machine::

    envs/gym/.venv/bin/python benchmarks/model_server_group.py \
        --json benchmarks/results/model_server_group_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from typing import Any

import httpx
from omegaconf import OmegaConf

CONTRACT = {
    "aspect_policy": "keep",
    "fps": 4.0,
    "max_frames": 32,
    "max_pixels": 50176,
    "min_frames": 4,
    "min_pixels": 3136,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "style": "qwen2_vl",
    "temporal_patch_size": 2,
    "timestamps": "nominal",
}


def canned_answer(choices: int, prompt_tokens: int, generated: int, seed: int) -> str:
    """vLLM's chat completion with ``choices`` choices, token ids and logprobs, as JSON."""
    rng = random.Random(seed)
    listed = []
    for index in range(choices):
        ids = [rng.randrange(150_000) for _ in range(generated)]
        content = [
            {"token": f"token_id:{t}", "logprob": -rng.random(), "bytes": [65], "top_logprobs": []}
            for t in ids
        ]
        listed.append(
            {
                "index": index,
                "finish_reason": "length",
                "stop_reason": None,
                "logprobs": {"content": content},
                "token_ids": ids,
                "message": {"role": "assistant", "content": "So \\boxed{A} " + "x" * 150, "tool_calls": []},
            }
        )
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1,
            "model": "bench",
            "prompt_token_ids": [rng.randrange(150_000) for _ in range(prompt_tokens)],
            "choices": listed,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": generated * choices,
                "total_tokens": prompt_tokens + generated * choices,
            },
        }
    )


def build_server(name: str, media_root: str) -> Any:
    """The model server ``name`` (``ours`` or ``stock``) as the trainer configures it."""
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import ServerClient

    fields: dict[str, Any] = {
        "name": "policy_model",
        "host": "127.0.0.1",
        "port": 1,
        "entrypoint": "app.py",
        "base_url": "http://127.0.0.1:9/v1",
        "api_key": "unused",
        "model": "bench",
        "return_token_id_information": True,
        "request_prompt_and_generation_token_ids": True,
        "uses_reasoning_parser": False,
        "propagate_context_overflow_errors": True,
    }
    client = ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=2), global_config_dict=OmegaConf.create({})
    )
    if name == "ours":
        from responses_api_models.video_vllm_model.app import VideoVLLMModel, VideoVLLMModelConfig

        config = VideoVLLMModelConfig(
            **fields, media_root=media_root, vllm_connection_retries=8, video_sampling_contract=CONTRACT
        )
        return VideoVLLMModel(config=config, server_client=client)
    from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig

    return VLLMModel(config=VLLMModelConfig(**fields), server_client=client)


async def one_round(
    server: Any, name: str, groups: int, size: int, answers: dict[int, str], tag: str
) -> dict[str, Any]:
    """Every sample of ``groups`` groups at once; when each response reached the caller (ms after
    the first stand-in answer) and the round's wall per sample."""
    from gym_video_env.coalesce import group_metadata

    answered: list[float] = []
    done: list[float] = []

    async def stand_in(**body: Any) -> dict[str, Any]:
        await asyncio.sleep(0.002)  # every request reaches "vLLM" before the first answer
        answer = json.loads(answers[body.get("n", 1)])  # as the client parses vLLM's body
        answered.append(time.perf_counter())
        return answer

    for client in server._clients:  # the wrapped client's send for ours, the client's for stock
        if name == "ours":
            object.__setattr__(client, "_send", stand_in)
        else:
            object.__setattr__(client, "create_chat_completion", stand_in)

    def body(group: int, sample: int) -> dict[str, Any]:
        text = f"Round {tag}, question {group}: which colour? (A) red (B) blue (C) green (D) grey"
        request: dict[str, Any] = {
            "model": "bench",
            "temperature": 1.0,
            "max_output_tokens": 64,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}],
        }
        if name == "ours":
            request["metadata"] = group_metadata(f"{tag}g{group}", size)
        else:
            request["input"][0]["content"][0]["text"] += f" (sample {sample})"
        return request

    async def post(http: httpx.AsyncClient, group: int, sample: int) -> None:
        response = await http.post("/v1/responses", json=body(group, sample))
        response.raise_for_status()
        done.append(time.perf_counter())

    transport = httpx.ASGITransport(app=server.setup_webserver())
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
        started = time.perf_counter()
        await asyncio.gather(*(post(http, g, s) for g in range(groups) for s in range(size)))
        wall = time.perf_counter() - started
    first = min(answered)
    return {
        "answers_ms": sorted(round(1e3 * (t - first), 2) for t in answered),
        "responses_ms": sorted(round(1e3 * (t - first), 2) for t in done),
        "wall_per_sample_ms": 1e3 * wall / (groups * size),
    }


def run(args: argparse.Namespace, media_root: str) -> dict[str, dict[str, Any]]:
    """Both servers timed in alternating rounds (which goes first alternates too), so that a drift
    in the machine's speed falls on both: per server the medians of ``args.rounds`` rounds."""
    names = ("stock", "ours")
    servers = {name: build_server(name, media_root) for name in names}
    choices = {"stock": 1, "ours": args.group_size}  # stock: one answer a sample; ours: one a group
    answers = {name: {n: canned_answer(n, args.prompt_tokens, 64, seed=n)} for name, n in choices.items()}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for i in range(args.rounds + 1):
        for name in names if i % 2 == 0 else names[::-1]:
            timed = asyncio.run(
                one_round(servers[name], name, args.groups, args.group_size, answers[name], f"r{i}")
            )
            if i:  # the first round warms each app up
                rounds[name].append(timed)
    samples = args.groups * args.group_size

    def summary(timed: list[dict[str, Any]]) -> dict[str, Any]:
        def median_at(position: int) -> float:
            return statistics.median(r["responses_ms"][position] for r in timed)

        return {
            "first_response_ms": median_at(0),
            "median_response_ms": median_at(samples // 2),
            "last_response_ms": median_at(samples - 1),
            "last_answer_ms": statistics.median(r["answers_ms"][-1] for r in timed),
            "wall_per_sample_ms": statistics.median(r["wall_per_sample_ms"] for r in timed),
            "last_response_ms_range": [
                min(r["responses_ms"][-1] for r in timed),
                max(r["responses_ms"][-1] for r in timed),
            ],
            "median_round": sorted(timed, key=lambda r: r["responses_ms"][-1])[len(timed) // 2],
        }

    results = {name: summary(rounds[name]) for name in names}
    results["paired"] = {  # round by round: stock's last response over ours'
        "stock_last_response_over_ours_median": statistics.median(
            s["responses_ms"][-1] / o["responses_ms"][-1]
            for s, o in zip(rounds["stock"], rounds["ours"], strict=True)
        )
    }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=2, help="groups a replica holds (16 over 8: 2)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1189, help="the 3B rollout benchmark's prompt")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as media_root:
        results = run(args, media_root)
    for name in ("stock", "ours"):
        result = results[name]
        print(
            f"{name:5s}: responses at +{result['first_response_ms']:.1f} (first), "
            f"+{result['median_response_ms']:.1f} (median), +{result['last_response_ms']:.1f} ms (last) "
            f"after the first answer; the server {result['wall_per_sample_ms']:.2f} ms a sample"
        )
    ratios = {
        f"stock_{what}_response_over_ours": results["stock"][f"{what}_response_ms"]
        / results["ours"][f"{what}_response_ms"]
        for what in ("first", "median", "last")
    }
    ratios.update(results.pop("paired"))
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    if args.json:
        document = {
            "command": "envs/gym/.venv/bin/python benchmarks/model_server_group.py "
            f"--groups {args.groups} --group-size {args.group_size} --prompt-tokens {args.prompt_tokens} "
            f"--rounds {args.rounds}",
            "host": {
                "machine": platform.machine(),
                "cores": os.cpu_count(),
                "python": platform.python_version(),
            },
            "results": results,
            "ratios": ratios,
        }
        with open(args.json, "w") as handle:
            handle.write(json.dumps(document, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
