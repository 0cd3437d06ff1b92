"""The decode step's gate/up projection and SwiGLU as one Triton kernel (CUDA; Triton's interpreter on CPU for tests).

Why: at decode batch sizes the MLP's first half is two kernels that each cost more than their arithmetic.  On 1x
H200 (0.5B shape, 256 rows, docs/measurements/engine_decode_h200/profile_step2.json) cuBLAS's gate/up product
(256 x 896 by 896 x 9,728) takes 10.8 us a layer in tiles that fill 1.15 waves of the device, and the SwiGLU
after it (silu(gate) * up: 5 MB read, 2.5 MB written) 5.3 us -- 16 us of a 107 us layer.  Here one program computes a
(BM rows x BN columns) tile of the activation silu(x W_gate^T + b_gate) * (x W_up^T + b_up) from two accumulators
(the gate's and the up projection's rows n and I + n of the fused gate/up weight), in float32, rounded once: the
(B, 2I) product never goes to memory.  Programs that share a weight tile run next to each other (the tile is read
from memory once, then from L2).  On 1x H200 the whole decode step gains 1-2% (the engine alone at 256 and 1,024
x 3,072 tokens); in the step at 256 rows the MLP's half takes 13.9 us a layer (an earlier call's profile of the
two kernels: 16.1).

`TILES` holds the tile per row count, chosen on 1x H200 (docs/measurements/engine_decode_mlp_h200/): the tiles
`scripts/bench_decode_mlp.py` found fastest, kept where the whole engine decoded faster with them (256 and 1,024
rows); at 64 rows the engine was slower with the kernel although it was faster alone with its weights in L2, so
up to 128 rows map to None and the caller keeps the two-kernel path.  `reference_swiglu_matmul` is the same math
in plain torch.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

# (up to this many rows, (BM, BN, BK, warps, stages) or None: cuBLAS + the fused SwiGLU); the first entry whose
# bound is >= the row count applies, the last covers every larger count
TILES: tuple[tuple[int, Optional[tuple[int, int, int, int, int]]], ...] = (
    (128, None),                       # the engine at 64 rows was 1-5% slower with the kernel: cuBLAS
    (512, (64, 64, 64, 4, 3)),         # the engine at 256 rows: +1.1% tok/s (13.4 against 16.4 us alone)
    (1 << 30, (128, 64, 64, 8, 3)),    # the engine at 1,024 rows: +2.0% tok/s (41.4 against 49.2 us alone)
)
_KERNELS: list = []


def tile_for(rows: int) -> Optional[tuple[int, int, int, int, int]]:
    """The (BM, BN, BK, warps, stages) tile `TILES` holds for `rows`, or None (the caller keeps cuBLAS + SwiGLU)."""
    for bound, tile in TILES:
        if rows <= bound:
            return tile
    return TILES[-1][1]


def reference_swiglu_matmul(x: torch.Tensor, w_gate_up: torch.Tensor,
                            bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(x W_g^T + b_g) * (x W_u^T + b_u) in float32, rounded once to x's dtype; w_gate_up (2I, K): the gate's
    rows then the up projection's (`fused_decode.fuse_projections`'s layout)."""
    h = x.float() @ w_gate_up.float().t()
    if bias is not None:
        h = h + bias.float()
    gate, up = h.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def _build() -> Any:
    """Define the kernel at first use (importing this module does not import Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_mm_kernel(X, W, BIAS, OUT, M, N, K, s_xm, s_wn, s_om, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BM)
        pid_n = pid // tiles_m            # the programs of one weight tile are neighbours: it is read once
        pid_m = pid % tiles_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        row_ok = rm < M
        col_ok = rn < N
        x_at = X + rm[:, None] * s_xm + rk[None, :]
        g_at = W + rn[None, :] * s_wn + rk[:, None]            # (BK, BN): the gate's rows, read along K
        u_at = W + (rn + N)[None, :] * s_wn + rk[:, None]      # the up projection's rows, I further down
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            if EVEN_K:
                x = tl.load(x_at, mask=row_ok[:, None], other=0.0)
                wg = tl.load(g_at, mask=col_ok[None, :], other=0.0)
                wu = tl.load(u_at, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + rk) < K
                x = tl.load(x_at, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(g_at, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                wu = tl.load(u_at, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_g = tl.dot(x, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, wu, acc_u, input_precision=PRECISION)
            x_at += BK
            g_at += BK
            u_at += BK
        if HAS_BIAS:
            acc_g += tl.load(BIAS + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(BIAS + N + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(OUT + rm[:, None] * s_om + rn[None, :], act.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    return swiglu_mm_kernel


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def swiglu_matmul(x: torch.Tensor, w_gate_up: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  tile: Optional[tuple[int, int, int, int, int]] = None) -> torch.Tensor:
    """`reference_swiglu_matmul` in one kernel: x (..., K) with a contiguous last dimension, w_gate_up (2I, K)
    contiguous, bias (2I,) or None; returns (..., I) in x's dtype.  `tile` (BM, BN, BK, warps, stages): default
    `tile_for(rows)`, and a row count `TILES` maps to None is refused (ValueError: the caller keeps cuBLAS)."""
    rows, k = x.numel() // x.shape[-1], x.shape[-1]
    two_i = w_gate_up.shape[0]
    if w_gate_up.shape[1] != k or two_i % 2 or not w_gate_up.is_contiguous() or x.stride(-1) != 1:
        raise ValueError(f"swiglu_matmul: x {tuple(x.shape)} (last stride {x.stride(-1)}) and w_gate_up "
                         f"{tuple(w_gate_up.shape)} must be (..., K) and a contiguous (2I, K)")
    tile = tile or tile_for(rows)
    if tile is None:
        raise ValueError(f"swiglu_matmul: no tile for {rows} rows (TILES keeps cuBLAS there)")
    bm, bn, bk, warps, stages = tile
    x2 = x.reshape(rows, k)
    n = two_i // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if not _KERNELS:
        _KERNELS.append(_build())
    grid = (_cdiv(rows, bm) * _cdiv(n, bn),)
    _KERNELS[0][grid](x2, w_gate_up, bias if bias is not None else w_gate_up, out, rows, n, k, x2.stride(0),
                      w_gate_up.stride(0), out.stride(0), HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk,
                      EVEN_K=k % bk == 0, PRECISION="ieee" if x.dtype == torch.float32 else None,
                      num_warps=warps, num_stages=stages)
    return out.view(*x.shape[:-1], n)
