"""Start a run's roles where ``recipe.cluster`` places them: on this host
(:mod:`rl_bridge.backends.local`) or as Ray actors (:mod:`rl_bridge.backends.ray_cluster`)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING

from rl_bridge.backends.local import start_local_roles

if TYPE_CHECKING:
    from rl_bridge.backends.handles import Roles
    from rl_bridge.recipe import Recipe
    from rl_bridge.tasks import TaskData

__all__ = ["start_roles"]


def start_roles(recipe: Recipe, data: TaskData, stack: ExitStack) -> Roles:
    """Start the roles where ``recipe.cluster`` places them; ``stack`` stops them."""
    if recipe.cluster.backend == "ray":
        from rl_bridge.backends.ray_cluster import start_ray_roles  # Ray is imported only for Ray runs

        return start_ray_roles(recipe, data, stack)
    return start_local_roles(recipe, data, stack)
