"""GRPO training loops: the typed recipe (:mod:`.config`), the task rows (:mod:`.tasks`) and the
synchronous controller (:mod:`.sync`)."""

from rl_bridge.loop.config import Recipe, load_recipe

__all__ = ["Recipe", "load_recipe"]
