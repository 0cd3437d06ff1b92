"""verl's rollout correction (`algorithm.rollout_correction`; verl/trainer/ppo/rollout_corr_helper.py).

Three policies meet in an off-policy step: the behaviour policy that sampled the tokens (the engine's log-probs,
`rollout`), the trainer's old policy (`old`: recomputed by the trainer, the PPO anchor) and the current one.  With
log r = old - rollout per response token:

  rollout_is=token      w_t = min(exp(log r_t), rollout_is_threshold)          one weight per token
  rollout_is=sequence   w   = min(exp(sum_t log r_t), rollout_is_threshold)    one weight per response
                        (exponents clamped to +-20; rollout_is_batch_normalize divides by the batch mean);
                        rollout_is_threshold="lower_upper" is IcePop: a weight outside [lower, upper] becomes 0
                        instead of being truncated (rollout_is_oob_ratio: the fraction of such tokens)
  rollout_rs=<options>  a token or response is dropped from the loss (response mask 0) where a divergence
                        estimate leaves its bounds: k1 = -log r (bounds on the ratio: "lower_upper"), k2 = (log r)^2/2,
                        k3 = r - 1 - log r; token_*, or seq_sum_* / seq_mean_* / seq_max_* of the per-token values
                        over the response; several options (comma-separated) must all pass.

Two modes, as verl's:
  decoupled (bypass_mode=false): the trainer recomputes the old policy once per step, the weights and the mask are
      computed then (`correct_batch`), the weights multiply the clipped surrogate per token and the mask gates the
      loss and the advantages.  This is what our `async_training.decoupled_ppo` does with rollout_is=token and
      behav_imp_weight_cap as the threshold; the two are not combined for the weights: decoupled_ppo with
      rollout_is (verl's compute_prox_log_prob with rollout correction) takes rollout correction's weights instead
      of decoupled PPO's own (warned), and rejection sampling goes with either: decoupled_ppo=true + rollout_rs
      keeps decoupled PPO's weights and adds verl's mask.
  bypass (bypass_mode=true): the behaviour log-probs are the old policy (no recomputation: our default
      use_rollout_log_probs=true, decoupled_ppo=false); the PPO ratio itself carries the correction, so no weight
      is applied (loss_type=ppo_clip; verl computes one for its metrics only) -- or, with loss_type=reinforce,
      the clipped surrogate gives way to -A log pi times the truncated weight of the current policy against the
      behaviour one (computed in the loss, per micro-batch: actor_loss.bypass_correction) -- and rejection sampling
      runs in the loss on every micro-batch against the current policy (`rejection_mask`).

Metrics are verl's names under `rollout_corr/`: the weights' statistics, the rejected fractions per option and
overall, and the off-policy diagnostics (kl, k3_kl, perplexities, chi2).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from fully_async.core.rollout_correction_spec import is_threshold, rs_options, rs_thresholds

SAFETY_BOUND = 20.0


def _sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = -1) -> torch.Tensor:
    """Sum over `mask` (values off the mask, NaN or inf included, count as 0), as verl's masked_sum."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim=dim)


def _mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean over `mask`, as verl's masked_mean (the same epsilon, so the numbers match)."""
    return _sum(values, mask, dim) / (mask.sum(dim=dim) + 1e-8)


# ------------------------------------------------------------------------------------------ importance weights
def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: Any,
               batch_normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, T) importance weights (0 off the mask, detached) and their `rollout_is_*` metrics.  `threshold`: one
    number (TIS: truncated at it) or "lower_upper" (IcePop: weights outside [lower, upper] set to 0)."""
    upper, lower = is_threshold(threshold)
    if level == "token":
        for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        for_metrics = _sum(log_ratio, mask).unsqueeze(-1)   # (B, 1)
        raw = torch.exp(for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    else:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r} is not one of token, sequence, null")
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, for_metrics, mask, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = _mean(((raw < lower) | (raw > upper)).float(), mask).item()
    weights = weights.detach()
    if batch_normalize:
        if level == "token":
            mean = _mean(weights, mask)
        else:
            seq_mask = (mask.sum(-1) > 0).to(weights.dtype)
            mean = (_mean(weights, mask, -1) * seq_mask).sum() / seq_mask.sum().clamp(min=1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _is_metrics(weights: torch.Tensor, raw: torch.Tensor, for_metrics: torch.Tensor, mask: torch.Tensor, level: str,
                threshold: float, lower: Optional[float]) -> dict[str, float]:
    """verl 0.9.1's statistics: mean, max/min (token level), std, ESS and the per-response means of the applied
    (truncated or IcePop-zeroed) weights; the fractions beyond the bounds from the raw weights."""
    if not mask.any():
        raise ValueError("rollout correction needs at least one response token")
    lower = 1.0 / threshold if lower is None else lower
    m: dict[str, float] = {"rollout_is_mean": _mean(weights, mask).item()}
    if level == "sequence":
        m["rollout_is_max"] = math.exp(min(for_metrics.max().item(), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(for_metrics.min().item())
        m["rollout_is_ratio_fraction_high"] = (for_metrics > math.log(threshold)).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (for_metrics < math.log(lower)).float().mean().item()
    else:
        m["rollout_is_ratio_fraction_high"] = _mean((raw > threshold).float(), mask).item()
        m["rollout_is_ratio_fraction_low"] = _mean((raw < lower).float(), mask).item()
        on = mask.bool()
        m["rollout_is_max"] = weights.masked_fill(~on, float("-inf")).max().item()
        m["rollout_is_min"] = weights.masked_fill(~on, float("inf")).min().item()
    clamped = weights.clamp(min=0.0, max=threshold)
    if mask.sum() > 1:
        var = _mean(clamped.square(), mask) - _mean(clamped, mask).square()
        m["rollout_is_std"] = var.clamp(min=0.0).sqrt().item()
    else:
        m["rollout_is_std"] = 0.0
    normalized = clamped / (_mean(clamped, mask) + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / _mean(normalized.square(), mask).item()
    seq = _mean(weights, mask, -1)   # (B,)
    m["rollout_is_seq_mean"] = seq.mean().item()
    m["rollout_is_seq_std"] = seq.std().item() if seq.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = seq.max().item()
    m["rollout_is_seq_min"] = seq.min().item()
    m["rollout_is_seq_max_deviation"] = (seq - 1.0).abs().max().item()
    raw_seq = _mean(raw, mask, -1)
    m["rollout_is_seq_fraction_high"] = (raw_seq > threshold).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_seq < lower).float().mean().item()
    return m


# ------------------------------------------------------------------------------------------ rejection
def _statistic(option: str, log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(per-token statistic (B, T), per-response statistic (B,) or None for token options)."""
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}[option[-2:]]
    if option.startswith("token"):
        return per_token, None
    if option.startswith("seq_sum"):
        seq = _sum(per_token, mask)
    elif option.startswith("seq_mean"):
        seq = _mean(per_token, mask, -1)
    else:   # seq_max
        top = per_token.masked_fill(~mask.bool(), float("-inf")).max(-1).values
        seq = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    return seq.unsqueeze(-1).expand_as(mask).to(per_token.dtype), seq


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, spec: str,
                   threshold: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask with rejected tokens / responses set to 0, and the `rollout_rs_*` metrics."""
    options = rs_options(spec)
    bounds = rs_thresholds(options, threshold)
    if log_ratio.shape[0] == 0:
        return mask, {}
    on = mask.bool()
    seq_valid = mask.sum(-1) > 0
    combined = torch.ones_like(mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    for opt in options:
        lower, upper = bounds[opt]
        stat, seq = _statistic(opt, log_ratio, mask)
        if opt.endswith("k1"):
            lo, hi = math.log(lower), math.log(upper)
            keep = (stat >= lo) & (stat <= hi)
        else:
            lo, hi = 0.0, upper
            keep = stat <= hi
        metrics.update(_rs_metrics(opt, stat, seq, mask, seq_valid, hi, lo, opt.endswith("k1")))
        keep_f = keep.to(log_ratio.dtype)
        combined = combined * keep_f
        seq_keep = (~(~keep & on)).all(-1)
        metrics[f"rollout_rs_{opt}_masked_fraction"] = _mean(1 - keep_f, mask).item()
        valid = seq_valid.float()
        metrics[f"rollout_rs_{opt}_seq_masked_fraction"] = (
            (((1.0 - seq_keep.to(log_ratio.dtype)) * valid).sum() / valid.sum()).item() if valid.sum() > 0 else 0.0)
    metrics["rollout_rs_masked_fraction"] = _mean(1 - combined, mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = (~((combined > 0.5) & on) & on).any(-1).float().mean().item()
    return (mask * combined).to(mask.dtype), metrics


def _rs_metrics(opt: str, stat: torch.Tensor, seq: Optional[torch.Tensor], mask: torch.Tensor,
                seq_valid: torch.Tensor, upper: float, lower: float, two_sided: bool) -> dict[str, float]:
    p = f"rollout_rs_{opt}"
    on = mask.bool()
    seq_values = (seq if seq is not None else _mean(stat, mask, -1))[seq_valid]
    m: dict[str, float] = {f"{p}_mean": _mean(stat, mask).item()}
    if seq is not None and seq_values.numel() > 0:
        m[f"{p}_max"], m[f"{p}_min"] = seq_values.max().item(), seq_values.min().item()
        m[f"{p}_fraction_high"] = (seq_values > upper).float().mean().item()
        m[f"{p}_fraction_low"] = (seq_values < lower).float().mean().item() if two_sided else 0.0
    else:
        m[f"{p}_max"] = stat.masked_fill(~on, float("-inf")).max().item()
        m[f"{p}_min"] = stat.masked_fill(~on, float("inf")).min().item()
        m[f"{p}_fraction_high"] = _mean((stat > upper).float(), mask).item()
        m[f"{p}_fraction_low"] = _mean((stat < lower).float(), mask).item() if two_sided else 0.0
    if mask.sum() > 1:
        c = stat.clamp(min=lower if two_sided else 0.0, max=upper)
        m[f"{p}_std"] = (_mean(c.square(), mask) - _mean(c, mask).square()).clamp(min=0.0).sqrt().item()
    else:
        m[f"{p}_std"] = 0.0
    n = seq_values.numel()
    m[f"{p}_seq_mean"] = seq_values.mean().item() if n else 0.0
    m[f"{p}_seq_std"] = seq_values.std().item() if n > 1 else 0.0
    m[f"{p}_seq_max"] = seq_values.max().item() if n else 0.0
    m[f"{p}_seq_min"] = seq_values.min().item() if n else 0.0
    m[f"{p}_seq_max_deviation"] = seq_values.abs().max().item() if n else 0.0
    m[f"{p}_seq_fraction_high"] = (seq_values > upper).float().mean().item() if n else 0.0
    if two_sided or not n:
        m[f"{p}_seq_fraction_low"] = (seq_values < lower).float().mean().item() if n else 0.0
    return m


# ------------------------------------------------------------------------------------------ diagnostics
def offpolicy_metrics(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's off-policy diagnostics of the old policy against the behaviour policy."""
    mean_old = _mean(old, mask, -1)            # (B,)
    mean_rollout = _mean(rollout, mask, -1)    # (B,)
    log_ratio = old - rollout
    diff = mean_rollout - mean_old
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_log = _sum(log_ratio, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": torch.exp(-mean_old).mean().item(), "training_log_ppl": (-mean_old).mean().item(),
        "kl": _mean(rollout - old, mask).item(),
        "k3_kl": _mean(torch.exp(log_ratio) - log_ratio - 1, mask).item(),
        "rollout_ppl": torch.exp(-mean_rollout).mean().item(), "rollout_log_ppl": (-mean_rollout).mean().item(),
        "log_ppl_diff": diff.mean().item(), "log_ppl_abs_diff": diff.abs().mean().item(),
        "log_ppl_diff_max": diff.max().item(), "log_ppl_diff_min": diff.min().item(),
        "ppl_ratio": torch.exp(diff).mean().item(),
        "chi2_token": (_mean(rho.square(), mask) - 1.0).item(),
        "chi2_seq": (torch.exp(2.0 * seq_log).mean() - 1.0).item(),
    }


# ------------------------------------------------------------------------------------------ entry points
def active(rc: Any) -> bool:
    """Whether algorithm.rollout_correction asks for weights or rejection."""
    return rc.rollout_is is not None or rc.rollout_rs is not None


def correct_batch(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                  rc: Any) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, float]]:
    """Decoupled mode, once per step: (weights (B, T) or None, the response mask after rejection, metrics with the
    `rollout_corr/` prefix).  old, rollout, mask: (B, T)."""
    if not mask.any():
        raise ValueError("rollout correction needs at least one response token")
    log_ratio = old - rollout
    metrics: dict[str, float] = {}
    weights = None
    if rc.rollout_is is not None:
        weights, m = is_weights(log_ratio, mask, rc.rollout_is, rc.rollout_is_threshold,
                                rc.rollout_is_batch_normalize)
        metrics.update(m)
    new_mask = mask.clone()
    if rc.rollout_rs is not None:
        new_mask, m = rejection_mask(log_ratio, mask, rc.rollout_rs, rc.rollout_rs_threshold)
        metrics.update(m)
    metrics.update(offpolicy_metrics(old, rollout, mask))
    return weights, new_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
