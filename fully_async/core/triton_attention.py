"""Causal attention over packed sequences in Triton, forward and backward, with grouped kv heads read as they are.

Why: the update's attention runs torch's bundled FlashAttention 2 varlen kernel, ~0.73 s of the seed-003 step's
~3 s update at 15-17% of an H200's bf16 peak (docs/measurements/engine_prefill_packed_h200/), and torch releases
without `enable_gqa` in `varlen_attn` need the kv heads repeated to the query heads first (copies forward, a
reduction backward).  These kernels take q (T, Hq, D) and k/v (S, Hkv, D) with Hq a multiple of Hkv:
- forward: one program per (sequence, query head, block of queries), blocks of the longest sequences first; the
  keys below the block's diagonal stream without a mask, the diagonal blocks with it; the output and the row's
  log-sum-exp (base 2, float32) are written;
- backward: the rows' `delta = sum(dO * O)` first; then one program per (sequence, kv head, block of keys) sums dK
  and dV over every query head of its group (no atomics, no reduction afterwards) -- or, where the block settings
  say so (their fifth entry: head_dim 64), one program per query head, more and shorter programs, their parts
  added up after (FlashAttention 2's way for grouped heads) -- and one program per (sequence, query head, block of
  queries) computes dQ.
Causality is aligned to the bottom right where a sequence has more keys than queries (a prefill chunk after its
cached prefix): query i of a sequence with q_len queries and k_len keys sees keys [0, i + k_len - q_len].

`packed_attention` is the autograd entry point (a torch custom op, so a compiled decoder layer keeps it as one
node); `supported` says where it runs.  Triton is imported at the first call, never at import.  With
TRITON_INTERPRET=1 set before Triton is imported the kernels run on CPU tensors (the unit tests do that, at block
sizes of 16).
"""
from __future__ import annotations

import importlib.util
import math
import os
from typing import Any, Optional

import torch

# (BLOCK_M queries, BLOCK_N keys, warps, pipeline stages) per kernel and head_dim, read at each call (the
# interpreter's tests set blocks of 16): "fwd"; "dkdv" (BLOCK_M queries an inner step, BLOCK_N keys a program); "dq"
# (BLOCK_M queries a program, BLOCK_N keys an inner step).  Each the best of scripts/bench_varlen_attention.py
# --sweep's settings on 1x H200 at a real update's packed micro-batches (~32k tokens, lognormal lengths up to 3,088):
# head_dim 64 with 14/2 heads (Qwen2.5-0.5B), 128 with 28/4 (Qwen2.5-7B).  dK/dV's fifth entry: query heads a program
# sums over (1 at head_dim 64: 5.6 against 6.6-6.7 ms forward + backward over four micro-batches, the dK/dV kernel
# 658 against 779 us a call inside the seed-003 update; the parts' sum takes most of that back, the update is the
# same within its spread; docs/measurements/update_kernels_h200/); absent: the whole group
BLOCKS: dict[int, dict[str, tuple[int, ...]]] = {
    64: {"fwd": (64, 64, 4, 3), "dkdv": (32, 128, 4, 3, 1), "dq": (64, 32, 4, 3)},
    128: {"fwd": (64, 64, 4, 3), "dkdv": (16, 64, 4, 3), "dq": (64, 64, 4, 2)},
}
# the head_dims at which these kernels were measured faster than FlashAttention's on Hopper ("auto" picks them there;
# 1x H200, forward + backward over the update's micro-batches: 64 -16%, 128 -15%)
FASTER_ON_HOPPER = frozenset({64, 128})


def blocks(head_dim: int) -> dict[str, tuple[int, ...]]:
    """The block settings for this head_dim: its own where measured, else those of the nearest measured one above
    (fewer registers a row below it), else the largest."""
    if head_dim in BLOCKS:
        return BLOCKS[head_dim]
    above = [d for d in BLOCKS if d >= head_dim]
    return BLOCKS[min(above)] if above else BLOCKS[max(BLOCKS)]
_KERNELS: list = []
# looked up without importing it (and once: `supported` runs inside compiled decoder layers, so it stays plain logic)
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def supported(device_type: str, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """None when these kernels run here; else why not."""
    if device_type != "cuda" and not (device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"device {device_type!r} (the Triton kernels are built for cuda; cpu only under TRITON_INTERPRET=1)"
    if dtype not in (torch.bfloat16, torch.float16) and device_type == "cuda":
        return f"dtype {dtype} (16-bit floats only)"
    if head_dim not in (16, 32, 64, 128):
        return f"head_dim {head_dim} (16, 32, 64 or 128)"
    if not TRITON_INSTALLED:
        return "triton is not installed"
    return None


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K, scale_log2, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh,
                   H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
        sh = tl.program_id(0)
        seq = sh // H
        h = sh % H
        m_start = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M      # the last (longest) blocks first
        q0 = tl.load(CU_Q + seq)
        q_len = tl.load(CU_Q + seq + 1) - q0
        k0 = tl.load(CU_K + seq)
        k_len = tl.load(CU_K + seq + 1) - k0
        if m_start < q_len:
            shift = k_len - q_len
            hk = h // GROUP
            rows = m_start + tl.arange(0, BLOCK_M)
            cols = tl.arange(0, BLOCK_N)
            d = tl.arange(0, D)
            row_ok = rows < q_len
            q = tl.load(Q + (q0 + rows)[:, None] * s_qt + h * s_qh + d[None, :], mask=row_ok[:, None], other=0.0)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            end = tl.minimum(k_len, m_start + BLOCK_M + shift)            # past the block's last row's last key
            full = tl.minimum(m_start + shift + 1, end) // BLOCK_N * BLOCK_N   # keys every row of the block sees
            k_ptr = K + k0 * s_kt + hk * s_kh
            v_ptr = V + k0 * s_vt + hk * s_vh
            for n in range(0, full, BLOCK_N):
                k = tl.load(k_ptr + (n + cols)[:, None] * s_kt + d[None, :])
                v = tl.load(v_ptr + (n + cols)[:, None] * s_vt + d[None, :])
                qk = tl.dot(q, tl.trans(k)) * scale_log2
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                p = tl.math.exp2(qk - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            for n in range(full, end, BLOCK_N):
                key = n + cols
                key_ok = key < k_len
                k = tl.load(k_ptr + key[:, None] * s_kt + d[None, :], mask=key_ok[:, None], other=0.0)
                v = tl.load(v_ptr + key[:, None] * s_vt + d[None, :], mask=key_ok[:, None], other=0.0)
                qk = tl.dot(q, tl.trans(k)) * scale_log2
                seen = (key[None, :] <= rows[:, None] + shift) & key_ok[None, :]
                qk = tl.where(seen, qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                p = tl.math.exp2(qk - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            acc = acc / l_i[:, None]
            tl.store(O + (q0 + rows)[:, None] * s_ot + h * s_oh + d[None, :], acc.to(O.dtype.element_ty),
                     mask=row_ok[:, None])
            tl.store(LSE + (q0 + rows) * H + h, m_i + tl.math.log2(l_i), mask=row_ok)

    @triton.jit
    def delta_kernel(O, DO, DELTA, T, s_ot, s_oh, s_dt, s_dh, H: tl.constexpr, D: tl.constexpr,
                     BLOCK: tl.constexpr):
        h = tl.program_id(1)
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        d = tl.arange(0, D)
        ok = t < T
        o = tl.load(O + t[:, None] * s_ot + h * s_oh + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        do = tl.load(DO + t[:, None] * s_dt + h * s_dh + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        tl.store(DELTA + t * H + h, tl.sum(o * do, 1), mask=ok)

    @triton.jit
    def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, scale, scale_log2, s_qt, s_qh, s_kt, s_kh,
                    s_vt, s_vh, s_dt, s_dh, s_dkt, s_dkh, s_dvt, s_dvh, H: tl.constexpr, GROUP: tl.constexpr,
                    HEADS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # a program sums over HEADS query heads (a divisor of GROUP): j * HEADS ... (j + 1) * HEADS - 1, all of kv
        # head hk; it writes DK/DV's head j (DK is dk itself when HEADS == GROUP, else per-part sums added after)
        sh = tl.program_id(0)
        seq = sh // (H // HEADS)
        j = sh % (H // HEADS)
        hk = j * HEADS // GROUP
        n_start = tl.program_id(1) * BLOCK_N          # the first blocks of keys (seen by most queries) first
        q0 = tl.load(CU_Q + seq)
        q_len = tl.load(CU_Q + seq + 1) - q0
        k0 = tl.load(CU_K + seq)
        k_len = tl.load(CU_K + seq + 1) - k0
        if n_start < k_len:
            shift = k_len - q_len
            keys = n_start + tl.arange(0, BLOCK_N)
            key_ok = keys < k_len
            d = tl.arange(0, D)
            k = tl.load(K + (k0 + keys)[:, None] * s_kt + hk * s_kh + d[None, :], mask=key_ok[:, None], other=0.0)
            v = tl.load(V + (k0 + keys)[:, None] * s_vt + hk * s_vh + d[None, :], mask=key_ok[:, None], other=0.0)
            dk = tl.zeros([BLOCK_N, D], tl.float32)
            dv = tl.zeros([BLOCK_N, D], tl.float32)
            lo = tl.maximum(n_start - shift, 0) // BLOCK_M * BLOCK_M              # the first query seeing a key
            full = tl.minimum(tl.cdiv(tl.maximum(n_start + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M,
                              tl.cdiv(q_len, BLOCK_M) * BLOCK_M)                  # from here rows see every key
            full = tl.maximum(full, lo)
            for g in range(HEADS):
                h = j * HEADS + g
                for m in range(lo, full, BLOCK_M):
                    rows = m + tl.arange(0, BLOCK_M)
                    row_ok = rows < q_len
                    q = tl.load(Q + (q0 + rows)[:, None] * s_qt + h * s_qh + d[None, :], mask=row_ok[:, None],
                                other=0.0)
                    do = tl.load(DO + (q0 + rows)[:, None] * s_dt + h * s_dh + d[None, :], mask=row_ok[:, None],
                                 other=0.0)
                    lse = tl.load(LSE + (q0 + rows) * H + h, mask=row_ok, other=float("inf"))
                    delta = tl.load(DELTA + (q0 + rows) * H + h, mask=row_ok, other=0.0)
                    p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse[None, :])
                    p_t = tl.where(keys[:, None] <= rows[None, :] + shift, p_t, 0.0)
                    dv += tl.dot(p_t.to(do.dtype), do)
                    ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
                    dk += tl.dot(ds_t.to(q.dtype), q)
                for m in range(full, q_len, BLOCK_M):
                    rows = m + tl.arange(0, BLOCK_M)
                    row_ok = rows < q_len
                    q = tl.load(Q + (q0 + rows)[:, None] * s_qt + h * s_qh + d[None, :], mask=row_ok[:, None],
                                other=0.0)
                    do = tl.load(DO + (q0 + rows)[:, None] * s_dt + h * s_dh + d[None, :], mask=row_ok[:, None],
                                 other=0.0)
                    lse = tl.load(LSE + (q0 + rows) * H + h, mask=row_ok, other=float("inf"))
                    delta = tl.load(DELTA + (q0 + rows) * H + h, mask=row_ok, other=0.0)
                    p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse[None, :])
                    dv += tl.dot(p_t.to(do.dtype), do)
                    ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
                    dk += tl.dot(ds_t.to(q.dtype), q)
            tl.store(DK + (k0 + keys)[:, None] * s_dkt + j * s_dkh + d[None, :], (dk * scale).to(DK.dtype.element_ty),
                     mask=key_ok[:, None])
            tl.store(DV + (k0 + keys)[:, None] * s_dvt + j * s_dvh + d[None, :], dv.to(DV.dtype.element_ty),
                     mask=key_ok[:, None])

    @triton.jit
    def dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, scale, scale_log2, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh,
                  s_dt, s_dh, s_dqt, s_dqh, H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        sh = tl.program_id(0)
        seq = sh // H
        h = sh % H
        m_start = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
        q0 = tl.load(CU_Q + seq)
        q_len = tl.load(CU_Q + seq + 1) - q0
        k0 = tl.load(CU_K + seq)
        k_len = tl.load(CU_K + seq + 1) - k0
        if m_start < q_len:
            shift = k_len - q_len
            hk = h // GROUP
            rows = m_start + tl.arange(0, BLOCK_M)
            cols = tl.arange(0, BLOCK_N)
            d = tl.arange(0, D)
            row_ok = rows < q_len
            q = tl.load(Q + (q0 + rows)[:, None] * s_qt + h * s_qh + d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(DO + (q0 + rows)[:, None] * s_dt + h * s_dh + d[None, :], mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + (q0 + rows) * H + h, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + (q0 + rows) * H + h, mask=row_ok, other=0.0)
            dq = tl.zeros([BLOCK_M, D], tl.float32)
            end = tl.minimum(k_len, m_start + BLOCK_M + shift)
            full = tl.minimum(m_start + shift + 1, end) // BLOCK_N * BLOCK_N
            k_ptr = K + k0 * s_kt + hk * s_kh
            v_ptr = V + k0 * s_vt + hk * s_vh
            for n in range(0, full, BLOCK_N):
                k = tl.load(k_ptr + (n + cols)[:, None] * s_kt + d[None, :])
                v = tl.load(v_ptr + (n + cols)[:, None] * s_vt + d[None, :])
                p = tl.math.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse[:, None])
                ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
                dq += tl.dot(ds.to(k.dtype), k)
            for n in range(full, end, BLOCK_N):
                key = n + cols
                key_ok = key < k_len
                k = tl.load(k_ptr + key[:, None] * s_kt + d[None, :], mask=key_ok[:, None], other=0.0)
                v = tl.load(v_ptr + key[:, None] * s_vt + d[None, :], mask=key_ok[:, None], other=0.0)
                p = tl.math.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse[:, None])
                p = tl.where((key[None, :] <= rows[:, None] + shift) & key_ok[None, :], p, 0.0)
                ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
                dq += tl.dot(ds.to(k.dtype), k)
            tl.store(DQ + (q0 + rows)[:, None] * s_dqt + h * s_dqh + d[None, :], (dq * scale).to(DQ.dtype.element_ty),
                     mask=row_ok[:, None])

    return fwd_kernel, delta_kernel, dkdv_kernel, dq_kernel


def _kernels() -> Any:
    if not _KERNELS:
        _KERNELS.append(_build())
    return _KERNELS[0]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"packed attention wants q (T, Hq, D), k/v (S, Hkv, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")
    if cu_q.shape != cu_k.shape or cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32:
        raise ValueError("cu_q / cu_k must be int32 tensors of the same length (sequences + 1)")


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    fwd_kernel = _kernels()[0]
    t, heads, dim = q.shape
    out = torch.zeros_like(q)                    # a token outside every sequence gets zeros
    lse = torch.empty((t, heads), dtype=torch.float32, device=q.device)
    block_m, block_n, warps, stages = blocks(dim)["fwd"]
    grid = ((cu_q.numel() - 1) * heads, _cdiv(max_q, block_m))
    if grid[0] and grid[1]:
        fwd_kernel[grid](q, k, v, out, lse, cu_q, cu_k, scale * math.log2(math.e), q.stride(0), q.stride(1),
                         k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), H=heads,
                         GROUP=heads // k.shape[1], D=dim, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                         num_stages=stages)
    return out, lse


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
              scale: float) -> tuple[torch.Tensor, ...]:
    _, delta_kernel, dkdv_kernel, dq_kernel = _kernels()
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    t, heads, dim = q.shape
    kv_heads = k.shape[1]
    seqs = cu_q.numel() - 1
    delta = torch.empty((t, heads), dtype=torch.float32, device=q.device)
    # zeros: a token outside every sequence (past cu[-1]) gets no gradient rather than whatever memory held
    dq = torch.zeros_like(q)
    if t == 0 or seqs == 0:
        return dq, torch.zeros_like(k), torch.zeros_like(v)
    block = 64 if q.is_cuda else 16
    delta_kernel[(_cdiv(t, block), heads)](out, dout, delta, t, out.stride(0), out.stride(1), dout.stride(0),
                                                 dout.stride(1), H=heads, D=dim, BLOCK=block)
    scale_log2 = scale * math.log2(math.e)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0),
               dout.stride(1))
    block_m, block_n, warps, stages, *split = blocks(dim)["dkdv"]
    group = heads // kv_heads
    per = dkdv_heads(group, split[0] if split else 0)
    # dK/dV a head per part of `per` query heads: the kv heads themselves where a program sums a whole group, else
    # the parts apart (in the inputs' dtype, FlashAttention 2's way for grouped heads), added up after the kernel;
    # more, shorter programs where a group's serial loop is the grid's tail
    dk, dv = (k.new_zeros((k.shape[0], heads // per, dim)) for _ in range(2))
    if k.shape[0]:
        dkdv_kernel[(seqs * (heads // per), _cdiv(max_k, block_n))](
            q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k, scale, scale_log2, *strides, dk.stride(0), dk.stride(1),
            dv.stride(0), dv.stride(1), H=heads, GROUP=group, HEADS=per, D=dim, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=warps, num_stages=stages)
    if per < group:
        dk, dv = (part.view(k.shape[0], kv_heads, group // per, dim).sum(2) for part in (dk, dv))
    block_m, block_n, warps, stages = blocks(dim)["dq"]
    dq_kernel[(seqs * heads, _cdiv(max_q, block_m))](
        q, k, v, dout, lse, delta, dq, cu_q, cu_k, scale, scale_log2, *strides, dq.stride(0), dq.stride(1), H=heads,
        GROUP=group, D=dim, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return dq, dk, dv


def dkdv_heads(group: int, asked: int) -> int:
    """Query heads a dK/dV program sums over: the whole group (`asked` 0), else the largest divisor of the group
    not above `asked` (the settings' fifth entry; a part's sums are added after the kernel)."""
    if asked <= 0 or asked >= group:
        return group
    return max(d for d in range(1, asked + 1) if group % d == 0)


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // b)


@torch.library.custom_op("fully_async::packed_attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
            max_k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, cu_q, cu_k, max_q, scale)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, cu_q, cu_k, max_q, max_k, scale):  # noqa: ANN001, ANN202 (torch.library's signature)
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("fully_async::packed_attention_bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale)


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale):  # noqa: ANN001, ANN202
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.sizes = (max_q, max_k, scale)


def _autograd_backward(ctx: Any, dout: torch.Tensor, _dlse: Optional[torch.Tensor]) -> tuple:
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.sizes)
    return dq, dk, dv, None, None, None, None, None


_fwd_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence: q (T, Hq, D), k/v (S, Hkv, D), int32 cu_q/cu_k (sequences + 1)
    with sequence i's queries at [cu_q[i], cu_q[i+1]) and keys at [cu_k[i], cu_k[i+1]), max_q/max_k at least the
    longest; the last dimension contiguous.  Returns (T, Hq, D); differentiable in q, k and v."""
    _check(q, k, v, cu_q, cu_k)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _fwd_op(q, k, v, cu_q, cu_k, max_q, max_k, scale)[0]
