"""Token sampling with per-row temperature / top-k / top-p (layer 1).

The behaviour log-prob returned for each sampled token is `log_softmax(logits / T)` *without*
the top-k/top-p mask: that is the same quantity the trainer recomputes (it divides logits by the
rollout temperature and never truncates), so `use_rollout_log_probs=true` compares like with
like.  Greedy rows (T == 0) take the argmax and report `log_softmax(logits)`.
"""
from __future__ import annotations

from typing import Optional

import torch


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits (B, V); top_k (B,) int, -1 = off; top_p (B,) float in (0, 1] -> masked logits (B, V)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)                 # (1, V)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)  # (B, 1)
    remove = ranks >= k
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs          # probability mass strictly above each token
    remove |= before > top_p.unsqueeze(1)
    remove[:, 0] = False                           # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One index per row of probs (B, V), drawn with probability probs[b, i]: argmax_i probs_i / E_i with E_i
    i.i.d. Exp(1) (E_i / probs_i is exponential with rate probs_i, and the smallest of independent exponentials
    is the i-th with probability rate_i / sum of rates).  The same distribution as torch.multinomial(probs, 1) in
    four elementwise/reduction kernels instead of multinomial's ~10 (the embedded engine samples every decode
    step); a zero-probability index is never drawn (E is kept above zero)."""
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  generator: Optional[torch.Generator] = None, truncate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) float -> (tokens (B,), behaviour log-probs (B,)).

    `truncate=False` skips the top-k/top-p filter (a full sort of the vocabulary per row): for a caller
    that knows no row sets top_k or top_p < 1, where the filter would keep every token anyway."""
    logits = logits.float()
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)  # (B, 1)
    scaled = logits / scale
    logp_all = torch.log_softmax(scaled, dim=-1)                                          # (B, V)
    probs = (filter_top_k_top_p(scaled, top_k, top_p) if truncate else scaled).softmax(dim=-1)
    sampled = exponential_race(probs, generator)
    tokens = torch.where(greedy, scaled.argmax(dim=-1), sampled)
    return tokens, logp_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
