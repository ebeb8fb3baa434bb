"""Logprobs: ``pi_old`` of every sample when the step needs it before training, and the
reference policy's when the KL weight is non-zero.

``pi_old`` is computed here only with several optimizer steps per rollout batch or mismatch
masking (:attr:`~rl_bridge.recipe.Recipe.needs_old_logprobs`); otherwise the first training
forward provides it, one forward pass fewer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rl_bridge.recipe import Recipe

__all__ = ["add_logprobs"]


def add_logprobs(recipe: Recipe, policy: Any, reference: Any, samples: list[Any]) -> list[Any]:
    """The samples with ``old_logprobs`` from ``policy`` (when the recipe needs them) and
    ``ref_logprobs`` from ``reference`` (``None``: no KL term)."""
    if not samples:
        return []
    none = [None] * len(samples)
    old = policy.logprobs(samples) if recipe.needs_old_logprobs else none
    ref = reference.logprobs(samples) if reference is not None else none
    return [
        dataclasses.replace(s, old_logprobs=o, ref_logprobs=r)
        for s, o, r in zip(samples, old, ref, strict=True)
    ]
