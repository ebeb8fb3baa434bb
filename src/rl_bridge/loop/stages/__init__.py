"""The stages of a GRPO step, each a module with its own metrics, shared by the sync and async loops.

In step order: :mod:`.rollout` (G samples of each prompt through the Gym agent), :mod:`.preprocess`
(policy tensors, the placeholder check and group advantages), :mod:`.logprobs` (``pi_old`` and the
reference policy's when the step needs them), :mod:`.train` (the optimizer steps), :mod:`.refit`
(vLLM serves the new weights; colocated vLLM sleeps while the policy computes) and
:mod:`.validate` (greedy held-out accuracy). :class:`rl_bridge.loop.step.Stages` builds them for a
run and :func:`rl_bridge.loop.step.learn` chains the ones after collection.
"""
