"""Per-token log-prob and entropy from logits without materialising (N, V) float32 tensors.

Why: with a real vocabulary the logits dominate trainer memory.  The plain autograd version
(`log_softmax(logits.float() / T)`, then `-(p * logp).sum()` for the entropy) keeps about six
float32 copies of the (N, V) logits alive for backward: at 16k tokens x 151,936 (Qwen2.5's
vocabulary) that is ~60 GB.  This function walks the rows in chunks of ~`chunk_elems` elements,
keeps only the logits and the targets for backward, and recomputes softmax per chunk there:

    x = logits / T,  lse = logsumexp(x),  logp = x[target] - lse,  p = exp(x - lse)
    entropy = lse - sum(p * x)
    d logp / dx = onehot(target) - p,   d entropy / dx = -p * (x - sum(p * x))

Values are computed in float32 (float64 for float64 logits), exactly as before.
"""
from __future__ import annotations

from typing import Optional

import torch

CHUNK_ELEMS = 2 ** 26   # 64M elements: 256 MB per float32 temporary


def _chunks(rows: int, vocab: int, chunk_elems: int) -> range:
    return range(0, rows, max(1, chunk_elems // max(vocab, 1)))


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                chunk_elems: int):
        n, vocab = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        logp = torch.empty(n, dtype=dtype, device=logits.device)
        ent = torch.empty(n, dtype=dtype, device=logits.device) if with_entropy else None
        step = _chunks(n, vocab, chunk_elems).step
        for s in range(0, n, step):
            x = logits[s:s + step].to(dtype) / temperature
            lse = torch.logsumexp(x, dim=-1)
            logp[s:s + step] = x.gather(-1, targets[s:s + step, None]).squeeze(-1) - lse
            if with_entropy:
                ent[s:s + step] = lse - (torch.exp(x - lse[:, None]) * x).sum(-1)
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.with_entropy, ctx.chunk_elems = temperature, with_entropy, chunk_elems
        if ent is None:   # autograd.Function outputs are tensors: an empty, non-differentiable placeholder
            ent = logp.new_zeros(0)
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor]):
        logits, targets = ctx.saved_tensors
        n, vocab = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        grad = torch.empty_like(logits)
        step = _chunks(n, vocab, ctx.chunk_elems).step
        for s in range(0, n, step):
            x = logits[s:s + step].to(dtype) / ctx.temperature
            p = torch.softmax(x, dim=-1)
            gl = g_logp[s:s + step, None].to(dtype)
            d = -p * gl
            d.scatter_add_(-1, targets[s:s + step, None], gl)
            if ctx.with_entropy and g_ent is not None and g_ent.numel():
                mean_x = (p * x).sum(-1, keepdim=True)
                d -= g_ent[s:s + step, None].to(dtype) * p * (x - mean_x)
            grad[s:s + step] = (d / ctx.temperature).to(grad.dtype)
        return grad, None, None, None, None


def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
                chunk_elems: int = CHUNK_ELEMS) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits (N, V), targets (N,) -> log p(target) (N,) and, if asked, the entropy (N,), at logits / T."""
    logp, ent = _TokenStats.apply(logits, targets, float(temperature), with_entropy, chunk_elems)
    return logp, (ent if with_entropy else None)
