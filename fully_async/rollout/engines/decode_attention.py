"""Decode attention over the slot cache that reads each sequence's own length (split-KV flash decoding, Triton).

Why: the decode step's grouped-query SDPA reads every row's cache up to the span bucket of the LONGEST running
sequence (a (B, 1, 1, span) mask hides the rest), so on long ragged generations each step costs what the longest
sequence costs for all of them (1x H200, 0.5B shape, 256 x 3072 new tokens: 5.1 ms per step averaged against a
~2 ms bandwidth floor).  Here one Triton program handles one (slot, KV head, split of `split` cached positions):
programs whose split starts past their slot's length return at once, the others stream only the keys/values
below that length, with the query heads that share the KV head as the rows of one small matrix product (each
cached key/value is read once per KV head, not once per query head).  A row whose length fits one split writes
its output at once; otherwise each split writes its partial softmax (output, max, sum) to a scratch buffer and
counts its arrival on a per-(row, KV head) atomic counter, and the split that arrives last merges them all and
resets the counter -- one launch per layer (a separate merging kernel cost 24 launches, 0.12 ms, of a 2.65 ms
step at 256 x 1516 on 1x H200).  A row of length 0 (a free slot) gets zeros.  Shapes are fixed per (batch, span)
bucket and the lengths are a device tensor, so the step stays capturable as a CUDA graph.

torch's own kernels do not do this job: SDPA's flash/efficient backends take no per-row key lengths (a mask
makes them read the whole span), and the varlen flash path wants token-major packed keys rather than the
engine's (slot, head, position, dim) cache and has no KV split for one query per sequence
(scripts/bench_decode_attention.py measures the alternatives).

`reference_decode_attention` is the same math in plain torch (masked SDPA); the CPU engine keeps that path, and
the unit tests compare the kernel with it (Triton's interpreter runs the kernel on CPU).
"""
from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch

# (split: cached positions per program, block_n: keys per inner iteration, warps, stages: loads in flight per
# program, Triton's software pipelining) by the decode batch's rows (the graph's bucket): the first entry whose bound
# is >= the rows.  Picked on 1x H200 by scripts/bench_decode_attention.py (--rows 64 128 256 512 1024; lengths 512,
# 1,536, 3,088 and lognormal up to 3,088; the least worst time against each case's best;
# docs/measurements/decode_attention_rows_h200/): above 128 rows, splits of 1,024 leave half the programs and
# merges of 512's for the same bytes (256 rows: 54.5 against 59.1 us at 1,536 positions, 102.0 against 104.9 at
# 3,088); at 128 rows and fewer, three loads in flight keep the few programs streaming (64 rows: 15.0 against 18.6
# us at 1,536).  Before: (512, 64, 4, 2) at every batch (docs/measurements/engine_decode_h200/).
SETTINGS: tuple[tuple[int, tuple[int, int, int, int]], ...] = (
    (128, (512, 64, 4, 3)),
    (256, (1024, 64, 4, 3)),
    (1 << 30, (1024, 64, 4, 2)),
)


def settings_for(rows: int) -> tuple[int, int, int, int]:
    """(split, block_n, warps, stages) that SETTINGS holds for a decode batch of `rows`."""
    for bound, setting in SETTINGS:
        if rows <= bound:
            return setting
    return SETTINGS[-1][1]


_KERNELS: list = []


# The kernel's arrival counters, one int32 per (row, KV head), per device (`arrival_counters`).  Every call leaves
# the counters it used at 0: a (row, KV head) with two splits or more is counted up to its number of splits and
# reset by its last split, the others never touch theirs.  So the next call -- the next layer, the next step, an
# eager call, any graph's replay, a batch smaller than the tensor -- starts from zeros without a memset, and the
# graphs of different batch buckets can share one tensor: they replay one at a time on one stream (never
# concurrently), each leaving it at 0.  Calls overlapping in time on one device (two streams) would share the
# counters too: not supported (the engine decodes on one stream).  A tensor made during a graph capture comes
# from that graph's memory pool and its zero-fill is recorded in that graph (each replay starts by filling it);
# every tensor made stays in the list, the smaller ones too, so a graph that captured one keeps it.  Until such a
# graph first replays, its tensor is not zeroed for other callers: call once outside a capture first (the engine
# does: DeviceGraphs.capture warms up on a side stream, and a bucket new to `_decode` runs eagerly first).
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, need: int) -> torch.Tensor:
    """The cached zeroed int32 counters of `device`, at least `need` of them (grown to a power of two)."""
    kept = _COUNTERS.setdefault(device, [])
    if not kept or kept[-1].numel() < need:
        kept.append(torch.zeros(1 << max(0, need - 1).bit_length(), dtype=torch.int32, device=device))
    return kept[-1]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, H, [G,] D) at each row's cos/sin (B, D), computed in float32 and rounded once
    to x's dtype (what the compiled decode step's fused elementwise kernel computes)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    c, s, f = cos.float().view(shape), sin.float().view(shape), x.float()
    half = x.shape[-1] // 2
    return (f * c + torch.cat((-f[..., half:], f[..., :half]), dim=-1) * s).to(x.dtype)


def reference_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               lengths: torch.Tensor, span: int, scale: float, k_new: Optional[torch.Tensor] = None,
                               v_new: Optional[torch.Tensor] = None, cos: Optional[torch.Tensor] = None,
                               sin: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q (B, H_kv, G, D): the G query heads sharing each KV head; caches (S >= B, H_kv, T, D); row b attends
    positions [0, min(lengths[b], span)).  With k_new/v_new (B, H_kv, D): first written in place at position
    lengths[b] - 1 of row b (where that is below span).  With cos/sin (B, D): q and k_new are rotated first
    (`rotate`).  Returns (B, H_kv, G, D) in q's dtype."""
    batch = q.shape[0]
    if cos is not None:
        q = rotate(q, cos, sin)
        k_new = rotate(k_new, cos, sin) if k_new is not None else None
    if k_new is not None:
        at = lengths[:batch] - 1
        rows = torch.nonzero(at < span).flatten()
        k_cache[rows, :, at[rows]] = k_new[rows].to(k_cache.dtype)
        v_cache[rows, :, at[rows]] = v_new[rows].to(v_cache.dtype)
    keys = torch.arange(span, device=q.device)
    allowed = keys.view(1, -1) < lengths[:batch].clamp(max=span).view(-1, 1)         # (B, span)
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, torch.finfo(q.dtype).min)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k_cache[:batch, :, :span], v_cache[:batch, :, :span], attn_mask=mask[:, None, None, :], scale=scale)


def supported(device_type: str, dtype: torch.dtype) -> Optional[str]:
    """None when the split-KV kernel runs here; else why not (the engine then keeps the masked SDPA)."""
    if device_type != "cuda" and not (device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"device {device_type!r} (the Triton kernel is built for cuda; cpu only under TRITON_INTERPRET=1)"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {dtype}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def _build() -> Any:
    """Define the kernel at first use, so importing this module does not import Triton.  With TRITON_INTERPRET=1
    set before Triton is imported it runs on CPU tensors (the unit tests do that)."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_kv_kernel(Q, K, V, KN, VN, LENS, O, ML, CNT, OUT, COS, SIN, span, scale_log2, s_qb, s_qh, s_kb, s_kh,
                        s_kt, s_vb, s_vh, s_vt, s_knb, s_knh, s_vnb, s_vnh, s_cb, s_sb, s_ob, s_oh, H: tl.constexpr,
                        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                        BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr, HAS_NEW: tl.constexpr, ROPE: tl.constexpr,
                        PRECISION: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        raw = tl.load(LENS + b).to(tl.int32)
        length = tl.minimum(raw, span)
        start = s * SPLIT
        if start < length:
            end = tl.minimum(start + SPLIT, length)
            g = tl.arange(0, G_PAD)
            d = tl.arange(0, D)
            rows = g < G
            # the row's new key/value (position raw - 1) goes into the cache here, by the one split holding it,
            # and is used from registers below (so no other program reads it and no barrier is needed)
            pos = raw - 1
            last = end if HAS_NEW else start          # without new keys/values no split holds one
            at = pos + d * 0                            # the position, as a (D,) vector for the masks
            keep = (at >= start) & (at < last)
            kn = tl.load(KN + b * s_knb + h * s_knh + d, mask=keep, other=0.0)
            vn = tl.load(VN + b * s_vnb + h * s_vnh + d, mask=keep, other=0.0)
            q = tl.load(Q + b * s_qb + h * s_qh + g[:, None] * D + d[None, :], mask=rows[:, None], other=0.0)
            if ROPE:   # rotary embedding of the query and the new key here, in float32, rounded once (rotate())
                swap = (d + D // 2) % D
                sign = tl.where(d < D // 2, -1.0, 1.0)
                cos = tl.load(COS + b * s_cb + d).to(tl.float32)
                sin = tl.load(SIN + b * s_sb + d).to(tl.float32) * sign
                q2 = tl.load(Q + b * s_qb + h * s_qh + g[:, None] * D + swap[None, :], mask=rows[:, None], other=0.0)
                q = (q.to(tl.float32) * cos[None, :] + q2.to(tl.float32) * sin[None, :]).to(q.dtype)
                kn2 = tl.load(KN + b * s_knb + h * s_knh + swap, mask=keep, other=0.0)
                kn = (kn.to(tl.float32) * cos + kn2.to(tl.float32) * sin).to(kn.dtype)
            m_i = tl.full([G_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([G_PAD], dtype=tl.float32)
            acc = tl.zeros([G_PAD, D], dtype=tl.float32)
            k_base = K + b * s_kb + h * s_kh
            v_base = V + b * s_vb + h * s_vh
            # the loop streams cached positions only, nothing but loads feeding its products (so Triton pipelines
            # them); the split holding the new position stops before it and adds the new key/value after the loop
            here = (pos >= start) & (pos < last)
            stop = tl.where(here, pos, end)
            for n0 in range(start, stop, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                valid = n < stop
                k = tl.load(k_base + n[:, None] * s_kt + d[None, :], mask=valid[:, None], other=0.0)
                qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
                qk = tl.where(valid[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_base + n[:, None] * s_vt + d[None, :], mask=valid[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
            if HAS_NEW:   # the new key/value from registers (a split whose only position it is ran no loop)
                kn = kn.to(K.dtype.element_ty)
                vn = vn.to(V.dtype.element_ty)
                qk = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * scale_log2
                qk = tl.where(here, qk, float("-inf"))
                m_new = tl.maximum(m_i, qk)
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(qk - m_new)
                l_i = l_i * alpha + p
                acc = acc * alpha[:, None] + p[:, None] * vn.to(tl.float32)[None, :]
                m_i = m_new
            tl.store(k_base + pos * s_kt + d, kn.to(K.dtype.element_ty), mask=keep)
            tl.store(v_base + pos * s_vt + d, vn.to(V.dtype.element_ty), mask=keep)
            out_at = OUT + b * s_ob + h * s_oh + g[:, None] * D + d[None, :]
            if length <= SPLIT:   # the row's only split: its softmax is complete, no scratch round-trip
                tl.store(out_at, (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=rows[:, None])
            else:
                used = tl.cdiv(length, SPLIT)
                part = (b * H + h) * NSPLIT + s
                tl.store(O + part * G * D + g[:, None] * D + d[None, :], acc, mask=rows[:, None])
                tl.store(ML + part * 2 * G + g, m_i, mask=rows)
                tl.store(ML + part * 2 * G + G + g, l_i, mask=rows)
                # every thread of the program has stored its part before the arrival is counted; the atomic
                # releases those stores and acquires the other splits' (released the same way by their programs)
                tl.debug_barrier()
                arrived = tl.atomic_add(CNT + b * H + h, 1, sem="acq_rel", scope="gpu")
                if arrived == used - 1:   # the last split of (row, KV head) to arrive merges them all
                    m = tl.full([G_PAD], float("-inf"), tl.float32)
                    l_sum = tl.zeros([G_PAD], dtype=tl.float32)
                    merged = tl.zeros([G_PAD, D], dtype=tl.float32)
                    for t in range(0, used):
                        part = (b * H + h) * NSPLIT + t
                        # ".cg": read at L2, past this SM's L1 (which may hold another call's scratch there)
                        m_t = tl.load(ML + part * 2 * G + g, mask=rows, other=0.0, cache_modifier=".cg")
                        l_t = tl.load(ML + part * 2 * G + G + g, mask=rows, other=0.0, cache_modifier=".cg")
                        o_t = tl.load(O + part * G * D + g[:, None] * D + d[None, :], mask=rows[:, None],
                                      other=0.0, cache_modifier=".cg")
                        m_new = tl.maximum(m, m_t)
                        a = tl.exp2(m - m_new)
                        c = tl.exp2(m_t - m_new)
                        merged = merged * a[:, None] + o_t * c[:, None]
                        l_sum = l_sum * a + l_t * c
                        m = m_new
                    out = merged / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
                    tl.store(out_at, out.to(OUT.dtype.element_ty), mask=rows[:, None])
                    tl.store(CNT + b * H + h, 0)   # all used splits arrived: none touches it again this call
        elif s == 0:   # a row with nothing cached (a free slot): a defined output, zeros
            g = tl.arange(0, G_PAD)
            d = tl.arange(0, D)
            zero = tl.zeros([G_PAD, D], dtype=OUT.dtype.element_ty)
            tl.store(OUT + b * s_ob + h * s_oh + g[:, None] * D + d[None, :], zero, mask=g[:, None] < G)

    return split_kv_kernel


def split_kv_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                              span: int, scale: float, k_new: Optional[torch.Tensor] = None,
                              v_new: Optional[torch.Tensor] = None, cos: Optional[torch.Tensor] = None,
                              sin: Optional[torch.Tensor] = None, split: Optional[int] = None,
                              block_n: Optional[int] = None, num_warps: Optional[int] = None,
                              num_stages: Optional[int] = None) -> torch.Tensor:
    """What `reference_decode_attention` computes (the new keys/values written included, rotated first with
    cos/sin), reading only positions [0, min(lengths[b], span)) of each row.  `lengths` (>= B,) integer device
    tensor; the caches' last dimension must be contiguous; q may be a strided view (of a fused projection's
    output) whose groups and dimension are contiguous.  Writing k_new/v_new and rotating q and k_new here saves
    the decode step a scatter and a rotary kernel each per layer.  split / block_n / num_warps / num_stages left
    None: SETTINGS' for this batch (`settings_for`)."""
    batch, kv_heads, groups, dim = q.shape
    chosen = settings_for(batch)
    split, block_n = split or chosen[0], block_n or chosen[1]
    num_warps, num_stages = num_warps or chosen[2], num_stages or chosen[3]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or dim & (dim - 1) or dim < 16:
        raise ValueError(f"split-KV decode attention: head_dim {dim} must be a power of two >= 16 and the caches' "
                         f"last dimension contiguous (strides {k_cache.stride()}, {v_cache.stride()})")
    if not _KERNELS:
        _KERNELS.append(_build())
    kernel = _KERNELS[0]
    if q.stride(-1) != 1 or q.stride(-2) != dim:
        q = q.contiguous()
    nsplit = max(1, -(-span // split))
    g_pad = max(16, 1 << (groups - 1).bit_length())
    o_part = torch.empty(batch, kv_heads, nsplit, groups, dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(batch, kv_heads, nsplit, 2, groups, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    has_new = k_new is not None
    k_new = k_new if has_new and k_new.stride(-1) == 1 else (k_new.contiguous() if has_new else k_cache)
    v_new = v_new if has_new and v_new.stride(-1) == 1 else (v_new.contiguous() if has_new else v_cache)
    rope = cos is not None
    if rope and (cos.stride(-1) != 1 or sin.stride(-1) != 1):
        cos, sin = cos.contiguous(), sin.contiguous()
    cos, sin = (cos, sin) if rope else (q, q)
    precision = "ieee" if q.dtype == torch.float32 else None   # fp32 caches: no tf32 rounding
    kernel[(batch, kv_heads, nsplit)](
        q, k_cache, v_cache, k_new, v_new, lengths, o_part, ml, arrival_counters(q.device, batch * kv_heads), out,
        cos, sin, span, scale * math.log2(math.e), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1), H=kv_heads,
        G=groups, G_PAD=g_pad, D=dim, SPLIT=split, BLOCK_N=block_n, NSPLIT=nsplit, HAS_NEW=has_new, ROPE=rope,
        PRECISION=precision, num_warps=num_warps, num_stages=num_stages)
    return out
