"""Trainer side of video GRPO: Gym trajectories to policy tensors, GRPO math, Megatron updates, loops.

The pure-logic modules import without vLLM or NeMo Gym installed.
"""

__version__ = "0.1.0"
