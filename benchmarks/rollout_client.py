"""Rollout-client benchmark: what :func:`rl_bridge.rollout.collect_rollouts` itself adds to a batch.

The loop's rollout stage posts each row to a Gym agent's ``/run`` and waits for its answer (the
trajectory, with token ids and logprobs). This benchmark puts a local stand-in for the agent in
another process: it answers every ``/run`` after a fixed delay (the rollout itself) with a body of
a real answer's size (a 1,189-token prompt's ids, 64 generated ids and logprobs), so everything
above the delay is the client's: posting a batch, reading and parsing its answers. It times, side
by side in one run, on the same rows against the same server:

- ``collect_rollouts``: the package's client (one asyncio loop, aiohttp, one connection pool);
- ``threads + requests``: the design it replaced and the usual one, a thread per row in flight, each
  with its own ``requests`` session (what ``collect_rollouts`` did before).

Per client: wall seconds over the delay (median of the repeats), the client process's CPU seconds,
and the ratio. Run from the project root with the main environment::

    envs/main/.venv/bin/python benchmarks/rollout_client.py --json benchmarks/results/rollout_client_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from rl_bridge.rollout import RolloutSettings, collect_rollouts
from rl_bridge.services.process import free_port, wait_for_http

# The stand-in agent: asyncio streams, keep-alive, a fixed delay, a canned answer of a real size.
SERVER = r"""
import asyncio, json, sys
port, delay = int(sys.argv[1]), float(sys.argv[2])
answer = json.dumps({
    "reward": 1.0,
    "response": {"output": [{
        "type": "message", "role": "assistant",
        "prompt_token_ids": list(range(151000, 151000 + 1189)),
        "generation_token_ids": list(range(64)),
        "generation_log_probs": [-0.6931471805599453] * 64,
        "content": [{"type": "output_text", "text": "The answer is (B)." * 8}],
    }]},
}).encode()
head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(answer)

async def handle(reader, writer):
    try:
        while True:
            request_line = await reader.readline()
            if not request_line:
                break
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            if request_line.startswith(b"GET"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            else:
                await asyncio.sleep(delay)
                writer.write(head + answer)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    writer.close()

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


def rows(count: int, group_size: int) -> list[dict[str, Any]]:
    """Gym rows as the loop posts them: a video prompt per group, ``group_size`` samples each."""
    return [
        {
            "responses_create_params": {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "input_video",
                                "video_url": f"file:///media/clip_{index // group_size}.mp4",
                            },
                            {"type": "input_text", "text": "Which colour fills the frame? (A) red (B) green"},
                        ],
                    }
                ],
                "temperature": 1.0,
                "max_output_tokens": 64,
            },
            "answer": "B",
        }
        for index in range(count)
    ]


def threads_and_requests(url: str, batch: list[dict[str, Any]], max_in_flight: int) -> int:
    """The replaced design: a thread per row in flight, a ``requests`` session per row."""

    def one(row: dict[str, Any]) -> bool:
        with requests.Session() as session:
            response = session.post(url + "/run", json=row, timeout=300)
            return isinstance(response.json().get("reward"), float)

    with ThreadPoolExecutor(max_workers=max_in_flight) as pool:
        return sum(pool.map(one, batch))


def ours(url: str, batch: list[dict[str, Any]], max_in_flight: int) -> int:
    results, _ = collect_rollouts(url, batch, RolloutSettings(max_in_flight=max_in_flight))
    return sum(result.outcome == "ok" for result in results)


def measure(
    client: Callable[[str, list[dict[str, Any]], int], int],
    url: str,
    batch: list[dict[str, Any]],
    delay_s: float,
) -> tuple[float, float]:
    """One batch through ``client``: wall seconds over the delay, and the client's CPU seconds."""
    cpu_before, started = time.process_time(), time.perf_counter()
    ok = client(url, batch, len(batch))
    over, cpu = time.perf_counter() - started - delay_s, time.process_time() - cpu_before
    if ok != len(batch):
        raise SystemExit(f"{client.__name__}: {ok} of {len(batch)} rows answered")
    return over, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="rows a batch (16 prompts x 8 samples)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--delay-s", type=float, default=0.5, help="the stand-in agent's time per rollout")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    port = free_port("127.0.0.1")
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(args.delay_s)])
    url = f"http://127.0.0.1:{port}"
    clients = {"collect_rollouts": ours, "threads + requests": threads_and_requests}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
    try:
        wait_for_http(url + "/health", timeout_s=30)
        batch = rows(args.rows, args.group_size)
        for client in clients.values():  # warm-up: imports, first connections
            client(url, batch[: args.group_size], args.rows)
        for _ in range(args.repeats):  # interleaved: drift in the machine's load hits both
            for name, client in clients.items():
                samples[name].append(measure(client, url, batch, args.delay_s))
    finally:
        server.terminate()
        server.wait()

    figures = {
        name: {
            "wall_over_delay_s": statistics.median(over for over, _ in runs),
            "client_cpu_s": statistics.median(cpu for _, cpu in runs),
            "wall_over_delay_s_all": [over for over, _ in runs],
            "client_cpu_s_all": [cpu for _, cpu in runs],
        }
        for name, runs in samples.items()
    }
    ours_figures, old = figures["collect_rollouts"], figures["threads + requests"]
    ratios = {
        "wall_over_delay_old_over_ours": old["wall_over_delay_s"] / ours_figures["wall_over_delay_s"],
        "client_cpu_old_over_ours": old["client_cpu_s"] / ours_figures["client_cpu_s"],
    }
    print(f"{args.rows} rows, each answered after {args.delay_s} s; medians of {args.repeats} batches")
    print(f"{'client':<22}{'wall s over delay':>20}{'client CPU s':>15}")
    for name, fig in figures.items():
        print(f"{name:<22}{fig['wall_over_delay_s']:>20.3f}{fig['client_cpu_s']:>15.3f}")
    print(
        "threads + requests / collect_rollouts: wall over the delay "
        f"{ratios['wall_over_delay_old_over_ours']:.2f}x, "
        f"client CPU {ratios['client_cpu_old_over_ours']:.2f}x (above 1: collect_rollouts costs less)"
    )
    if args.json:
        record = {
            "command": "python benchmarks/rollout_client.py " + " ".join(sys.argv[1:]),
            "host": {"python": platform.python_version(), "cpu_count": os.cpu_count()},
            "configuration": {"rows": args.rows, "group_size": args.group_size, "delay_s": args.delay_s},
            "results": figures,
            "ratios": ratios,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
