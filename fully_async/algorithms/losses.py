"""PPO policy loss, KL estimators, entropy and loss aggregation (verl's core_algos semantics).

Names follow AReaL: `logp` is the current policy being optimised, `old_logp` the PPO "old"
(proximal) policy the ratio is taken against, `behav_logp` the policy that actually sampled the
tokens.  With `use_rollout_log_probs=true` old == behaviour.  Decoupled PPO recomputes `old_logp`
on the trainer and multiplies each token's loss by the truncated importance weight
`min(exp(old_logp - behav_logp), cap)`.

Aggregation is written so that splitting a mini-batch into micro-batches and summing
`agg_loss(..., denom=...)` over them equals the loss of the whole mini-batch: the denominator
(tokens or sequences of the *mini-batch*) is passed in, not taken from the micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_denominator(mask: torch.Tensor, mode: str, scale_factor: Optional[float] = None) -> float:
    """The denominator of a whole mini-batch (passed as `denom` to each micro-batch's agg_loss): its tokens
    (token-mean), 1 (token-sum), its sequences with at least one token (seq-mean-*), times the constant
    `scale_factor` for seq-mean-token-sum-norm (actor.loss_scale_factor, by default data.max_response_length;
    without one the padded response width, as verl)."""
    if mode == "token-mean":
        return float(mask.sum())
    if mode == "token-sum":
        return 1.0
    sequences = float((mask.sum(-1) > 0).sum())
    if mode == "seq-mean-token-sum-norm":
        return sequences * float(scale_factor if scale_factor else mask.shape[-1])
    return sequences


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, denom: Optional[float] = None) -> torch.Tensor:
    """Aggregate per-token losses (B, T), as verl 0.9's core_algos.agg_loss (one data-parallel rank, the whole
    mini-batch as one micro-batch):

    token-mean:              sum over all tokens / number of tokens
    token-sum:               sum over all tokens
    seq-mean-token-sum:      sum over tokens of each sequence, mean over sequences
    seq-mean-token-mean:     mean over tokens of each sequence, mean over sequences
    seq-mean-token-sum-norm: seq-mean-token-sum / a constant (Dr. GRPO; verl's loss_scale_factor, by default the
                             response length)
    Sequences without a token are not counted.  `denom` overrides the count (tokens for token-mean, sequences
    for seq-mean-*, sequences x the constant for -norm) for micro-batching (agg_denominator).
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / (denom if denom is not None else mask.sum().clamp(min=1))
    if mode == "token-sum":
        return (loss_mat * mask).sum() / (denom if denom is not None else 1.0)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        per_seq = (loss_mat * mask).sum(-1)
    elif mode == "seq-mean-token-mean":
        per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    else:
        raise ValueError(f"loss_agg_mode {mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")
    has_tokens = (mask.sum(-1) > 0).to(loss_mat.dtype)
    if denom is None:
        denom = has_tokens.sum().clamp(min=1)
        if mode == "seq-mean-token-sum-norm":
            denom = denom * mask.shape[-1]
    return (per_seq * has_tokens).sum() / denom


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimators (Schulman's k1/k2/k3).  A trailing "+" (k1+, k3+, low_var_kl+, ...,
    verl's straight-through variants) keeps the estimator's value but takes the gradient of k2, whose expected
    gradient is the true KL gradient (k1's and k3's are not)."""
    if kind.endswith("+"):
        value = _kl_value(logp, ref_logp, kind[:-1])
        if kind in ("mse+", "k2+"):
            return value
        k2 = 0.5 * (logp - ref_logp).square()
        return k2 - k2.detach() + value.detach()
    return _kl_value(logp, ref_logp, kind)


def _kl_value(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    diff = logp - ref_logp
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        kl = (ref_logp - logp).clamp(-20, 20)
        return (kl.exp() - kl - 1).clamp(-10, 10)
    raise ValueError(f"kl type {kind!r} is not one of kl/k1, abs, mse/k2, low_var_kl/k3 (each also with a "
                     "trailing '+': straight-through k2 gradient)")


@dataclass
class PolicyLossInput:
    logp: torch.Tensor                   # (B, T) current policy
    old_logp: torch.Tensor               # (B, T) PPO old / proximal policy
    advantages: torch.Tensor             # (B, T)
    mask: torch.Tensor                   # (B, T) 1 on response tokens
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float = 3.0
    agg_mode: str = "token-mean"
    denom: Optional[float] = None        # mini-batch token/sequence count (see agg_loss)
    behav_logp: Optional[torch.Tensor] = None  # (B, T) set for decoupled PPO
    behav_cap: float = 5.0
    is_weights: Optional[torch.Tensor] = None  # (B, T) rollout correction's weights (rollout_correction.py)


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    clipfrac: torch.Tensor
    clipfrac_lower: torch.Tensor
    ppo_kl: torch.Tensor
    behav_weight_mean: Optional[torch.Tensor] = None


def policy_loss(inp: PolicyLossInput) -> PolicyLossOutput:
    """Clipped PPO surrogate with dual clip (verl `compute_policy_loss_vanilla`)."""
    mask = inp.mask.to(inp.logp.dtype)
    neg_kl = (inp.logp - inp.old_logp).clamp(-20.0, 20.0)
    ratio = neg_kl.exp()
    adv = inp.advantages
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - inp.clip_low, 1.0 + inp.clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -adv * inp.clip_c
    dual = torch.minimum(loss3, clipped)
    losses = torch.where(adv < 0, dual, clipped)
    behav_mean = None
    if inp.behav_logp is not None:
        weight = (inp.old_logp - inp.behav_logp).clamp(-20.0, 20.0).exp().clamp(max=inp.behav_cap).detach()
        losses = losses * weight
        behav_mean = masked_mean(weight, mask).detach()
    if inp.is_weights is not None:
        losses = losses * inp.is_weights
    return PolicyLossOutput(
        loss=agg_loss(losses, mask, inp.agg_mode, inp.denom),
        clipfrac=masked_mean((loss2 > loss1).float(), mask).detach(),
        clipfrac_lower=masked_mean(((clipped > loss3) & (adv < 0)).float(), mask).detach(),
        ppo_kl=masked_mean(-neg_kl, mask).detach(),
        behav_weight_mean=behav_mean,
    )
