"""The policy-loss family (actor_rollout_ref.actor.policy_loss.loss_mode), as verl's core_algos computes each mode.

`policy_loss(inp)` looks the mode up in `POLICY_LOSSES` and returns the aggregated surrogate and its metrics
(pg_clipfrac, pg_clipfrac_lower, ppo_kl: 0 where a mode has no such notion, as verl reports them).  The ratio of
every mode is taken against `old_logp`, the PPO old (proximal) policy.

  vanilla   PPO clip with dual clip (clip_ratio_low/high, clip_ratio_c), aggregated by loss_agg_mode.
  gspo      sequence-level ratio exp(mean over the response of log(pi/pi_old)) carried on each token with the
            token's own gradient, clipped like PPO (no dual clip); aggregated by loss_agg_mode (verl 0.9.1; the
            paper's and older verl's fixed seq-mean-token-mean is loss_agg_mode=seq-mean-token-mean).
  sapo      soft gate sigmoid(tau (ratio - 1)) * 4 / tau times the advantage, tau = tau_pos where A > 0, else
            tau_neg; always aggregated seq-mean-token-mean.
  gpg       -logp * A (plain policy gradient, no ratio), aggregated by loss_agg_mode.
  clip_cov  PPO clip, plus: of the tokens PPO did not clip whose centred advantage x log-prob covariance lies in
            (clip_cov_lb, clip_cov_ub), clip_cov_ratio of all response tokens (at least one) drawn at random lose
            their gradient (torch's global RNG, as verl); pg_clipfrac is the fraction detached.
  kl_cov    -A * ratio, plus ppo_kl_coef * |log ratio| on the kl_cov_ratio of tokens (at least one) with the
            largest covariance; ppo_kl is the mean |log ratio|, as verl reports it.
  geo_mean  GMPO: exp(mean over the response of the token log-ratios clipped to [-clip_low, clip_high] on the
            advantage's side) times the sequence's mean advantage; the mean over the mini-batch's rows
            (loss_agg_mode is not used, as in verl).
  cispo     -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * logp, aggregated by loss_agg_mode.
  dppo_tv   DPPO-Binary-TV: -A * sg(min(ratio, clip_ratio_c)) * logp on the tokens whose probability moved less than
            the divergence bound (pi - pi_old <= clip_high where A > 0, >= -clip_low elsewhere), 0 on the others;
            clip_ratio_low/high are the TV bounds and clip_ratio_c the truncation of the ratio (no dual clip).
            pg_clipfrac: the tokens left out; pg_clipfrac_lower: kept tokens whose ratio was truncated.
  dppo_kl   the same with the binary KL of the token's probability as the divergence: a token is left out where
            KL(pi_old || pi) exceeds the bound and the probability moved in the advantage's direction.
  dro       Direct Reward Optimisation: -(A * logp - dro_beta / 2 * (logp - old_logp)^2), by loss_agg_mode.

The covariance modes select tokens within the micro-batch they see, as verl's per-micro-batch call does; every
other mode's aggregate splits exactly over micro-batches (the mini-batch denominator `denom`:
`policy_denominator`).

Decoupled PPO (async_training.decoupled_ppo): `behav_logp` given, each token's loss is multiplied by the truncated
importance weight w = min(exp(old_logp - behav_logp), behav_cap) (detached), the place verl applies its
rollout_is_weights: per token in every mode but geo_mean, which weighs each sequence by the geometric mean of its
tokens' weights (as verl's geo_mean does).  The mode's own ratio stays proximal-vs-current, so the clipping (or
gating) bounds the step from the proximal policy and w corrects for the behaviour policy that sampled.  With
async_training.use_rollout_log_probs and no decoupled PPO, old_logp is the behaviour policy and w is not applied.
algorithm.rollout_correction's importance weights (`is_weights`, computed once per step) are applied at the same
place, the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fully_async.algorithms.losses import agg_denominator, agg_loss, masked_mean

ROWS = "rows"                                    # geo_mean: the mean over the mini-batch's rows
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
_OWN_AGGREGATION = {"sapo": SEQ_MEAN_TOKEN_MEAN, "geo_mean": ROWS}


def policy_agg_mode(loss_mode: str, loss_agg_mode: str) -> str:
    """How `loss_mode` aggregates its token losses: its own fixed mode (sapo, geo_mean) or loss_agg_mode."""
    return _OWN_AGGREGATION.get(loss_mode, loss_agg_mode)


def policy_denominator(mask: torch.Tensor, loss_mode: str, loss_agg_mode: str,
                       scale_factor: Optional[float] = None) -> float:
    """The mini-batch denominator (response mask `mask`) every micro-batch passes as PolicyLossInput.denom."""
    mode = policy_agg_mode(loss_mode, loss_agg_mode)
    return float(mask.shape[0]) if mode == ROWS else agg_denominator(mask, mode, scale_factor)


@dataclass
class PolicyLossInput:
    logp: torch.Tensor                   # (B, T) current policy
    old_logp: torch.Tensor               # (B, T) PPO old / proximal policy
    advantages: torch.Tensor             # (B, T)
    mask: torch.Tensor                   # (B, T) 1 on response tokens
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float = 3.0
    agg_mode: str = "token-mean"         # actor.loss_agg_mode (sapo and geo_mean use their own)
    denom: Optional[float] = None        # mini-batch denominator of the mode's aggregation (policy_denominator)
    behav_logp: Optional[torch.Tensor] = None  # (B, T) set for decoupled PPO
    behav_cap: float = 5.0
    is_weights: Optional[torch.Tensor] = None  # (B, T) rollout correction's weights (rollout_correction.py)
    mode: str = "vanilla"                # policy_loss.loss_mode
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    dro_beta: Optional[float] = None


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    clipfrac: torch.Tensor
    clipfrac_lower: torch.Tensor
    ppo_kl: torch.Tensor
    behav_weight_mean: Optional[torch.Tensor] = None


def _weighted(losses: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    return losses if weight is None else losses * weight


def _out(loss: torch.Tensor, clipfrac: torch.Tensor, clipfrac_lower: torch.Tensor,
         ppo_kl: torch.Tensor) -> PolicyLossOutput:
    return PolicyLossOutput(loss=loss, clipfrac=clipfrac.detach(), clipfrac_lower=clipfrac_lower.detach(),
                            ppo_kl=ppo_kl.detach())


def reinforce_loss(logp: torch.Tensor, behav_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   is_weights: Optional[torch.Tensor], agg_mode: str, denom: Optional[float]) -> PolicyLossOutput:
    """verl's bypass-mode REINFORCE (rollout_correction.loss_type=reinforce, core_algos.compute_policy_loss_reinforce):
    -A log pi per token, times the truncated importance weight pi / pi_behaviour when rollout_is is set (detached),
    no clipping; ppo_kl is the mean of behaviour - current log-probs."""
    losses = -advantages * logp
    if is_weights is not None:
        losses = losses * is_weights
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return _out(agg_loss(losses, mask, agg_mode, denom), zero, zero, masked_mean(behav_logp - logp.detach(), mask))


def _zero(inp: PolicyLossInput) -> torch.Tensor:
    return torch.zeros((), dtype=inp.logp.dtype, device=inp.logp.device)


def _vanilla(inp: PolicyLossInput, mask: torch.Tensor, weight: Optional[torch.Tensor]) -> PolicyLossOutput:
    """Clipped PPO surrogate with dual clip (verl `compute_policy_loss_vanilla`)."""
    neg_kl = (inp.logp - inp.old_logp).clamp(-20.0, 20.0)
    ratio = neg_kl.exp()
    adv = inp.advantages
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - inp.clip_low, 1.0 + inp.clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -adv * inp.clip_c
    dual = torch.minimum(loss3, clipped)
    losses = _weighted(torch.where(adv < 0, dual, clipped), weight)
    return _out(agg_loss(losses, mask, inp.agg_mode, inp.denom), masked_mean((loss2 > loss1).float(), mask),
                masked_mean(((clipped > loss3) & (adv < 0)).float(), mask), masked_mean(-neg_kl, mask))


def _gspo(inp: PolicyLossInput, mask: torch.Tensor, weight: Optional[torch.Tensor]) -> PolicyLossOutput:
    neg_kl = inp.logp - inp.old_logp
    seq_neg_kl = (neg_kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_ratio = (inp.logp - inp.logp.detach() + seq_neg_kl.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = log_ratio.exp()
    loss1 = -inp.advantages * ratio
    loss2 = -inp.advantages * ratio.clamp(1.0 - inp.clip_low, 1.0 + inp.clip_high)
    losses = _weighted(torch.maximum(loss1, loss2), weight)
    return _out(agg_loss(losses, mask, inp.agg_mode, inp.denom), masked_mean((loss2 > loss1).float(), mask),
                _zero(inp), masked_mean(-neg_kl, mask))


def _sapo(inp: PolicyLossInput, mask: torch.Tensor, weight: Optional[torch.Tensor]) -> PolicyLossOutput:
    adv = inp.advantages
    neg_kl = (inp.logp - inp.old_logp).clamp(-20.0, 20.0)
    tau = torch.where(adv > 0, torch.as_tensor(inp.tau_pos, dtype=adv.dtype, device=adv.device),
                      torch.as_tensor(inp.tau_neg, dtype=adv.dtype, device=adv.device))
    gates = torch.sigmoid(tau * (neg_kl.exp() - 1.0)) * (4.0 / tau)
    losses = _weighted(-gates * adv, weight)
    return _out(agg_loss(losses, mask, SEQ_MEAN_TOKEN_MEAN, inp.denom), _zero(inp), _zero(inp),
                masked_mean(-neg_kl, mask))


def _gpg(inp: PolicyLossInput, mask: torch.Tensor, weight: Optional[torch.Tensor]) -> PolicyLossOutput:
    losses = _weighted(-inp.logp * inp.advantages, weight)
    return _out(agg_loss(losses, mask, inp.agg_mode, inp.denom), _zero(inp), _zero(inp),
                masked_mean(inp.old_logp - inp.logp, mask))


def _verl_masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (torch.where(mask.bool(), x, 0.0) * mask).sum() / (mask.sum() + 1e-8)


def _clip_cov(inp: PolicyLossInput, mask: torch.Tensor, weight: Optional[torch.Tensor]) -> PolicyLossOutput:
    adv = inp.advantages
    neg_kl = inp.logp - inp.old_logp
    ratio = neg_kl.exp()
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - inp.clip_low, 1.0 + inp.clip_high)
    valid = mask > 0
    with torch.no_grad():
        logp = inp.logp.detach()
        cov = (adv - _verl_masked_mean(adv, mask)) * (logp - _verl_masked_mean(logp, mask))
        cov = cov.masked_fill(~valid | ((loss2 > loss1) & valid), -torch.inf)
        clip_num = max(int(inp.clip_cov_ratio * mask.sum().item()), 1)
        candidates = torch.nonzero((cov < inp.clip_cov_ub) & (cov > inp.clip_cov_lb) & valid)
        if len(candidates) > 0:
            candidates = candidates[torch.randperm(len(candidates))[:min(clip_num, len(candidates))]]
        corr = torch.ones_like(adv)
        corr[candidates[:, 0], candidates[:, 1]] = 0
    losses = _weighted(torch.maximum(loss1, loss2) * corr, weight)
    return _out(agg_loss(losses, mask, inp.agg_mode, inp.denom), masked_mean((corr == 0).float(), mask), _zero(inp),
                masked_mean(-neg_kl, mask))


def _kl_cov(inp: PolicyLossInput, mask: torch.Tensor, weight: Optional[torch.Tensor]) -> PolicyLossOutput:
    adv = inp.advantages
    neg_kl = inp.logp - inp.old_logp
    ratio = neg_kl.exp()
    losses = -adv * ratio
    valid = (mask > 0).reshape(-1)
    if valid.any():
        with torch.no_grad():
            flat = torch.nonzero(valid, as_tuple=True)[0]
            valid_adv = adv.detach().reshape(-1)[flat].cpu()
            valid_logp = inp.logp.detach().reshape(-1)[flat].cpu()
            cov = (valid_adv - valid_adv.mean()) * (valid_logp - valid_logp.mean())
            top = flat[torch.topk(cov, max(1, int(len(cov) * inp.kl_cov_ratio)), largest=True).indices.to(flat.device)]
            penalised = torch.zeros(valid.shape, dtype=torch.bool, device=valid.device)
            penalised[top] = True
        losses = torch.where(penalised.view_as(losses), losses + inp.ppo_kl_coef * neg_kl.abs(), losses)
    losses = _weighted(losses, weight)
    return _out(agg_loss(losses, mask, inp.agg_mode, inp.denom), _zero(inp), _zero(inp),
                masked_mean(neg_kl.abs(), mask))


def _geo_mean(inp: PolicyLossInput, mask: torch.Tensor, weight: Optional[torch.Tensor]) -> PolicyLossOutput:
    adv = inp.advantages
    neg_kl = inp.logp - inp.old_logp
    sign = torch.sign(adv)
    clamped = neg_kl.clamp(-inp.clip_low, inp.clip_high)
    token = sign * torch.minimum(sign * neg_kl, sign * clamped)
    lengths = mask.sum(-1) + 1e-8
    ratio = torch.exp((token * mask).sum(-1) / lengths)
    losses = -((adv * mask).sum(-1) / lengths) * ratio                     # (B,) one loss per sequence
    if weight is not None:
        losses = losses * torch.exp((torch.log(weight + 1e-10) * mask).sum(-1) / lengths)
    denom = inp.denom if inp.denom is not None else max(mask.shape[0], 1)
    clipped = neg_kl != clamped
    return _out(losses.sum() / denom, masked_mean((clipped & (adv > 0)).float(), mask),
                masked_mean((clipped & (adv < 0)).float(), mask), masked_mean(-neg_kl, mask))


def _cispo(inp: PolicyLossInput, mask: torch.Tensor, weight: Optional[torch.Tensor]) -> PolicyLossOutput:
    neg_kl = (inp.logp - inp.old_logp).clamp(-20.0, 20.0)
    ratio = neg_kl.exp()
    clipped = ratio.clamp(1.0 - inp.clip_low, 1.0 + inp.clip_high)
    losses = _weighted(-clipped.detach() * inp.advantages * inp.logp, weight)
    return _out(agg_loss(losses, mask, inp.agg_mode, inp.denom), masked_mean((ratio != clipped).float(), mask),
                _zero(inp), masked_mean(-neg_kl, mask))


def _dppo(inp: PolicyLossInput, mask: torch.Tensor, weight: Optional[torch.Tensor],
          kl: bool) -> PolicyLossOutput:
    """DPPO-Binary (TV or KL divergence): the truncated ratio times -A logp on the tokens inside the trust region."""
    adv = inp.advantages
    neg_kl = (inp.logp - inp.old_logp).clamp(-20.0, 20.0)
    ratio = neg_kl.exp()
    truncated = ratio.clamp(max=inp.clip_c).detach()
    prob, old_prob = inp.logp.exp(), inp.old_logp.exp()
    if kl:
        binary_kl = old_prob * (inp.old_logp - inp.logp) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        inside_pos = (binary_kl <= inp.clip_high) | (prob <= old_prob)
        inside_neg = (binary_kl <= inp.clip_low) | (prob >= old_prob)
    else:
        inside_pos = (prob - old_prob) <= inp.clip_high
        inside_neg = (prob - old_prob) >= -inp.clip_low
    inside = torch.where(adv > 0, inside_pos, inside_neg).detach().to(inp.logp.dtype)
    losses = _weighted(-adv * truncated * inp.logp * inside, weight)
    return _out(agg_loss(losses, mask, inp.agg_mode, inp.denom), masked_mean(1.0 - inside, mask),
                masked_mean((ratio > inp.clip_c).to(inside.dtype) * inside, mask), masked_mean(-neg_kl, mask))


def _dppo_tv(inp: PolicyLossInput, mask: torch.Tensor, weight: Optional[torch.Tensor]) -> PolicyLossOutput:
    return _dppo(inp, mask, weight, kl=False)


def _dppo_kl(inp: PolicyLossInput, mask: torch.Tensor, weight: Optional[torch.Tensor]) -> PolicyLossOutput:
    return _dppo(inp, mask, weight, kl=True)


def _dro(inp: PolicyLossInput, mask: torch.Tensor, weight: Optional[torch.Tensor]) -> PolicyLossOutput:
    if inp.dro_beta is None or not inp.dro_beta > 0:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.dro_beta={inp.dro_beta!r}: loss_mode=dro needs a "
                         "positive coefficient")
    log_ratio = inp.logp - inp.old_logp
    losses = _weighted(-(inp.logp * inp.advantages - 0.5 * inp.dro_beta * log_ratio.square()), weight)
    return _out(agg_loss(losses, mask, inp.agg_mode, inp.denom), _zero(inp), _zero(inp),
                masked_mean(-log_ratio, mask))


PolicyLossFn = Callable[[PolicyLossInput, torch.Tensor, Optional[torch.Tensor]], PolicyLossOutput]
POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": _vanilla, "gspo": _gspo, "sapo": _sapo, "gpg": _gpg, "clip_cov": _clip_cov, "kl_cov": _kl_cov,
    "geo_mean": _geo_mean, "cispo": _cispo, "dppo_tv": _dppo_tv, "dppo_kl": _dppo_kl, "dro": _dro,
}


def policy_loss(inp: PolicyLossInput) -> PolicyLossOutput:
    """The `inp.mode` surrogate of one micro-batch, with the decoupled-PPO weight when `inp.behav_logp` is set and
    rollout correction's `inp.is_weights` when given (config_checks refuses the two together for token weights:
    they are the same weight)."""
    fn = POLICY_LOSSES.get(inp.mode)
    if fn is None:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.loss_mode {inp.mode!r} is not one of "
                         f"{list(POLICY_LOSSES)}")
    mask = inp.mask.to(inp.logp.dtype)
    behav = weight = None
    if inp.behav_logp is not None:
        behav = weight = (inp.old_logp - inp.behav_logp).clamp(-20.0, 20.0).exp().clamp(max=inp.behav_cap).detach()
    if inp.is_weights is not None:   # rollout correction's weights: where verl applies rollout_is_weights
        weight = inp.is_weights if weight is None else weight * inp.is_weights
    out = fn(inp, mask, weight)
    if behav is not None:
        out.behav_weight_mean = masked_mean(behav, mask).detach()
    return out
