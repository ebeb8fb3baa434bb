"""GRPO training loops: the typed recipe (:mod:`.config`), the task and its Gym servers
(:mod:`.tasks`), where the roles run (:mod:`.roles`), the stages of a step (:mod:`.controller`),
metrics and curves (:mod:`.metrics`) and the synchronous loop (:mod:`.sync`)."""

from rl_bridge.loop.config import Recipe, load_recipe

__all__ = ["Recipe", "load_recipe"]
