"""The GRPO loops, in the trainer's driver process.

:mod:`.sync` and :mod:`.async_grpo` are the two loops; both run the stages of
:mod:`.stages` through :mod:`.step` and differ in how they collect rollouts (:mod:`.collect`;
the async collector threads and replay buffer: :mod:`.collector`, :mod:`.replay`, with
:mod:`.checkpoints` for resuming) and in when weights move. :mod:`.run` is what both do around
their steps (setup, warm start :mod:`.warm_start`, validation and progress :mod:`.report`,
metrics and curves :mod:`.metrics`, the run directory :mod:`.rundir`). The recipe is
:mod:`rl_bridge.recipe`, the task's data :mod:`rl_bridge.tasks`, the placement planner
:mod:`rl_bridge.placement` and the processes :mod:`rl_bridge.backends`.
"""
