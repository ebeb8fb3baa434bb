"""Prompt affinity: which of several equal servers a conversation goes to.

A GRPO group is ``G`` conversations that start from one prompt. Sent to one server, the group's
first turns can go to vLLM as one request with ``n`` choices (:mod:`gym_video_env.coalesce`) and
its clip is loaded, processed, encoded and prefilled once; spread over servers, each server pays
for it again. Gym's model server spreads conversations by a hash of their session id, which puts
a group's samples on different vLLM servers, and uvicorn workers sharing a port split a group
between processes at random.

Routing by the conversation's prompt keeps both a group and each conversation's later turns
together: :func:`prompt_key` is the conversation up to its first model turn (the same in every
turn and every sample of a group), and :func:`pick` maps it to one of ``n`` servers by a stable
hash, the same in every process and run, with no state kept per conversation. Load is balanced
by groups, not samples: with few groups per server the busiest takes more than its share (16
groups over 4 servers: 4 on average, the busiest 6 typically and 8 or more one step in ten).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["MODEL_REPLICA_KEY", "pick", "prompt_key", "take_model_replica", "without_metadata"]

MODEL_REPLICA_KEY = "model_replica"
"""Request ``metadata`` key naming, as a decimal string, the model-server replica (an index into
the agent's ``[model_server, *model_servers]``) that all of a conversation's model calls go to,
in place of the one its prompt picks: a rollout client that deals a group's samples over several
agent replicas names the group's one model server this way."""

_MODEL_TURN_TYPES = frozenset({"function_call", "reasoning"})


def prompt_key(items: str | Iterable[Any]) -> str:
    """Canonical JSON of the items before the first model turn of a conversation: chat
    completion ``messages`` or Responses API ``input`` items (a model turn is an item with role
    ``assistant`` or of type ``function_call`` or ``reasoning``). A string input is its own prompt."""
    if isinstance(items, str):
        return json.dumps(items)
    prompt = []
    for item in items:
        if hasattr(item, "model_dump"):  # Gym's pydantic messages
            item = item.model_dump(mode="json", exclude_unset=True)
        if isinstance(item, dict) and (
            item.get("role") == "assistant" or item.get("type") in _MODEL_TURN_TYPES
        ):
            break
        prompt.append(item)
    return json.dumps(prompt, sort_keys=True, separators=(",", ":"), default=str)


def pick(key: str, n: int) -> int:
    """The server, in ``range(n)``, of the conversation whose :func:`prompt_key` is ``key``."""
    if n < 1:
        raise ValueError(f"pick: no servers to choose from (n={n})")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % n


def take_model_replica(params: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """A Responses request's fields without the :data:`MODEL_REPLICA_KEY` entry of its ``metadata``
    (the ``metadata`` goes too when nothing else is left in it) and the replica it names
    (``None``: none named).

    Raises:
        ValueError: the entry is not a decimal index (the message names it).
    """
    metadata = params.get("metadata")
    if not isinstance(metadata, dict) or MODEL_REPLICA_KEY not in metadata:
        return params, None
    named = metadata[MODEL_REPLICA_KEY]
    if not isinstance(named, str) or not named.isdecimal():
        raise ValueError(f"metadata {MODEL_REPLICA_KEY}={named!r} is not a model-server replica index")
    return without_metadata(params, MODEL_REPLICA_KEY), int(named)


def without_metadata(params: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A request's fields (a chat completion's or a Responses request's) without entry ``key`` of
    its ``metadata``; the ``metadata`` goes too when nothing else is left in it."""
    metadata = params.get("metadata")
    if not isinstance(metadata, Mapping) or key not in metadata:
        return dict(params)
    rest = {name: value for name, value in metadata.items() if name != key}
    return {**params, "metadata": rest} if rest else {k: v for k, v in params.items() if k != "metadata"}
