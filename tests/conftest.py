"""Shared pytest set-up. Service fixtures live in ``tests/fixtures/*`` and are loaded here."""

from __future__ import annotations

import os

# Nothing in this project may reach a model hub: tiny models are built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest_plugins = [
    "tests.fixtures.media",
    "tests.fixtures.models",
    "tests.fixtures.vllm",
    "tests.fixtures.gym",
    "tests.fixtures.gym_video",
    "tests.fixtures.bad_inputs",
]
