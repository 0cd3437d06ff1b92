"""The update's matrix products one by one, at a packed micro-batch's token count (issue 45; CUDA).

Why: the seed-003 update's matrix products take ~2.1 s of its ~2.75 s of kernels on 1x H200, the backward's
~1.6 s of it, about 3x the forward's where the count of work says 2x.  A decoder layer's linear maps make three
products each -- forward Y = X W^T, the input's gradient dX = dY W, the weight's gradient dW = dY^T X (K = the
micro-batch's tokens) -- and the small ones (the kv projections, 128 outputs at Qwen2.5-0.5B's shape; 896 x 896)
give cuBLAS few output tiles to spread over 132 SMs.  This times each product as a compiled layer calls it
(aten.mm on the same layouts), with the TFLOP/s it reaches, so the slow ones are named; and the same layer with
its q/k/v and gate/up maps fused into one product each (one weight of 1,152 and 9,728 rows) as the alternative.
The layer's sum times the layers and the micro-batches gives the update's share.  One JSON out.

    python3 scripts/bench_linear_shapes.py --tokens 30296 --micro-batches 17 --out linear_shapes.json   (CUDA)
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from bench_varlen_attention import time_ms   # CUDA events around `iters` calls after `warmup` (scripts/ is on the path)

# (name, in, out): Qwen2.5-0.5B's decoder layer (hidden 896, 14 x 64 query heads, 2 x 64 kv heads, MLP 4,864)
SHAPES = {"0.5b": dict(hidden=896, q=896, kv=128, mlp=4864, layers=24),
          "7b": dict(hidden=3584, q=3584, kv=512, mlp=18944, layers=28)}


def layer_maps(shape: dict, fused: bool) -> list[tuple[str, int, int]]:
    h, q, kv, mlp = shape["hidden"], shape["q"], shape["kv"], shape["mlp"]
    attn = [("qkv", h, q + 2 * kv)] if fused else [("q", h, q), ("k", h, kv), ("v", h, kv)]
    ffn = [("gate_up", h, 2 * mlp)] if fused else [("gate", h, mlp), ("up", h, mlp)]
    return attn + [("o", q, h)] + ffn + [("down", mlp, h)]


def time_map(tokens: int, n_in: int, n_out: int, warmup: int, iters: int) -> dict:
    """Forward, input gradient and weight gradient of one bf16 linear map (T x in -> T x out), as aten.mm with a
    compiled layer's layouts; the weight gradient also as (X^T dY)^T, the other order of the same product."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(tokens, n_in, device=dev, dtype=dt)
    w = torch.randn(n_out, n_in, device=dev, dtype=dt)
    dy = torch.randn(tokens, n_out, device=dev, dtype=dt)
    flop = 2.0 * tokens * n_in * n_out
    cases = {"forward": lambda: torch.mm(x, w.t()), "input_grad": lambda: torch.mm(dy, w),
             "weight_grad": lambda: torch.mm(dy.t(), x), "weight_grad_other_order": lambda: torch.mm(x.t(), dy).t()}
    row = {}
    for name, fn in cases.items():
        ms = time_ms(fn, warmup, iters)
        row[name] = {"ms": ms, "tflops": flop / ms / 1e9}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--tokens", type=int, default=30296, help="tokens of a packed micro-batch (seed-003: 515,032 / 17)")
    p.add_argument("--micro-batches", type=int, default=17)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="linear_shapes.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear_shapes.py times CUDA matrix products: no CUDA device here", file=sys.stderr)
        return 2
    from fully_async.device import describe_hardware, get_device

    shape = SHAPES[args.shape]
    out: dict[str, Any] = {"hardware": describe_hardware(get_device("cuda")), "torch": torch.__version__,
                           "shape": args.shape, "tokens": args.tokens, "micro_batches": args.micro_batches}
    for layout in ("separate", "fused"):
        rows = {}
        for name, n_in, n_out in layer_maps(shape, layout == "fused"):
            rows[name] = time_map(args.tokens, n_in, n_out, args.warmup, args.iters)
            r = rows[name]
            print(f"{layout:>8} {name:>8} {n_in:>6}->{n_out:<6} " + "  ".join(
                f"{k} {v['ms']:.3f} ms {v['tflops']:4.0f} TF/s" for k, v in r.items()))
        best_wgrad = {n: min(r["weight_grad"]["ms"], r["weight_grad_other_order"]["ms"]) for n, r in rows.items()}
        per_layer = {"forward_ms": sum(r["forward"]["ms"] for r in rows.values()),
                     "backward_ms": sum(r["input_grad"]["ms"] + r["weight_grad"]["ms"] for r in rows.values()),
                     "backward_best_order_ms": sum(r["input_grad"]["ms"] + best_wgrad[n] for n, r in rows.items())}
        scale = shape["layers"] * args.micro_batches / 1e3
        update = {k.replace("_ms", "_s"): v * scale for k, v in per_layer.items()}
        out[layout] = {"maps": rows, "per_layer": per_layer, "update": update}
        print(f"{layout}: the update's matrix products (x {shape['layers']} layers x {args.micro_batches} micro-batches):"
              f" forward {update['forward_s']:.3f} s, backward {update['backward_s']:.3f} s "
              f"({update['backward_best_order_s']:.3f} s with each weight gradient's faster order)")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
