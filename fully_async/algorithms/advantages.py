"""GRPO outcome advantages (verl's `compute_grpo_outcome_advantage`).

Each response's score is normalised within its group (the n responses to one prompt):
`(score - mean_group) / (std_group + eps)` with the unbiased std, or `score - mean_group` when
`norm_adv_by_std_in_grpo=false` (Dr. GRPO).  A group of one response gets mean 0 and std 1, as in
verl.  The advantage is broadcast to every response token.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch


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
