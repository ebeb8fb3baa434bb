"""``gym_video_env.affinity``: a conversation's key is its prompt (what comes before the first model
turn), the same in every turn and every sample of a group; the key picks a server stably."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gym_video_env.affinity import pick, prompt_key

pytestmark = pytest.mark.unit

SYSTEM = {"role": "system", "content": "Answer with one letter."}
QUESTION = {
    "role": "user",
    "content": [
        {"type": "input_video", "video_url": "file:///media/clip_0003.mp4"},
        {"type": "input_text", "text": "Which colour?"},
    ],
}


def test_later_turns_of_a_conversation_keep_its_prompts_key() -> None:
    first = prompt_key([SYSTEM, QUESTION])
    responses_turn = [
        SYSTEM,
        QUESTION,
        {"type": "function_call", "name": "watch_segment", "arguments": "{}", "call_id": "c1"},
        {"type": "function_call_output", "call_id": "c1", "output": "segment 2"},
        {"type": "message", "role": "user", "content": [{"type": "input_video", "video_url": "x"}]},
    ]
    chat_turn = [SYSTEM, QUESTION, {"role": "assistant", "content": "B"}, {"role": "user", "content": "?"}]
    assert prompt_key(responses_turn) == first
    assert prompt_key(chat_turn) == first
    reasoning_first = [
        SYSTEM,
        QUESTION,
        {"type": "reasoning", "summary": []},
        {"role": "user", "content": "?"},
    ]
    assert prompt_key(reasoning_first) == first


def test_the_key_is_the_prompts_content_not_its_key_order_or_identity() -> None:
    reordered = {"content": QUESTION["content"], "role": "user"}
    assert prompt_key([dict(SYSTEM), reordered]) == prompt_key([SYSTEM, QUESTION])
    other_clip = {
        **QUESTION,
        "content": [{"type": "input_video", "video_url": "file:///media/clip_0004.mp4"}],
    }
    assert prompt_key([SYSTEM, other_clip]) != prompt_key([SYSTEM, QUESTION])
    assert prompt_key("Which colour?") != prompt_key([{"role": "user", "content": "Which colour?"}])


def test_pick_is_a_stable_hash_of_the_key() -> None:
    # Every process and every run must agree (Python's hash() is salted per process).
    key = prompt_key([SYSTEM, QUESTION])
    expected = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % 5
    assert pick(key, 5) == expected
    assert pick(key, 1) == 0
    with pytest.raises(ValueError, match="no servers"):
        pick(key, 0)


def test_many_groups_spread_over_the_servers() -> None:
    keys = [prompt_key([SYSTEM, {"role": "user", "content": f"clip {i}"}]) for i in range(400)]
    counts = [0] * 4
    for key in keys:
        counts[pick(key, 4)] += 1
    assert min(counts) > 60, counts  # 100 expected each; 60 is four standard deviations below


@given(st.text(), st.integers(min_value=1, max_value=64))
def test_pick_is_one_of_the_servers(key: str, n: int) -> None:
    assert 0 <= pick(key, n) < n
