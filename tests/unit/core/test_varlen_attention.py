"""core/varlen_attention.packed_causal_attention off the flash path (CPU): each sequence attends within itself, and a
sequence with more keys than queries (a prefill chunk after its slot's cached prefix) has its queries at the end of
its keys -- against a dense masked softmax written out here."""
import math

import torch

from fully_async.core.varlen_attention import packed_causal_attention


def dense(q, k, v, scale):
    """One sequence, q (T, Hq, D), k/v (S, Hkv, D): query j at key position S - T + j sees keys [0, S - T + j]."""
    t, s = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    allowed = torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]
    return torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)


def test_queries_attend_within_their_sequence_aligned_to_the_end_of_its_keys():
    torch.manual_seed(0)
    heads, kv_heads, dim, scale = 4, 2, 8, 0.3
    q_lens, k_lens = [3, 1, 5], [7, 1, 5]          # a 3-token chunk after 4 cached, a 1-token row, a whole prompt
    q = torch.randn(sum(q_lens), heads, dim, dtype=torch.float64)
    k, v = (torch.randn(sum(k_lens), kv_heads, dim, dtype=torch.float64) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]) for lens in (q_lens, k_lens))
    out = packed_causal_attention(q, k, v, cu_q, None, scale, cu_k, None)
    want = torch.cat([dense(q[a:b], k[c:d], v[c:d], scale)
                      for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])])
    assert out.shape == q.shape and torch.allclose(out, want, atol=1e-12)
    # without key boundaries the keys are the queries' own tokens (the packed prefill and the packed update)
    same = packed_causal_attention(q, k[:9], v[:9], cu_q, None, scale)
    assert torch.allclose(same, torch.cat([dense(q[a:b], k[a:b], v[a:b], scale)
                                           for a, b in zip(cu_q[:-1], cu_q[1:])]), atol=1e-12)
