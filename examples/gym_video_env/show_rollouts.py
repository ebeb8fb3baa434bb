"""Print what `gym eval run` collected: each rollout's reward and token ids, and each failed row.

    python show_rollouts.py rollouts/rollouts.jsonl

Reads ROLLOUTS (one JSON object per rollout) and, when present, Gym's failures sidecar next to it
(``<stem>_failures.jsonl``, written with ``+route_failures_to_sidecar=true``). Only the standard
library: runs with any Python.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def token_counts(rollout: dict[str, Any]) -> list[tuple[int, int]]:
    """``(prompt token ids, generation token ids)``, counted, of each assistant turn of a rollout."""
    counts = []
    for item in rollout.get("response", {}).get("output", []):
        if item.get("type") == "message" and item.get("role") == "assistant":
            counts.append(
                (len(item.get("prompt_token_ids") or []), len(item.get("generation_token_ids") or []))
            )
    return counts


def failure_reason(failure: dict[str, Any]) -> str:
    """The server's reason for a failed row: the JSON error's message when the body is one."""
    body = failure.get("_ng_failure_response_body") or failure.get("_ng_failure_message") or ""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(body)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[0])
    rollouts = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for rollout in rollouts:
        turns = token_counts(rollout)
        first = next((item for item in rollout["response"]["output"] if item.get("generation_token_ids")), {})
        generated = first.get("generation_token_ids") or []
        print(
            f"rollout task={rollout.get('task_id')} reward={rollout.get('reward')} turns={len(turns)} "
            f"prompt_token_ids={[p for p, _ in turns]} generation_token_ids={[g for _, g in turns]} "
            f"first_generated={generated[:8]}"
        )
    failures_path = path.with_name(f"{path.stem}_failures.jsonl")
    failures = []
    if failures_path.is_file():
        failures = [
            json.loads(line) for line in failures_path.read_text(encoding="utf-8").splitlines() if line
        ]
    for failure in failures:
        print(
            f"failed row={failure.get('_ng_task_index')} status={failure.get('_ng_failure_http_status')} "
            f"reason={failure_reason(failure)}"
        )
    print(f"{len(rollouts)} rollouts, {len(failures)} failed rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
