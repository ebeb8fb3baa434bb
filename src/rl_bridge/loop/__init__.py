"""GRPO training loops: the task and its Gym servers (:mod:`.tasks`), the stages of a step
(:mod:`.controller`), metrics and curves (:mod:`.metrics`), the synchronous loop (:mod:`.sync`) and
the asynchronous one with its replay buffer (:mod:`.async_grpo`, :mod:`.replay`). The recipe is
:mod:`rl_bridge.recipe`, the placement planner :mod:`rl_bridge.placement` and the process backends
:mod:`rl_bridge.backends`."""
