"""The GRPO advantages' and loss's settings (:class:`GRPOLossConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

__all__ = ["GRPOLossConfig", "KLEstimator", "LossAggMode", "ProximalPolicy", "needs_reference"]

KLEstimator = Literal["k1", "k2", "k3"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
ProximalPolicy = Literal["trainer", "behaviour"]


class GRPOLossConfig(BaseModel):
    """Every knob of the GRPO advantages and loss. Frozen; unknown fields are rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    normalize_std: bool = True
    """Divide each group's advantages by the group's reward std (Bessel-corrected, valid samples
    only) plus ``std_eps``, as in GRPO. False keeps the raw ``reward - baseline``: one half of
    Dr. GRPO (Liu et al. 2025); its other half is ``loss_agg_mode="seq-mean-token-sum-norm"``."""
    leave_one_out: bool = False
    """Baseline each sample with the mean of the *other* valid samples of its group (RLOO,
    Ahmadian et al. 2024) instead of the group mean including itself."""
    std_eps: float = Field(default=1e-6, ge=0.0)
    """Added to the group std before dividing, in reward units."""

    eps_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Lower clip: the ratio ``pi_theta / pi_old`` is clipped below at ``1 - eps_low``."""
    eps_high: float = Field(default=0.28, ge=0.0)
    """Upper clip: the ratio is clipped above at ``1 + eps_high``. Defaults to DAPO's
    "clip-higher" value (Yu et al. 2025), which keeps low-probability tokens able to grow."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses ``l[i, t]`` of sequences ``i`` (weights ``w_i``, ``n_i`` valid tokens)
    become a scalar; names and meanings as in verl's ``agg_loss``:

    - ``"token-mean"``: ``sum_i w_i sum_t l / sum_i w_i n_i``: every token weighs the same, over
      the whole step (DAPO, Yu et al. 2025; TRL's ``loss_type="dapo"``);
    - ``"seq-mean-token-mean"``: ``sum_i w_i (sum_t l / n_i) / sum_i w_i``: every sequence weighs
      the same (the original GRPO, Shao et al. 2024; TRL's ``loss_type="grpo"``);
    - ``"seq-mean-token-sum"``: ``sum_i w_i sum_t l / sum_i w_i``: longer sequences weigh more;
    - ``"seq-mean-token-sum-norm"``: ``sum_i w_i sum_t l / (L * sum_i w_i)`` with the constant
      ``L = loss_norm_tokens``: Dr. GRPO's length-unbiased normaliser (Liu et al. 2025; TRL's
      ``loss_type="dr_grpo"``), paired with ``normalize_std=False`` for the whole of Dr. GRPO.
    """
    loss_norm_tokens: PositiveInt | None = None
    """The constant ``L`` of ``seq-mean-token-sum-norm`` (Dr. GRPO uses the generation budget, the
    most tokens a response may have); required by that mode, unused by the others."""
    proximal_policy: ProximalPolicy = "trainer"
    """The policy the PPO ratio is taken against. ``"trainer"``: ``pi_old``, the trainer's own
    logprobs before the rollout batch's first update, with the truncated IS weight ``pi_old / mu``
    for the tokens having been sampled by vLLM (standard PPO/GRPO). ``"behaviour"``: vLLM's
    logprobs ``mu`` (decoupled PPO's bypass mode, for async runs whose groups are several weight
    versions old): the clipped ratio ``pi_theta / mu`` corrects for the staleness itself, no IS
    weight is applied and no recomputation of ``pi_old`` is ever needed."""

    kl_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the KL penalty to the reference policy. 0 disables it and the reference
    logprobs are then not needed at all (see :func:`needs_reference`)."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL estimator, see :func:`~rl_bridge.grpo.loss.kl_estimate`."""

    entropy_coef: float = Field(default=0.0, ge=0.0)
    """Weight of an entropy bonus: ``loss -= entropy_coef * agg(H)``, with ``H`` each trained
    token's entropy (nats) of the distribution it was sampled from (after temperature, over the
    sampling support and grammar masks), aggregated like the policy gradient. It keeps the policy
    from turning deterministic before the reward has taught it (PPO's entropy term, Schulman et al.
    2017; verl's ``entropy_coeff``). A departure from the textbook GRPO loss, off by default;
    ``loss/entropy`` is reported whether or not it is on."""

    use_importance_sampling: bool = True
    """With ``proximal_policy="trainer"``, weight each token's policy-gradient term by
    ``pi_old / mu`` when vLLM's ``behaviour_logprobs`` are given (off-policy correction for
    async samples and for vLLM/trainer numerics). The KL term is never IS-weighted."""
    tis_cap: float | None = Field(default=2.0, gt=0.0)
    """Truncate the importance weight at this value (truncated IS, "TIS"); None: no truncation."""

    seq_mismatch_threshold: float | None = Field(default=None, gt=1.0)
    """Mask (loss weight 0) every sequence whose sequence multiplicative probability error
    ``exp(|sum_t (trainer - vLLM logprob)|)`` exceeds this, before the step (the loop counts them
    in ``mismatch/masked_seqs``; masked sequences leave numerator and denominator alike: see
    :func:`~rl_bridge.grpo.mismatch.mismatch_exceeds`); None: only log the error. A departure from
    the textbook loss, off by default."""

    @model_validator(mode="after")
    def _check(self) -> GRPOLossConfig:
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_norm_tokens is None:
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' divides by a constant token count: set "
                "loss_norm_tokens (Dr. GRPO uses the generation budget, rollout.max_output_tokens)"
            )
        return self


def needs_reference(config: GRPOLossConfig) -> bool:
    """Whether the loop must compute reference-policy logprobs for this config (``kl_coef > 0``)."""
    return config.kl_coef > 0
