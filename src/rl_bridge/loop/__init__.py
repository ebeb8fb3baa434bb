"""GRPO training loops: the typed recipe (:mod:`.config`), the task and its Gym servers
(:mod:`.tasks`), where the roles run (:mod:`.roles`, :mod:`.ray_roles`), the stages of a step
(:mod:`.controller`), metrics and curves (:mod:`.metrics`), the synchronous loop (:mod:`.sync`) and
the asynchronous one with its replay buffer (:mod:`.async_grpo`, :mod:`.replay`)."""

from rl_bridge.loop.config import Recipe, load_recipe

__all__ = ["Recipe", "load_recipe"]
