"""GRPO maths: group advantages, the clipped policy-gradient loss, KL, importance sampling, mismatch.

Pure torch functions with documented shapes; nothing here touches a model, a process group or a
service. Shape letters: ``B`` sequences (samples) in a batch, ``T`` token positions per sequence
(padded), ``V`` vocabulary, ``G`` samples per group (one prompt's generations).

Three log-probability tensors of the generated tokens meet in the loss, as in decoupled PPO
(Hilton et al., "Batch size-invariance for policy optimization", 2021; AReaL uses it for async RL):

- ``behaviour_logprobs``: what vLLM returned when it sampled the tokens (policy ``mu``). In async
  training ``mu`` is an older version of the weights, and even in sync training vLLM's numerics
  differ from the trainer's.
- ``old_logprobs``: the trainer's own logprobs with the weights at the start of the rollout
  batch's updates (the proximal policy ``pi_old``). With several optimizer steps per rollout
  batch (PPO mini-batches or epochs) they come from a separate forward pass before the first
  update; with one step they are the training forward's own detached logprobs (the same values,
  one forward fewer), which is what ``old_logprobs=None`` means with
  ``proximal_policy="trainer"``.
- ``logprobs``: the trainer's current policy ``pi_theta``, the only tensor with a gradient.

The PPO ratio ``pi_theta / pi_old`` is clipped (trust region around the proximal policy); the
importance-sampling weight ``pi_old / mu`` (detached, truncated at ``tis_cap``) corrects for the
tokens having been sampled from ``mu``; and the train/inference mismatch metrics compare ``mu``
with the trainer's ``pi_old``. With ``proximal_policy="behaviour"`` vLLM's ``mu`` is itself the
proximal policy (decoupled PPO's "bypass" mode, as in AReaL and verl): the ratio
``pi_theta / mu`` is clipped and there is no separate IS weight.

Aggregation (``loss_agg_mode``) follows verl's names; numerator and denominator always run over
the same tokens (those of sequences with a positive weight), and the denominator of a step split
into micro-batches and data-parallel ranks is the sum of :func:`loss_denominator` over all of them,
so the loss and its gradient do not depend on the split.

Modules: :mod:`.config` (:class:`GRPOLossConfig`), :mod:`.advantages` (group advantages),
:mod:`.mismatch` (train/inference mismatch statistics), :mod:`.loss` (the loss, its denominator,
KL estimators). The trainer's per-token logprobs are
:func:`rl_bridge.megatron.logprobs.token_logprobs`.
"""

from rl_bridge.grpo.advantages import GroupAdvantages, group_advantages
from rl_bridge.grpo.config import GRPOLossConfig, KLEstimator, LossAggMode, ProximalPolicy, needs_reference
from rl_bridge.grpo.loss import grpo_loss, kl_estimate, loss_denominator
from rl_bridge.grpo.mismatch import MismatchStats, mismatch_exceeds, train_inference_mismatch

__all__ = [
    "GRPOLossConfig",
    "GroupAdvantages",
    "KLEstimator",
    "LossAggMode",
    "MismatchStats",
    "ProximalPolicy",
    "group_advantages",
    "grpo_loss",
    "kl_estimate",
    "loss_denominator",
    "mismatch_exceeds",
    "needs_reference",
    "train_inference_mismatch",
]
