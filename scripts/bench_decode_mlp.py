"""Time the decode step's gate/up projection + SwiGLU: cuBLAS's product and inductor's fused SwiGLU (the engine's
path before) against decode_mlp.py's one Triton kernel at several tiles, per batch bucket (CUDA).

Why: `decode_mlp.TILES` (which tile at which row count, or cuBLAS) starts from these numbers.  Each variant runs
as a CUDA graph (triton.testing.do_bench_cudagraph), at the 0.5B shape by default (hidden 896, intermediate 4,864),
for the engine's batch buckets, over --copies weight tensors in turn (as a decode step passes through its layers'
weights; one copy stays in the H200's 50 MB L2 between calls, which flatters the tiles that re-read it: with one
copy a tile that was faster here at 64 rows made the engine slower); each tile's largest error against the
float32 reference is printed beside cuBLAS's.  The JSON's "tiles" is the table the numbers pick: per row count
the fastest tile where it beats the baseline by 3% or more, else None.  Confirm a table on the whole engine
(`bash scripts/gpu_verify.sh decode`) before adopting it.

  python scripts/bench_decode_mlp.py --out mlp.json [--hidden 896 --intermediate 4864 --rows 16 64 256]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from fully_async.device import describe_hardware, get_device
from fully_async.rollout.engines.decode_mlp import TILES, reference_swiglu_matmul, swiglu_matmul

# (BM, BN, BK, warps, stages)
CANDIDATES = [(16, 64, 128, 4, 4), (16, 128, 64, 4, 4), (32, 64, 64, 4, 4), (32, 64, 128, 4, 3), (32, 128, 64, 4, 3),
              (64, 32, 64, 4, 4), (64, 64, 64, 4, 3), (64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 8, 3),
              (64, 32, 128, 4, 3), (128, 32, 64, 4, 4), (128, 64, 64, 8, 3), (128, 64, 64, 4, 3), (128, 32, 128, 4, 3),
              (128, 64, 128, 8, 3)]
ROWS = [16, 32, 48, 64, 96, 128, 256, 512, 1024]


def baseline(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The engine's path before: one cuBLAS product over the fused gate/up weight, then silu(gate) * up."""
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up


def pick(timed: list[dict], base_us: float, margin: float) -> tuple[dict | None, list | None]:
    """(the fastest tile's entry or None, its tile where it beats the baseline by `margin` or more, else None)."""
    best = min(timed, key=lambda t: t["us"]) if timed else None
    return best, (best["tile"] if best and best["us"] <= (1 - margin) * base_us else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--copies", type=int, default=8, help="weight tensors used in turn (8 x 17 MB > the L2)")
    ap.add_argument("--margin", type=float, default=0.03, help="a tile must beat the baseline by this share")
    ap.add_argument("--out", default="decode_mlp.json")
    args = ap.parse_args()
    import triton.testing as tt

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    ws = [(torch.randn(2 * args.intermediate, args.hidden, device=device, generator=gen) / args.hidden ** 0.5
           ).to(torch.bfloat16) for _ in range(args.copies)]
    w = ws[0]
    compiled = torch.compile(baseline, dynamic=True)
    cases, tiles = [], []
    for rows in args.rows:
        x = torch.randn(rows, 1, args.hidden, device=device, generator=gen).to(torch.bfloat16)
        want = reference_swiglu_matmul(x, w).float()
        compiled(x, w)
        base_us = tt.do_bench_cudagraph(lambda: [compiled(x, wi) for wi in ws], rep=30) * 1e3 / len(ws)
        base_err = (compiled(x, w).float() - want).abs().max().item()
        row = {"rows": rows, "baseline_us": base_us, "baseline_max_err": base_err, "tiles": []}
        for tile in CANDIDATES:
            if tile[0] > max(16, 2 * rows):
                continue
            try:
                got = swiglu_matmul(x, w, tile=tile)
                us = tt.do_bench_cudagraph(lambda: [swiglu_matmul(x, wi, tile=tile) for wi in ws],
                                           rep=30) * 1e3 / len(ws)
            except Exception as e:  # noqa: BLE001 -- a tile the device cannot run (shared memory) is skipped
                row["tiles"].append({"tile": list(tile), "error": str(e)[:200]})
                continue
            row["tiles"].append({"tile": list(tile), "us": us, "max_err": (got.float() - want).abs().max().item()})
        best, chosen = pick([t for t in row["tiles"] if "us" in t], base_us, args.margin)
        row["best"] = best
        tiles.append([rows, chosen])
        print(f"rows {rows:5d}: cuBLAS + SwiGLU {base_us:6.2f} us (err {base_err:.3g}); best tile "
              f"{best['tile'] if best else None} {best['us'] if best else float('nan'):6.2f} us "
              f"(err {best['max_err'] if best else float('nan'):.3g}) -> {chosen}", flush=True)
        cases.append(row)
    result = {"hardware": describe_hardware(get_device("cuda")), "hidden": args.hidden,
              "intermediate": args.intermediate, "copies": args.copies,
              "tiles_before": [list(t) for t in TILES], "tiles": tiles, "cases": cases}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
