"""The critic-free advantage estimators (algorithm.adv_estimator), as verl's core_algos computes them.

Every estimator reads an `AdvantageInput`: each response's outcome score (minus the in-reward KL sum when
algorithm.use_kl_in_reward), its token-level rewards (the score on the last response token, minus the per-token
KL penalty: only reinforce_plus_plus reads them token by token), the response mask and the group (prompt) of each
response; it returns advantages (B, T), zero off the mask.  `compute_advantages` dispatches by name
(`ESTIMATORS`; the valid names are core/config.py's ADV_ESTIMATORS).  eps is verl's fixed 1e-6.

  grpo                  (score - group mean) / (group std + eps), unbiased std; `norm_adv_by_std_in_grpo=false`
                        drops the division (Dr. GRPO).  A group of one: mean 0, std 1.
  grpo_vectorized       the same with verl's vectorised statistics (verl 0.9.1: two-pass float32 variance, not
                        floored).  verl's trainer does not pass norm_adv_by_std_in_grpo to it (it always divides);
                        here the key acts, as its name says.
  gdpo                  GDPO: grpo of each reward component (algorithm.gdpo_reward_keys, read from the reward
                        function's dict; `reward_components`) separately, summed with gdpo_reward_weights (default
                        1 each), whitened over the batch's response tokens.
  grpo_passk            Pass@k: only each group's best response gets (best - second best), over (group std + eps)
                        with norm_adv_by_std_in_grpo; a group needs two responses.
  rloo                  leave-one-out: (score - mean of the others) = (n score - sum) / (n - 1); a group of one
                        keeps its raw score.
  rloo_vectorized       the same, but a group of one gets 0 (verl's vectorised form).
  opo                   score - length-weighted group mean (sum len * score / sum len); a group of one: baseline 0.
  gpg                   alpha (score - group mean) / f_norm, alpha = batch size / responses with a non-zero score,
                        f_norm = algorithm.gpg_f_norm (verl's default 1).
  reinforce_plus_plus   discounted token returns (algorithm.gamma), whitened over the batch's response tokens; the
                        running return is carried unchanged through tokens outside the mask (a multi-turn
                        response's tool output, the prompt in front), as verl 0.9.1.
  reinforce_plus_plus_baseline  (score - group mean) on every token, whitened over the batch's response tokens.

  optimal_token_baseline  per-timestep baseline of each group, B_t = sum G_t W_t / (sum W_t + 1e-8) over its
                        responses, G_t the reward-to-go, W_t the cumulative path variance sum_{j<=t} (1 - 2 pi_j +
                        sum_v pi_v^2) (pi_j = exp(old log-prob); actor.calculate_sum_pi_squared gives sum pi^2; with
                        rollout correction's weights w, each term times w^2); A_t = G_t - B_t.  A group of one:
                        A = G.  Column t is the same response position for every member (they share the prompt).
  tir_optimal_token_baseline  the same over each response's own tokens (a response mask with holes is compacted,
                        verl's multi-turn form).
                        Both: with algorithm.handle_zero_tail (verl 0.9.1's default, true) the group's single
                        longest response gets no baseline past the second longest.

  remax                 the token returns (reward-to-go of the token-level rewards) minus the reward of the
                        prompt's greedy response (generated beside the n sampled ones, rollout/generation.py
                        group_pendings; not trained), on every response token.

Returns (`compute_advantages_and_returns`, a critic trained beside the estimator reads them): reinforce_plus_plus,
remax and the optimal-token-baseline estimators return verl 0.9.1's discounted reward-to-go; the others return
their advantages, as verl's do.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

EPS = 1e-6


def grpo_advantages(scores: torch.Tensor, group_ids: Sequence[str], response_mask: torch.Tensor,
                    norm_adv_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """scores: (B,) one outcome score per response; response_mask: (B, T) -> advantages (B, T)."""
    scores = scores.float()
    members: dict[str, list[int]] = defaultdict(list)
    for i, gid in enumerate(group_ids):
        members[gid].append(i)
    mean = torch.zeros_like(scores)
    std = torch.ones_like(scores)
    for idx in members.values():
        if len(idx) > 1:
            group = scores[idx]
            mean[idx] = group.mean()
            std[idx] = group.std()  # unbiased, like torch.std in verl
    adv = scores - mean
    if norm_adv_by_std:
        adv = adv / (std + eps)
    return adv.unsqueeze(-1) * response_mask  # (B, T)


@dataclass
class AdvantageInput:
    scores: torch.Tensor           # (B,) outcome score per response (in-reward KL sum subtracted)
    token_rewards: torch.Tensor    # (B, T) token-level rewards (token_level_rewards)
    mask: torch.Tensor             # (B, T) 1 on response tokens
    group_ids: Sequence[str]       # (B,) the prompt each response answers
    old_log_probs: Optional[torch.Tensor] = None       # (B, T) the optimal-token-baseline estimators read these
    sum_pi_squared: Optional[torch.Tensor] = None      # (B, T) sum over the vocabulary of pi^2 per position
    rollout_is_weights: Optional[torch.Tensor] = None  # (B, T) rollout correction's truncated weights, if any
    reward_baselines: Optional[torch.Tensor] = None    # (B,) remax: the reward of each prompt's greedy response
    reward_components: Optional[torch.Tensor] = None   # (B, K) gdpo: the gdpo_reward_keys of each response


def token_level_rewards(scores: torch.Tensor, mask: torch.Tensor, penalty: Any = None) -> torch.Tensor:
    """(B, T) rewards as verl's reward manager lays them out: each response's score on its last response token,
    minus `penalty` (B, T) (the in-reward KL, beta * kl on the response tokens) when given."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = (mask.bool() * (positions + 1)).argmax(-1)           # the last response token of each row
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rewards[torch.arange(mask.shape[0], device=mask.device), last] = scores.float() * (mask.sum(-1) > 0)
    return rewards if penalty is None else rewards - penalty


# ----------------------------------------------------------------------------------- group statistics
def _group_index(group_ids: Sequence[str], device: Any) -> tuple[torch.Tensor, int]:
    """(B,) contiguous group number of each response, and the number of groups."""
    number: dict[str, int] = {}
    inv = [number.setdefault(gid, len(number)) for gid in group_ids]
    return torch.tensor(inv, dtype=torch.long, device=device), len(number)


def _group_sum(x: torch.Tensor, inv: torch.Tensor, groups: int) -> torch.Tensor:
    return torch.zeros(groups, dtype=x.dtype, device=x.device).index_add_(0, inv, x)


def _group_mean(scores: torch.Tensor, inv: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) mean of each response's group (0 for a group of one, as verl) and (B,) its size."""
    count = _group_sum(torch.ones_like(scores), inv, groups)[inv]
    mean = _group_sum(scores, inv, groups)[inv] / count
    return torch.where(count > 1, mean, torch.zeros_like(mean)), count


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (torch.where(mask.bool(), x, 0.0) * mask).sum() / (mask.sum() + 1e-8)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl_F.masked_whiten: (values - mean) / sqrt(var + 1e-8) over the masked entries, unbiased variance."""
    tokens = mask.sum()
    if tokens <= 1:
        raise ValueError(f"whitening the advantages needs at least 2 response tokens in the batch (got {int(tokens)})")
    mean = _masked_mean(values, mask)
    var = _masked_mean((values - mean) ** 2, mask) * (tokens / (tokens - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


# ----------------------------------------------------------------------------------- the estimators
def _broadcast(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return adv.unsqueeze(-1) * mask


def _grpo(inp: AdvantageInput, alg: Any) -> torch.Tensor:
    return grpo_advantages(inp.scores, inp.group_ids, inp.mask, alg.norm_adv_by_std_in_grpo, EPS)


def _grpo_vectorized(inp: AdvantageInput, alg: Any) -> torch.Tensor:
    scores = inp.scores.float()
    inv, groups = _group_index(inp.group_ids, scores.device)
    count = _group_sum(torch.ones_like(scores), inv, groups)
    mean = _group_sum(scores, inv, groups) / count.clamp_min(1.0)
    centred = scores - mean[inv]                                   # two passes: mean, then squared deviations
    var = _group_sum(centred * centred, inv, groups) / (count - 1.0).clamp_min(1.0)
    std = torch.sqrt(var.clamp(min=0.0))
    single = count <= 1.0
    mean, std = mean.masked_fill(single, 0.0), std.masked_fill(single, 1.0)
    adv = scores - mean[inv]
    if alg.norm_adv_by_std_in_grpo:
        adv = adv / (std[inv] + EPS)
    return _broadcast(adv, inp.mask)


def _grpo_passk(inp: AdvantageInput, alg: Any) -> torch.Tensor:
    scores = inp.scores.float()
    adv = torch.zeros_like(scores)
    members: dict[str, list[int]] = defaultdict(list)
    for i, gid in enumerate(inp.group_ids):
        members[gid].append(i)
    for gid, idx in members.items():
        if len(idx) < 2:
            raise ValueError(f"grpo_passk needs at least 2 responses per prompt; group {gid!r} has {len(idx)}")
        group = scores[idx]
        top = torch.topk(group, 2)
        best = top.values[0] - top.values[1]
        if alg.norm_adv_by_std_in_grpo:
            best = best / (group.std() + EPS)
        adv[idx[int(top.indices[0])]] = best
    return _broadcast(adv, inp.mask)


def _rloo(inp: AdvantageInput, alg: Any, singleton_zero: bool = False) -> torch.Tensor:
    scores = inp.scores.float()
    inv, groups = _group_index(inp.group_ids, scores.device)
    mean, count = _group_mean(scores, inv, groups)
    scale = count / (count - 1).clamp_min(1)
    adv = torch.where(count > 1, scores * scale - mean * scale, torch.zeros_like(scores) if singleton_zero else scores)
    return _broadcast(adv, inp.mask)


def _rloo_vectorized(inp: AdvantageInput, alg: Any) -> torch.Tensor:
    return _rloo(inp, alg, singleton_zero=True)


def _opo(inp: AdvantageInput, alg: Any) -> torch.Tensor:
    scores = inp.scores.float()
    lengths = inp.mask.sum(-1).to(scores.dtype)
    inv, groups = _group_index(inp.group_ids, scores.device)
    count = _group_sum(torch.ones_like(scores), inv, groups)[inv]
    baseline = _group_sum(lengths * scores, inv, groups)[inv] / _group_sum(lengths, inv, groups)[inv]
    return _broadcast(scores - torch.where(count > 1, baseline, torch.zeros_like(baseline)), inp.mask)


def _gpg(inp: AdvantageInput, alg: Any) -> torch.Tensor:
    scores = inp.scores.float()
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    inv, groups = _group_index(inp.group_ids, scores.device)
    mean, _ = _group_mean(scores, inv, groups)
    return _broadcast(alpha * (scores - mean) / getattr(alg, "gpg_f_norm", 1.0), inp.mask)


def _reinforce_plus_plus(inp: AdvantageInput, alg: Any) -> torch.Tensor:
    rewards, mask = inp.token_rewards.float(), inp.mask.to(torch.float32)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        step = rewards[:, t] + alg.gamma * running
        returns[:, t] = step * mask[:, t]
        running = step * mask[:, t] + running * (1 - mask[:, t])    # carried through tokens off the mask
    return masked_whiten(returns, mask) * mask, returns


def _reinforce_plus_plus_baseline(inp: AdvantageInput, alg: Any) -> torch.Tensor:
    scores = inp.scores.float()
    inv, groups = _group_index(inp.group_ids, scores.device)
    mean, _ = _group_mean(scores, inv, groups)
    mask = inp.mask.to(torch.float32)
    return masked_whiten(_broadcast(scores - mean, mask), mask) * mask


def _remax(inp: AdvantageInput, alg: Any) -> torch.Tensor:
    if inp.reward_baselines is None:
        raise ValueError("remax needs each prompt's greedy baseline reward (reward_baselines)")
    mask = inp.mask.to(torch.float32)
    returns = _reward_to_go(inp.token_rewards, mask)
    return returns - inp.reward_baselines.float().unsqueeze(-1) * mask, returns


def _reward_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) undiscounted sum of the masked token rewards from each position on."""
    return (rewards.float() * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])


OTB_EPS = 1e-8   # verl's epsilon of the optimal-token-baseline estimators


def _otb_terms(inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(returns G_t, cumulative path variance W_t, mask) in float32, verl's compute_optimal_token_baseline_advantage
    steps 1-3."""
    if inp.old_log_probs is None or inp.sum_pi_squared is None:
        raise ValueError("the optimal-token-baseline estimators need old log-probs and sum_pi_squared "
                         "(actor_rollout_ref.actor.calculate_sum_pi_squared=true)")
    mask = inp.mask.to(torch.float32)
    returns = _reward_to_go(inp.token_rewards, mask)
    w = 1 - 2 * torch.exp(inp.old_log_probs.float()) + inp.sum_pi_squared.float()
    if inp.rollout_is_weights is not None:
        w = w * inp.rollout_is_weights.float() ** 2
    return returns, (w * mask).cumsum(dim=-1), mask


def _members(group_ids: Sequence[str], keep: Optional[torch.Tensor] = None) -> list[list[int]]:
    """Each group's rows in first-seen order (rows with keep[i] false left out)."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, gid in enumerate(group_ids):
        if keep is None or bool(keep[i]):
            members[gid].append(i)
    return list(members.values())


def _zero_tail(baselines: torch.Tensor, rows: list[int], lengths: torch.Tensor) -> None:
    """verl's handle_zero_tail: the group's single longest response gets no baseline past the second longest."""
    ordered = sorted(int(v) for v in lengths)
    longest = [r for r, n in zip(rows, lengths.tolist()) if n == ordered[-1]]
    if len(longest) == 1 and ordered[-1] > ordered[-2]:
        baselines[longest[0], ordered[-2]:] = 0.0


def _optimal_token_baseline(inp: AdvantageInput, alg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    returns, w_cum, mask = _otb_terms(inp)
    zero_tail = getattr(alg, "handle_zero_tail", True)
    baselines = torch.zeros_like(returns)
    for rows in _members(inp.group_ids):
        if len(rows) == 1:
            continue
        idx = torch.tensor(rows, device=returns.device)
        g, w, m = returns[idx], w_cum[idx], mask[idx]
        baselines[idx] = ((g * w * m).sum(0) / ((w * m).sum(0) + OTB_EPS)).expand(len(rows), -1)
        if zero_tail:
            _zero_tail(baselines, rows, m.sum(-1))
    return (returns - baselines) * mask, returns


def _tir_optimal_token_baseline(inp: AdvantageInput, alg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response's own tokens, compacted to the left (verl's multi-turn form), baselined as above per
    position of that compacted layout, the longest response's lone tail unbaselined, then scattered back."""
    returns, w_cum, mask = _otb_terms(inp)
    keep = mask.bool()
    lengths = keep.sum(-1)
    width = int(lengths.max()) if lengths.numel() else 0
    cols = torch.arange(width, device=returns.device)[None, :] < lengths[:, None]   # (B, width) compacted slots
    g_all, w_all = returns.new_zeros(len(returns), width), returns.new_zeros(len(returns), width)
    g_all[cols], w_all[cols] = returns[keep], w_cum[keep]
    baselines = torch.zeros_like(g_all)
    for rows in _members(inp.group_ids, lengths > 0):
        if len(rows) == 1:
            continue
        idx = torch.tensor(rows, device=returns.device)
        baselines[idx] = (g_all[idx] * w_all[idx]).sum(0) / (w_all[idx].sum(0) + OTB_EPS)
        if getattr(alg, "handle_zero_tail", True):
            _zero_tail(baselines, rows, lengths[idx])
    out = torch.zeros_like(returns)
    out[keep] = (g_all - baselines)[cols]
    return out, returns


def _gdpo(inp: AdvantageInput, alg: Any) -> torch.Tensor:
    """Each reward component normalised in its group as grpo, weighted, summed, whitened over the batch."""
    if inp.reward_components is None:
        raise ValueError("gdpo needs each response's reward components (algorithm.gdpo_reward_keys)")
    parts = inp.reward_components.float()                           # (B, K)
    weights = getattr(alg, "gdpo_reward_weights", None) or [1.0] * parts.shape[1]
    if len(weights) != parts.shape[1]:
        raise ValueError(f"algorithm.gdpo_reward_weights has {len(weights)} entries for {parts.shape[1]} "
                         "gdpo_reward_keys: give one weight per key")
    total = sum(float(w) * grpo_advantages(parts[:, k], inp.group_ids, inp.mask, alg.norm_adv_by_std_in_grpo, EPS)
                for k, w in enumerate(weights))
    mask = inp.mask.to(torch.float32)
    return masked_whiten(total, mask) * mask


ESTIMATORS: dict[str, Callable[[AdvantageInput, Any], Any]] = {   # advantages, or (advantages, returns)
    "grpo": _grpo, "gdpo": _gdpo, "grpo_vectorized": _grpo_vectorized, "grpo_passk": _grpo_passk, "rloo": _rloo,
    "rloo_vectorized": _rloo_vectorized, "opo": _opo, "gpg": _gpg, "reinforce_plus_plus": _reinforce_plus_plus,
    "reinforce_plus_plus_baseline": _reinforce_plus_plus_baseline,
    "remax": _remax, "optimal_token_baseline": _optimal_token_baseline,
    "tir_optimal_token_baseline": _tir_optimal_token_baseline,
}


def compute_advantages_and_returns(inp: AdvantageInput, alg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) advantages and returns of `alg.adv_estimator` (alg: the algorithm section: norm_adv_by_std_in_grpo,
    gamma, gpg_f_norm, handle_zero_tail, gdpo_reward_weights).  An estimator without returns of its own returns
    its advantages, as verl's outcome estimators do."""
    fn = ESTIMATORS.get(alg.adv_estimator)
    if fn is None:
        raise ValueError(f"algorithm.adv_estimator {alg.adv_estimator!r} is not one of {sorted(ESTIMATORS)}")
    with torch.no_grad():
        out = fn(inp, alg)
    return out if isinstance(out, tuple) else (out, out)


def compute_advantages(inp: AdvantageInput, alg: Any) -> torch.Tensor:
    """(B, T) advantages of `alg.adv_estimator` (compute_advantages_and_returns without the returns)."""
    return compute_advantages_and_returns(inp, alg)[0]
