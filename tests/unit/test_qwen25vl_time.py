"""``vllm_video_plugin.qwen25vl_time`` is installed exactly where vLLM's Qwen2.5-VL processor drops
the video metadata (0.26), and there hands transformers the frames and their ``VideoMetadata``
(the seconds a temporal patch lasts follow the clip's sampled rate, not transformers' 24 fps).
On 0.32 vLLM does it itself and nothing is installed. What it changes, the logprobs of every token
from the video on, is checked against the trainer in ``tests/integration/test_video_positions.py``
on both releases (on 0.26 without it they differ by up to 0.04)."""

from __future__ import annotations

import pytest

import vllm_video_plugin
from vllm_video_plugin import compat, qwen25vl_time

pytestmark = pytest.mark.uses_vllm


def test_installed_where_vllm_drops_the_video_metadata() -> None:
    vllm_video_plugin.register()
    assert qwen25vl_time.installed() == (not compat.qwen25vl_processor_passes_video_metadata())
    assert not qwen25vl_time.install()  # once only, and never over a release that passes it
