"""verl's PF-PPO (`algorithm.use_pf_ppo`, core_algos.compute_pf_ppo_reweight_data): policy filtration by reward.

After the advantages (verl: only with adv_estimator=gae), the step's batch is resampled with replacement, as many
rows as it has, each row drawn with probability proportional to a weight of its score (the rule/custom reward
summed over the response, before any in-reward KL):

  pow         |score| ^ weight_pow
  max_min     1 for the batch's highest and lowest scores, 0 otherwise
  max_random  0.4 for the highest score, 0.1 otherwise

(every weight + 1e-8, so a row is never impossible).  The draw uses its own generator seeded from the run's seed
and the step, so a resumed run draws the same rows.
"""
from __future__ import annotations

import torch

from fully_async.core.config import PF_PPO_REWEIGHT_METHODS as REWEIGHT_METHODS


def pf_ppo_weights(scores: torch.Tensor, method: str, weight_pow: float) -> torch.Tensor:
    """(B,) sampling weights of the (B,) scores, verl's formulas."""
    if method == "pow":
        weights = torch.pow(torch.abs(scores), weight_pow)
    elif method == "max_min":
        weights = torch.where((scores == scores.max()) | (scores == scores.min()), 1.0, 0.0)
    elif method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1)
    else:
        raise ValueError(f"algorithm.pf_ppo.reweight_method={method!r} is not one of {list(REWEIGHT_METHODS)}")
    return torch.clamp(weights + 1e-8, min=1e-8)


def pf_ppo_rows(scores: torch.Tensor, method: str, weight_pow: float, seed: int, step: int) -> list[int]:
    """The resampled rows: len(scores) draws with replacement by pf_ppo_weights."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    weights = pf_ppo_weights(scores.detach().double().cpu(), method, weight_pow)
    return torch.multinomial(weights, len(scores), replacement=True, generator=generator).tolist()
