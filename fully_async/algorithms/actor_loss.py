"""The PPO actor objective of one micro-batch, and its metrics: the one place both training backends take it from.

    loss = pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss

`pg_loss` is the surrogate of `policy_loss.loss_mode` (policy_losses.py: vanilla is the clipped dual-clip PPO
loss), weighted by the truncated decoupled-PPO importance weight when `async_training.decoupled_ppo`, over the
mini-batch denominator of its own aggregation `pg_denom`; `entropy` and `kl_loss`
(`kl_penalty(logp, ref_logp, kl_loss_type)`) are aggregated with `loss_agg_mode` over the mini-batch
denominator `denom` (see `agg_loss`), so micro-batch losses sum to the mini-batch loss.

Metrics (names in `actor_metric_names` order) are additive over the micro-batches of a mini-batch
(and over data-parallel ranks): the aggregated terms already are (pg_loss, entropy, kl_loss), the
per-token means (pg_clipfrac, pg_clipfrac_lower, ppo_kl, behav_imp_weight) are weighted by the
micro-batch's share of the mini-batch's rows.  Each metric is kept as (detached tensor, weight) so
a backend can read it as a Python float (`metric_floats`, one host sync per metric), as float64 scalars on the
device (`metric_doubles`: the same arithmetic, summed over micro-batches and read once) or as one device tensor
(`metric_tensor`, no sync) with the same rounding as before the two were merged.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import torch

from fully_async.algorithms.losses import agg_denominator, agg_loss, kl_penalty
from fully_async.algorithms.policy_losses import (PolicyLossInput, policy_agg_mode, policy_denominator, policy_loss,
                                                  reinforce_loss)
from fully_async.algorithms.rollout_correction import active as correction_active, correct_batch
from fully_async.core.config import clip_bounds

BYPASS_RS_METRIC = "rollout_corr/rollout_rs_masked_fraction"


def bypass_correction(rollout_correction: Any) -> bool:
    """verl's bypass mode with rollout_is or rollout_rs set: importance weights (applied by loss_type=reinforce,
    reported otherwise), rejection and the rollout_corr/* metrics computed in the loss, on every micro-batch, of the
    current policy against the behaviour one (verl's compute_policy_loss_bypass_mode)."""
    rc = rollout_correction
    return rc is not None and bool(rc.bypass_mode) and correction_active(rc)


@functools.lru_cache(maxsize=32)
def _bypass_metric_names(rollout_is: Any, threshold: Any, normalize: bool, rollout_rs: Any,
                         rs_threshold: Any) -> tuple[str, ...]:
    """The rollout_corr/* keys bypass mode reports for these options (they depend on the options only: found by
    running the correction once on two fixed responses)."""
    rc = SimpleNamespace(rollout_is=rollout_is, rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize,
                         rollout_rs=rollout_rs, rollout_rs_threshold=rs_threshold)
    old = torch.tensor([[-0.5, -1.0, -0.2], [-0.3, -0.7, -1.1]])
    return tuple(sorted(correct_batch(old, old - 0.1, torch.ones_like(old), rc)[2]))


def bypass_metric_names(rc: Any) -> tuple[str, ...]:
    """rollout_corr/* names of bypass mode (sorted; empty without bypass_correction)."""
    if not bypass_correction(rc):
        return ()
    rs_thr = rc.rollout_rs_threshold
    return _bypass_metric_names(rc.rollout_is, rc.rollout_is_threshold, bool(rc.rollout_is_batch_normalize),
                                rc.rollout_rs, rs_thr if not isinstance(rs_thr, list) else ",".join(map(str, rs_thr)))


def bypass_reinforce(rollout_correction: Any) -> bool:
    """verl's bypass mode with loss_type=reinforce: REINFORCE with explicit importance weights instead of the clipped
    surrogate."""
    rc = rollout_correction
    return rc is not None and bool(rc.bypass_mode) and rc.loss_type == "reinforce"


def mini_batch_denominator(mask: torch.Tensor, actor: Any) -> float:
    """The `denom` every micro-batch of a mini-batch (response mask `mask`) passes to actor_loss; 1 for a mini-batch
    without a token (every one rejected by algorithm.rollout_correction.rollout_rs), whose loss is then 0, not 0/0."""
    denom = agg_denominator(mask, actor.loss_agg_mode, actor.loss_scale_factor)
    return denom if denom > 0 else 1.0


def mini_batch_policy_denominator(mask: torch.Tensor, actor: Any) -> float:
    """The `pg_denom` every micro-batch of a mini-batch passes to actor_loss: the denominator of the policy loss
    mode's own aggregation (gspo/sapo: sequences, geo_mean: rows; the others: loss_agg_mode's); 1 without a token,
    as mini_batch_denominator."""
    denom = policy_denominator(mask, actor.policy_loss.loss_mode, actor.loss_agg_mode, actor.loss_scale_factor)
    return denom if denom > 0 else 1.0


def decoupled_weights(async_training: Any, rollout_correction: Any) -> bool:
    """Decoupled PPO weights each token by its truncated behaviour->proximal ratio, unless rollout correction's
    importance weights (rollout_is, decoupled mode) are on: those replace it (verl's compute_prox_log_prob)."""
    rc = rollout_correction
    return bool(async_training.decoupled_ppo) and (rc is None or rc.rollout_is is None or rc.bypass_mode)


def actor_metric_names(actor: Any, async_training: Any, with_entropy: bool = True,
                       rollout_correction: Any = None) -> list[str]:
    """The metric keys `actor_loss` returns for this config, in order."""
    names = ["actor/pg_loss"] + ["actor/entropy"] * with_entropy
    names += ["actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"]
    names += ["actor/behav_imp_weight"] * decoupled_weights(async_training, rollout_correction)
    names += list(bypass_metric_names(rollout_correction))
    names += ["actor/kl_loss"] * bool(actor.use_kl_loss)
    return names


@dataclass
class ActorLossOutput:
    loss: torch.Tensor                                    # scalar, with the graph: backward() this
    metrics: dict[str, tuple[torch.Tensor, float]] = field(default_factory=dict)  # name -> (value, weight)

    def metric_floats(self) -> dict[str, float]:
        """name -> value * weight as Python floats (the weight applied in double precision)."""
        return {name: value.item() * weight for name, (value, weight) in self.metrics.items()}

    def metric_doubles(self) -> dict[str, torch.Tensor]:
        """name -> value * weight as float64 scalars where the values are (the same arithmetic as metric_floats,
        without waiting for them)."""
        return {name: torch.as_tensor(value).detach().double() * weight
                for name, (value, weight) in self.metrics.items()}

    def metric_tensor(self) -> torch.Tensor:
        """(len(metrics),) float32 tensor of value * weight, in `actor_metric_names` order, on the values' device."""
        return torch.stack([value.float() * weight for value, weight in self.metrics.values()])


def actor_loss(logp: torch.Tensor, entropy: Optional[torch.Tensor], *, old_logp: torch.Tensor,
               advantages: torch.Tensor, mask: torch.Tensor, denom: Optional[float], rows_total: int, actor: Any,
               async_training: Any, ref_logp: Optional[torch.Tensor] = None,
               rollout_logp: Optional[torch.Tensor] = None, pg_denom: Optional[float] = None,
               is_weights: Optional[torch.Tensor] = None, rollout_correction: Any = None) -> ActorLossOutput:
    """PPO actor loss of one micro-batch of B rows.

    logp, entropy: (B, T) under the current policy (entropy may be None when actor.entropy_coeff == 0;
    the actor/entropy metric is then left out).  old_logp, advantages, mask: (B, T); ref_logp is needed
    with actor.use_kl_loss, rollout_logp (behaviour) with async_training.decoupled_ppo.  denom: the
    mini-batch's token (token-mean) or sequence count (None: this micro-batch's own); rows_total: the
    mini-batch's rows (metric shares).  pg_denom: the policy loss's mini-batch denominator
    (mini_batch_policy_denominator); None: `denom` when the mode aggregates with loss_agg_mode, else this
    micro-batch's own.  is_weights: (B, T) rollout correction's importance weights (decoupled mode, computed once
    per step); rollout_correction: algorithm.rollout_correction, read for bypass-mode rejection (which needs
    rollout_logp).
    actor: the actor_rollout_ref.actor section; async_training: that section."""
    a, at = actor, async_training
    if entropy is None and a.entropy_coeff != 0:
        raise ValueError("actor_loss needs the entropy when actor.entropy_coeff != 0")
    if a.use_kl_loss and ref_logp is None:
        raise ValueError("actor_loss needs ref_logp when actor.use_kl_loss is set")
    if at.decoupled_ppo and rollout_logp is None:
        raise ValueError("actor_loss needs rollout_logp when async_training.decoupled_ppo is set")
    clip_low, clip_high = clip_bounds(a)
    bypass_weights, bypass_metrics = None, None
    if bypass_correction(rollout_correction):
        if rollout_logp is None:
            raise ValueError("actor_loss needs rollout_logp for rollout_correction.bypass_mode")
        bypass_metrics = {name: 0.0 for name in bypass_metric_names(rollout_correction)}
        if mask.any():
            bypass_weights, kept, found = correct_batch(logp.detach(), rollout_logp, mask, rollout_correction)
            bypass_metrics.update((k, v) for k, v in found.items() if k in bypass_metrics)
            mask = kept.to(mask.dtype)
    pl = a.policy_loss
    if pg_denom is None and policy_agg_mode(pl.loss_mode, a.loss_agg_mode) == a.loss_agg_mode:
        pg_denom = denom
    if bypass_reinforce(rollout_correction):
        if rollout_logp is None:
            raise ValueError("actor_loss needs rollout_logp for rollout_correction.loss_type=reinforce")
        res = reinforce_loss(logp, rollout_logp, advantages, mask, bypass_weights, a.loss_agg_mode, pg_denom)
    else:
        res = policy_loss(PolicyLossInput(
            logp=logp, old_logp=old_logp, advantages=advantages, mask=mask,
            clip_low=clip_low, clip_high=clip_high, clip_c=a.clip_ratio_c, agg_mode=a.loss_agg_mode,
            denom=pg_denom, behav_logp=rollout_logp if at.decoupled_ppo and is_weights is None else None,
            behav_cap=at.behav_imp_weight_cap,
            is_weights=is_weights, mode=pl.loss_mode, clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb,
            clip_cov_ub=pl.clip_cov_ub, kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef, tau_pos=a.tau_pos,
            tau_neg=a.tau_neg, dro_beta=pl.dro_beta))
    loss = res.loss
    share = logp.shape[0] / rows_total
    metrics: dict[str, tuple[torch.Tensor, float]] = {"actor/pg_loss": (res.loss.detach(), 1.0)}
    if entropy is not None:
        ent = agg_loss(entropy, mask, a.loss_agg_mode, denom)
        if a.entropy_coeff != 0:
            loss = loss - a.entropy_coeff * ent
        metrics["actor/entropy"] = (ent.detach(), 1.0)
    metrics["actor/pg_clipfrac"] = (res.clipfrac, share)
    metrics["actor/pg_clipfrac_lower"] = (res.clipfrac_lower, share)
    metrics["actor/ppo_kl"] = (res.ppo_kl, share)
    if res.behav_weight_mean is not None:
        metrics["actor/behav_imp_weight"] = (res.behav_weight_mean, share)
    for name, value in (bypass_metrics or {}).items():
        metrics[name] = (torch.tensor(value, dtype=torch.float32, device=logp.device), share)
    if a.use_kl_loss:
        kl = agg_loss(kl_penalty(logp, ref_logp, a.kl_loss_type), mask, a.loss_agg_mode, denom)
        loss = loss + a.kl_loss_coef * kl
        metrics["actor/kl_loss"] = (kl.detach(), 1.0)
    return ActorLossOutput(loss=loss, metrics=metrics)

