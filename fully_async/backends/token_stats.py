"""Per-token log-prob and entropy from logits without materialising (N, V) float32 tensors.

Why: with a real vocabulary the logits dominate trainer memory.  The plain autograd version
(`log_softmax(logits.float() / T)`, then `-(p * logp).sum()` for the entropy) keeps several
float32 copies of the (N, V) logits alive for backward: measured on 1x H200 with a
Qwen2.5-0.5B shape (vocabulary 151,936) at 16k tokens per micro-batch, peak memory 76 GiB
against 37 GiB with this function.  It walks the rows in chunks of ~`chunk_elems` elements,
keeps only the logits and the targets for backward, and recomputes softmax per chunk there:

    x = logits / T,  lse = logsumexp(x),  logp = x[target] - lse,  p = exp(x - lse)
    entropy = lse - sum(p * x)
    d logp / dx = onehot(target) - p,   d entropy / dx = -p * (x - sum(p * x))

Values are computed in float32 (float64 for float64 logits), exactly as before.  On CUDA the
per-chunk math is compiled (torch.compile fuses it into a few passes over the chunk); elsewhere
it runs eagerly.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

CHUNK_ELEMS = 2 ** 26   # 64M elements: 256 MB per float32 temporary


def _forward_chunk(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                   with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lse = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, targets[:, None]).squeeze(-1) - lse
    if with_entropy:
        return logp, lse - (torch.exp(x - lse[:, None]) * x).sum(-1)
    return logp, logp


def _backward_chunk(logits: torch.Tensor, targets: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor,
                    temperature: float, with_entropy: bool) -> torch.Tensor:
    dtype = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(dtype) / temperature
    p = torch.softmax(x, dim=-1)
    gl = g_logp[:, None].to(dtype)
    if with_entropy:
        mean_x = (p * x).sum(-1, keepdim=True)
        d = -p * (gl + g_ent[:, None].to(dtype) * (x - mean_x))
    else:
        d = -p * gl
    d = d.scatter_add(-1, targets[:, None], gl)
    return (d / temperature).to(logits.dtype)


@functools.lru_cache(maxsize=None)
def _kernels(device_type: str) -> tuple[Callable, Callable]:
    if device_type == "cuda":
        return (torch.compile(_forward_chunk, dynamic=True), torch.compile(_backward_chunk, dynamic=True))
    return _forward_chunk, _backward_chunk


def _step(rows: int, vocab: int, chunk_elems: int) -> int:
    return max(1, min(rows, chunk_elems // max(vocab, 1)))


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                chunk_elems: int):
        n, vocab = logits.shape
        forward_chunk, _ = _kernels(logits.device.type)
        step = _step(n, vocab, chunk_elems)
        parts = [forward_chunk(logits[s:s + step], targets[s:s + step], temperature, with_entropy)
                 for s in range(0, n, step)]
        logp = torch.cat([lp for lp, _ in parts])
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.with_entropy, ctx.chunk_elems = temperature, with_entropy, chunk_elems
        if with_entropy:
            return logp, torch.cat([e for _, e in parts])
        ent = logp.new_zeros(0)   # autograd.Function outputs are tensors: an empty, non-differentiable placeholder
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor, g_ent: Optional[torch.Tensor]):
        logits, targets = ctx.saved_tensors
        n, vocab = logits.shape
        _, backward_chunk = _kernels(logits.device.type)
        with_entropy = ctx.with_entropy and g_ent is not None and g_ent.numel() > 0
        if g_logp is None:
            g_logp = torch.zeros(n, dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits)
        step = _step(n, vocab, ctx.chunk_elems)
        for s in range(0, n, step):
            grad[s:s + step] = backward_chunk(logits[s:s + step], targets[s:s + step], g_logp[s:s + step],
                                              g_ent[s:s + step] if with_entropy else g_logp[s:s + step],
                                              ctx.temperature, with_entropy)
        return grad, None, None, None, None


def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
                chunk_elems: int = CHUNK_ELEMS) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits (N, V), targets (N,) -> log p(target) (N,) and, if asked, the entropy (N,), at logits / T."""
    logp, ent = _TokenStats.apply(logits, targets, float(temperature), with_entropy, chunk_elems)
    return logp, (ent if with_entropy else None)
