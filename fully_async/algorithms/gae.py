"""PPO with a critic (algorithm.adv_estimator=gae), the algorithm side (layer 1): token-level rewards, Generalized
Advantage Estimation and the clipped value loss, with verl's formulas (core_algos.compute_gae_advantage_return,
compute_value_loss; tests/unit/algorithms/test_gae.py checks them against vectors made by verl's own functions).

Tensors are (B, L) over the whole padded sequence with a response mask (core/batch.py's layout), not verl's
(B, response_length) slice: GAE skips masked positions (their value and TD error carry through), so prompt and
padding positions change nothing on the response positions, which are the only ones anything reads.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from fully_async.algorithms.actor_loss import ActorLossOutput
from fully_async.algorithms.losses import agg_denominator, agg_loss

VALUE_METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl_F.masked_mean over all elements (its 1e-8 guard included)."""
    return torch.where(mask.bool(), values, 0.0).sum() / (mask.sum() + 1e-8)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl_F.masked_whiten: zero mean, unit (Bessel-corrected) variance over the masked elements."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    count = mask.sum()
    if count < 2:
        raise ValueError(f"GAE whitens advantages over the batch's response tokens and needs at least 2 (got "
                         f"{int(count)})")
    var = var * count / (count - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


@torch.no_grad()
def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                   lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages whitened over the batch's response tokens, returns = raw advantages + values), both (B, L).

    Backwards over positions: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, where
    "next" skips masked positions (their value and advantage carry through unchanged)."""
    mask = mask.float()
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_gae = gae * mask[:, t] + (1 - mask[:, t]) * last_gae
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, mask), returns


def value_loss_denominator(mask: torch.Tensor, critic: Any, max_response_length: int) -> float:
    """The `denom` every micro-batch of a critic mini-batch (response mask `mask`) passes to value_loss: its
    tokens or sequences by critic.loss_agg_mode (seq-mean-token-sum-norm's constant: data.max_response_length)."""
    return agg_denominator(mask, critic.loss_agg_mode, max_response_length)


def value_loss(vpreds: torch.Tensor, *, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float, loss_agg_mode: str, denom: Optional[float] = None,
               share: float = 1.0) -> ActorLossOutput:
    """The clipped value loss of one micro-batch: 0.5 x agg(max((V - R)^2, (clip(V, V_old +- c) - R)^2)),
    aggregated with loss_agg_mode over the mini-batch denominator `denom` (as the actor's loss; None: this
    micro-batch's own), so micro-batch losses sum to the mini-batch loss.  Metrics (additive over the
    micro-batches): critic/vf_loss, and critic/vf_clipfrac and critic/vpred_mean (token means of this micro-batch)
    weighted by `share`, its fraction of the mini-batch's rows."""
    clipped = torch.max(torch.min(vpreds, old_values + cliprange_value), old_values - cliprange_value)
    loss1 = (vpreds - returns) ** 2
    loss2 = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.max(loss1, loss2), mask, loss_agg_mode, denom)
    clipfrac = masked_mean(torch.gt(loss2, loss1).float(), mask)
    metrics = {"critic/vf_loss": (loss.detach(), 1.0), "critic/vf_clipfrac": (clipfrac.detach(), share),
               "critic/vpred_mean": (masked_mean(vpreds.detach(), mask), share)}
    return ActorLossOutput(loss=loss, metrics=metrics)


def value_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's critic/values/*, critic/returns/* and critic/vf_explained_var over the response tokens of a batch
    (the values the critic gave before its update)."""
    keep = mask.bool()
    v, r = values[keep].float(), returns[keep].float()
    if not v.numel():
        return {}
    out = {"critic/returns/mean": float(r.mean()), "critic/returns/max": float(r.max()),
           "critic/returns/min": float(r.min()), "critic/values/mean": float(v.mean()),
           "critic/values/max": float(v.max()), "critic/values/min": float(v.min())}
    if v.numel() > 1:
        out["critic/vf_explained_var"] = float(1.0 - torch.var(r - v) / (torch.var(r) + 1e-5))
    return out

