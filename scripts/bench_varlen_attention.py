"""The packed attention kernels alone, forward and backward, at a real update's micro-batches (issue 45).

The seed-003 step's update spends ~0.73 s of its ~3.1 s in FlashAttention's varlen kernel (torch's bundled
FlashAttention 2: 0.22 s forward, 0.51 s backward; 1x H200).  This times, on the same packed micro-batches:
- `flash`: torch.nn.attention.varlen's kernel, what core/varlen_attention.packed_causal_attention runs today;
- `triton`: core/triton_attention.py's kernels (grouped kv heads read as they are; `--sweep` tries their block
  settings first);
- `cudnn`: cuDNN's fused attention over the same ragged batch (aten._cudnn_attention_forward/_backward with the
  sequences' offsets; grouped kv heads repeated to the query heads, as torch's own binding needs); its output and
  gradients are checked against `flash`'s;
and the prefill chunk's attention (4,096 queries after 8,192 cached keys, causal to the bottom right): `flash` with
key offsets of its own (what the engine's chunked prefill runs now) against sdpa with torch's CausalBias (what it
ran before).  Baselines run in the same invocation; one JSON out.

    python3 scripts/bench_varlen_attention.py --out /tmp/varlen_attention.json      (CUDA)
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Optional

import torch


def workload_micro_batches(rows: int, max_prompt: int, max_response: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Sequence lengths of the update's packed micro-batches: `rows` responses of benchmark.response_length=lognormal
    at max_response plus prompts U[max_prompt/8, max_prompt], packed in order up to max_tokens a micro-batch."""
    from fully_async.core.workload import LengthProfile

    g = torch.Generator().manual_seed(seed)
    profile = LengthProfile.lognormal(max_response, seed=seed)
    batches: list[list[int]] = [[]]
    for i in range(rows):
        length = int(torch.randint(max_prompt // 8, max_prompt + 1, (1,), generator=g)) + profile.target(f"s{i}")
        if batches[-1] and sum(batches[-1]) + length > max_tokens:
            batches.append([])
        batches[-1].append(length)
    return batches


def causal_flops(q_lens: list[int], k_lens: list[int], heads: int, head_dim: int) -> float:
    """Forward matrix work of causal attention (QK^T and PV over the allowed pairs)."""
    pairs = sum(q * k - q * (q - 1) / 2 for q, k in zip(q_lens, k_lens))
    return 4.0 * pairs * heads * head_dim


class CudnnVarlen(torch.autograd.Function):
    """cuDNN's fused attention over a ragged batch, q/k/v (T, H, D) with the same heads, causal."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                max_q: int, max_k: int, scale: float) -> torch.Tensor:
        r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, True, False,
                                                    scale=scale)
        out, lse, seed, offset = r[0], r[1], r[6], r[7]
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
        ctx.sizes = (max_q, max_k, scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        max_q, max_k, scale = ctx.sizes
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad_out=grad.contiguous(), query=q, key=k, value=v, out=out, logsumexp=lse, philox_seed=seed,
            philox_offset=offset, attn_bias=None, cum_seq_q=cu_q, cum_seq_k=cu_k, max_q=max_q, max_k=max_k,
            dropout_p=0.0, is_causal=True, scale=scale)
        return dq, dk, dv, None, None, None, None, None


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                    max_q: int, max_k: int, scale: float) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return CudnnVarlen.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                    max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """FlashAttention's varlen kernel itself (torch's varlen_attn), not packed_causal_attention: that one runs the
    Triton kernels on Hopper (auto), so a "flash" column through it timed Triton's (2026-11-30, session 8)."""
    from fully_async.core.varlen_attention import flash_call

    return flash_call(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, scale)


def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
           max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """What the package runs: packed_causal_attention (on CUDA its `fused_kernel`, Triton's on Hopper or
    FlashAttention's; elsewhere causal sdpa per sequence)."""
    from fully_async.core.varlen_attention import packed_causal_attention

    return packed_causal_attention(q, k, v, cu_q, max_q, scale, cu_k, max_k)


def lower_right_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """One sequence: sdpa under torch's CausalBias, 4-d as the engine called it (the chunked prefill's attention
    before it ran flash)."""
    from fully_async.core.varlen_attention import _causal_sdpa

    if cu_q.numel() != 2:
        raise ValueError(f"sdpa_lower_right times one sequence, got {cu_q.numel() - 1}")
    return _causal_sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale).transpose(0, 1)


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """core/triton_attention.py's kernels at its current block settings (grouped kv heads read as they are)."""
    from fully_async.core.triton_attention import packed_attention

    return packed_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale)


KERNELS: dict[str, Callable[..., torch.Tensor]] = {"flash": flash_attention, "cudnn": cudnn_attention,
                                                   "triton": triton_attention, "sdpa_lower_right": lower_right_sdpa,
                                                   "packed": packed}

# --sweep: block settings (BLOCK_M, BLOCK_N, warps, stages) tried per Triton kernel on the update's micro-batches,
# one kernel at a time with the others at their best so far (the first of each list is where it starts); settings
# that do not fit a device (shared memory, registers) are recorded as failed.  dK/dV's fifth entry: query heads a
# program sums over (1: one each, the parts added after; absent: its kv head's whole group)
SWEEP = {"fwd": [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4),
                 (64, 128, 4, 3), (64, 32, 4, 3), (128, 64, 4, 2), (64, 64, 8, 2)],
         "dkdv": [(32, 128, 4, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3),
                  (128, 128, 8, 2), (32, 128, 8, 2), (16, 64, 4, 3), (32, 64, 8, 2), (64, 64, 8, 2),
                  (32, 128, 4, 3, 1), (32, 64, 4, 3, 1), (64, 64, 4, 3, 1), (64, 128, 8, 2, 1), (16, 64, 4, 3, 1),
                  (32, 128, 8, 2, 1), (64, 64, 8, 2, 1)],
         "dq": [(64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3),
                (128, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3), (64, 32, 8, 2)]}


def sweep_triton(batches: list[list[int]], shape: tuple, warmup: int, iters: int) -> dict:
    """Each Triton kernel's block settings in turn (SWEEP), timed over `batches` (forward, or forward + backward);
    the module keeps the best of each.  Returns every setting's time and the best."""
    from fully_async.core import triton_attention as ta

    heads, kv_heads, head_dim = shape
    dev, dtype, scale = torch.device("cuda"), torch.bfloat16, head_dim ** -0.5
    cases = []
    for lens in batches:
        q = torch.randn(sum(lens), heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(sum(lens), kv_heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
                for _ in range(2))
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
        cases.append((q, k, v, cu, max(lens), torch.randn_like(q)))
    report: dict[str, Any] = {}
    current = ta.BLOCKS.setdefault(head_dim, {k: v[0] for k, v in SWEEP.items()})
    for name, settings in SWEEP.items():
        timed = []
        for setting in settings:
            current[name] = setting
            if name == "fwd":
                def run() -> None:
                    with torch.no_grad():
                        for q, k, v, cu, mx, _ in cases:
                            ta.packed_attention(q, k, v, cu, cu, mx, mx, scale)
            else:
                def run() -> None:
                    for q, k, v, cu, mx, g in cases:
                        ta.packed_attention(q, k, v, cu, cu, mx, mx, scale).backward(g)
            try:
                timed.append((time_ms(run, warmup, iters), setting))
            except Exception as exc:       # a setting this device cannot run (shared memory): recorded
                print(f"sweep {name} {setting}: {type(exc).__name__}: {str(exc)[:200]}")
                report.setdefault("failed", []).append([name, list(setting), str(exc)[:200]])
        if not timed:
            raise RuntimeError(f"no {name} setting of SWEEP runs at head_dim {head_dim} on this device")
        best = min(timed)[1]
        current[name] = best
        report[name] = {"best": list(best), "ms": {str(list(s)): t for t, s in timed}}
        print(f"sweep {name}: " + ", ".join(f"{list(s)} {t:.2f} ms" for t, s in sorted(timed)[:4]) + f" -> {list(best)}")
    return report


def time_ms(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():      # the CPU check of this script's logic
        import time

        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run_case(name: str, q_lens: list[int], k_lens: list[int], kernels: list[str], heads: int, kv_heads: int,
             head_dim: int, backward: bool, warmup: int, iters: int, device: str = "cuda") -> dict:
    torch.manual_seed(0)
    dev, dtype, scale = torch.device(device), torch.bfloat16, head_dim ** -0.5
    q = torch.randn(sum(q_lens), heads, head_dim, device=dev, dtype=dtype)
    k, v = (torch.randn(sum(k_lens), kv_heads, head_dim, device=dev, dtype=dtype) for _ in range(2))
    grad = torch.randn_like(q)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
                  for lens in (q_lens, k_lens))
    fwd_flops = causal_flops(q_lens, k_lens, heads, head_dim)
    row: dict[str, Any] = {"case": name, "sequences": len(q_lens), "query_tokens": sum(q_lens),
                           "key_tokens": sum(k_lens), "max_len": max(k_lens), "forward_gflop": fwd_flops / 1e9,
                           "kernels": {}}
    reference: Optional[tuple] = None
    for kernel in kernels:
        fn = KERNELS[kernel]
        leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
        args = (*leaves, cu_q, cu_k, max(q_lens), max(k_lens), scale)
        try:
            with torch.no_grad():
                fwd_ms = time_ms(lambda: fn(*args), warmup, iters)

            def step() -> None:
                fn(*args).backward(grad)
            both_ms = time_ms(step, warmup, iters) if backward else None
            for t in leaves:
                t.grad = None
            out = fn(*args)
            if backward:
                out.backward(grad)
            result = (out.detach().float(), *(t.grad.float() if backward else None for t in leaves))
        except Exception as exc:      # a kernel this torch / device does not run: recorded, the others go on
            row["kernels"][kernel] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"{name:>14} {kernel:>17}  failed: {row['kernels'][kernel]['error']}")
            continue
        entry: dict[str, Any] = {"forward_ms": fwd_ms, "forward_tflops": fwd_flops / fwd_ms / 1e9}
        if backward:
            entry.update(forward_backward_ms=both_ms, backward_ms=both_ms - fwd_ms,
                         backward_tflops=2.5 * fwd_flops / max(both_ms - fwd_ms, 1e-9) / 1e9)
        if reference is None:
            reference = result
        else:
            entry["max_abs_diff_vs_" + kernels[0]] = {
                part: float((a - b).abs().max()) for part, a, b in zip(("out", "dq", "dk", "dv"), result, reference)
                if a is not None}
        row["kernels"][kernel] = entry
        bwd = f"  backward {entry['backward_ms']:7.2f} ms ({entry['backward_tflops']:5.0f} TFLOP/s)" if backward else ""
        print(f"{name:>14} {kernel:>17}  forward {fwd_ms:7.2f} ms ({entry['forward_tflops']:5.0f} TFLOP/s){bwd}")
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=512, help="responses of the update (seed-003: 64 x 8)")
    p.add_argument("--max-prompt", type=int, default=16)
    p.add_argument("--max-response", type=int, default=3072)
    p.add_argument("--max-tokens", type=int, default=32768, help="tokens a packed micro-batch (ppo_max_token_len)")
    p.add_argument("--micro-batches", type=int, default=4, help="how many of the update's micro-batches to time")
    p.add_argument("--heads", type=int, default=14, help="query heads (Qwen2.5-0.5B: 14)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kernels", nargs="+", default=["flash", "cudnn"], choices=sorted(KERNELS))
    p.add_argument("--chunk", type=int, nargs=2, default=[4096, 8192], metavar=("QUERIES", "PREFIX"),
                   help="the prefill chunk case: QUERIES tokens after PREFIX cached ones (0 0: skip it)")
    p.add_argument("--sweep", action="store_true", help="first try the Triton kernels' block settings (SWEEP) on "
                   "the timed micro-batches and keep the best of each")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="varlen_attention.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_varlen_attention.py times CUDA kernels: no CUDA device here", file=sys.stderr)
        return 2
    from fully_async.device import describe_hardware, get_device

    batches = workload_micro_batches(args.rows, args.max_prompt, args.max_response, args.max_tokens, args.seed)
    shape = (args.heads, args.kv_heads, args.head_dim)
    sweep = sweep_triton(batches[:args.micro_batches], shape, args.warmup, args.iters) if args.sweep else None
    rows = [run_case(f"update mb{i}", lens, lens, args.kernels, *shape, True, args.warmup, args.iters)
            for i, lens in enumerate(batches[:args.micro_batches])]
    totals: dict[str, Any] = {}
    for kernel in args.kernels:
        done = [r["kernels"][kernel] for r in rows if "error" not in r["kernels"].get(kernel, {"error": 1})]
        if len(done) == len(rows):
            totals[kernel] = {"forward_ms": sum(d["forward_ms"] for d in done),
                              "forward_backward_ms": sum(d["forward_backward_ms"] for d in done)}
    if args.chunk[0]:
        queries, prefix = args.chunk
        rows.append(run_case("prefill chunk", [queries], [prefix + queries], ["flash", "triton", "sdpa_lower_right"], *shape,
                             False, args.warmup, args.iters))
    out = {"hardware": describe_hardware(get_device("cuda")), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "heads": args.heads, "kv_heads": args.kv_heads,
           "head_dim": args.head_dim, "update_micro_batches": len(batches), "timed_micro_batches": args.micro_batches,
           "tokens_per_micro_batch": [sum(b) for b in batches], "totals_over_timed": totals, "cases": rows,
           "triton_sweep": sweep}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for kernel, t in totals.items():
        print(f"{kernel}: {t['forward_ms']:.1f} ms forward, {t['forward_backward_ms']:.1f} ms forward+backward over "
              f"{args.micro_batches} of the update's {len(batches)} micro-batches")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
