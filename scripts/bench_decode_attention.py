"""Measure the embedded engine's decode attention alone, and where a decode step's time goes (CUDA).

Why: the choice of decode attention (fully_async/rollout/engines/decode_attention.py) rests on these numbers.
Part 1 times, for one layer of a 0.5B-shaped Qwen2 cache (2 KV heads x 64, 7 query heads per KV head, bf16) at
each of --rows (256: the engine's default slots; 1,024: what the memory model gives async at the seed-003 shape):
the masked SDPA over the longest row's span bucket (the engine's attention before), the split-KV Triton kernel at
several (split, block, warps, stages; `settings`: what decode_attention.SETTINGS holds for the rows), and torch's
varlen flash attention with per-row key counts
(`seqused_k`, token-major cache) where this torch has it; each as a CUDA graph (triton.testing.do_bench_cudagraph),
with the bandwidth it reaches on the keys/values it must read.  Part 2 (--model) runs the engine on 256 sequences
and splits a step at a given length into the decode graph's device time and the rest (sampling, the host
transfer, bookkeeping), with a profiler table of the step's kernels.

  python scripts/bench_decode_attention.py --out attn.json [--rows 256 1024] [--model /tmp/m05 --at 256 1536]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from fully_async.device import describe_hardware, get_device
from fully_async.rollout.engines.decode_attention import (SETTINGS, reference_decode_attention, settings_for,
                                                          split_kv_decode_attention)

KV_HEADS, GROUPS, DIM, ROWS, CAPACITY = 2, 7, 64, 256, 3088
# (split, block, warps, pipeline stages); None: the setting decode_attention.SETTINGS holds for the rows; the settings
# before rows chose them were swept in docs/measurements/engine_decode_h200/attention_settings.json
CONFIGS = [None, (512, 64, 4, 2), (512, 64, 4, 3), (1024, 64, 4, 2), (1024, 64, 4, 3), (2048, 64, 4, 2),
           (2048, 64, 4, 3), (256, 64, 4, 2), (256, 64, 4, 3)]


def label(config: tuple) -> str:
    """A swept (split, block, warps, stages)'s name in the results."""
    split, block, warps, stages = config
    return f"split_kv_{split}_{block}_w{warps}_s{stages}"


def span_bucket(n: int) -> int:
    s = 128
    while s < n and s < CAPACITY:
        s *= 2
    return min(s, CAPACITY)


def length_cases(gen: torch.Generator, rows: int) -> dict[str, torch.Tensor]:
    z = torch.randn(rows, generator=gen)
    ragged = (0.25 * 3072 * torch.exp(0.75 * z)).round().clamp(1, 3072).long() + 16
    return {"uniform_512": torch.full((rows,), 512), "uniform_1536": torch.full((rows,), 1536),
            "uniform_3088": torch.full((rows,), 3088), "lognormal_max3088": ragged}


def flash_varlen(q: torch.Tensor, k_tok: torch.Tensor, v_tok: torch.Tensor, lengths: torch.Tensor, scale: float):
    """torch's varlen flash forward over a token-major slot cache (S*T, H_kv, D) with per-row used keys."""
    rows = q.shape[0]
    cu_q = torch.arange(rows + 1, dtype=torch.int32, device=q.device)
    cu_k = cu_q * CAPACITY
    used = lengths.to(torch.int32)

    def run():
        return torch.ops.aten._flash_attention_forward(
            q, k_tok, v_tok, cu_q, cu_k, 1, CAPACITY, 0.0, False, False, scale=scale, seqused_k=used)[0]
    return run


def attention_part(device, rows: int) -> dict:
    import triton.testing as tt

    dev = device.torch_device()
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(rows, KV_HEADS, CAPACITY, DIM, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(rows, KV_HEADS, CAPACITY, DIM, generator=gen).to(dev, torch.bfloat16)
    q = torch.randn(rows, KV_HEADS, GROUPS, DIM, generator=gen).to(dev, torch.bfloat16)
    scale = DIM ** -0.5
    k_tok = k.transpose(1, 2).contiguous().view(rows * CAPACITY, KV_HEADS, DIM)
    v_tok = v.transpose(1, 2).contiguous().view(rows * CAPACITY, KV_HEADS, DIM)
    q_tok = q.reshape(rows, KV_HEADS * GROUPS, DIM)
    out: dict = {}
    for name, lengths in length_cases(gen, rows).items():
        lengths = lengths.to(dev)
        span = span_bucket(int(lengths.max()))
        kv_bytes = int(lengths.sum()) * KV_HEADS * DIM * 2 * 2
        ref = reference_decode_attention(q.float(), k.float(), v.float(), lengths, span, scale)
        case: dict = {"span_bucket": span, "mean_len": float(lengths.float().mean()), "kv_mb": kv_bytes / 1e6}
        keys = torch.arange(span, device=dev)
        mask = torch.zeros(rows, span, dtype=torch.bfloat16, device=dev).masked_fill_(
            keys.view(1, -1) >= lengths.view(-1, 1), torch.finfo(torch.bfloat16).min)[:, None, None, :]
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, k[:, :, :span], v[:, :, :span], attn_mask=mask, scale=scale)
        timings = {"sdpa_masked_span_bucket": sdpa}
        for config in CONFIGS:
            split, block, warps, stages = config or settings_for(rows)
            timings["settings" if config is None else label(config)] = (
                lambda s=split, b=block, w=warps, st=stages: split_kv_decode_attention(
                    q, k, v, lengths, span, scale, split=s, block_n=b, num_warps=w, num_stages=st))
        timings["flash_varlen_seqused_k"] = flash_varlen(q_tok, k_tok, v_tok, lengths, scale)
        for timed, fn in timings.items():
            try:
                got = fn()
                err = float((got.float().reshape(ref.shape) - ref).abs().max())
                ms = tt.do_bench_cudagraph(fn, rep=30)
                case[timed] = {"ms": ms, "gb_per_s": kv_bytes / ms / 1e6, "max_abs_err": err}
            except Exception as exc:  # noqa: BLE001 (a variant this torch lacks is reported, not fatal)
                case[timed] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            print(rows, name, timed, case[timed], flush=True)
        out[name] = case
    return out


def pick(cases: dict) -> list:
    """The setting for these rows: of the swept (split, block, warps, stages), the one whose worst time over the
    length cases, each against that case's best, is least (no shape of lengths pays much for another's gain: the
    engine's bench decodes uniform lengths, training rollouts ragged ones); ties: the least sum of those ratios.
    `cases` is attention_part's result."""
    swept = [c for c in CONFIGS if c]
    best = {name: min(case[label(c)]["ms"] for c in swept if "ms" in case.get(label(c), {}))
            for name, case in cases.items()}
    ratios = {c: [case[label(c)]["ms"] / best[name] if "ms" in case.get(label(c), {}) else float("inf")
                  for name, case in cases.items()] for c in swept}
    return list(min(swept, key=lambda c: (max(ratios[c]), sum(ratios[c]))))


def engine_part(device, model: str, at: list[int], split_kv: bool, steps: int = 50) -> dict:
    """256 sequences decode to each length in `at`; there: wall ms per collect(), device ms per decode graph
    replay, and the top kernels of a few profiled steps."""
    from fully_async.core.types import GenRequest, SamplingParams
    from fully_async.rollout.engines.hf_engine import HFEngine, _bucket

    start = time.perf_counter()
    eng = HFEngine(model, device, dtype="bfloat16", max_num_seqs=ROWS, eos_token_ids=[], max_model_len=CAPACITY,
                   enforce_eager=False, split_kv=split_kv)
    res: dict = {"startup_s": time.perf_counter() - start, "split_kv": eng._fused.split_kv}
    eng.submit([GenRequest(f"p{i}", [2 + (i * 7 + j) % 60 for j in range(16)], SamplingParams(1.0, 1.0, -1, 3072))
                for i in range(ROWS)])
    done = 0
    for length in at:
        while done < length:
            eng.collect()
            done += 1
        device.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.collect()
        device.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
        done += steps
        key = (_bucket(eng._hi(), eng.graph_batch_sizes), _bucket(int(eng._len.max()) + 1, eng._cache.spans))
        replay = eng._graphs[key]
        device.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            replay()
        device.synchronize()
        graph = (time.perf_counter() - t0) / steps * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                eng.collect()
            device.synchronize()
        done += 5
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
        res[str(length)] = {"wall_ms_per_step": wall, "graph_ms_per_replay": graph, "bucket": list(key),
                            "profile": table}
        print(f"split_kv={split_kv} at {length}: step {wall:.2f} ms, graph {graph:.2f} ms, bucket {key}\n{table}",
              flush=True)
    eng.interrupt()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_decode_attention.json")
    ap.add_argument("--model", default=None, help="a 0.5B-shaped model folder: also profile the engine's step")
    ap.add_argument("--at", type=int, nargs="+", default=[256, 1536], help="lengths to profile the step at")
    ap.add_argument("--rows", type=int, nargs="+", default=[ROWS], help="rows (slots) of the attention part")
    ap.add_argument("--skip-attention", action="store_true")
    args = ap.parse_args()
    device = get_device("cuda")
    device.set_device(0)
    results: dict = {"hardware": describe_hardware(device), "rows": args.rows, "capacity": CAPACITY,
                     "settings_before": [[bound, list(setting)] for bound, setting in SETTINGS]}
    if not args.skip_attention:
        results["attention"] = {str(rows): attention_part(device, rows) for rows in args.rows}
        # the table these numbers pick (decode_attention.SETTINGS' form: up to each measured row count)
        results["settings"] = [[rows, pick(results["attention"][str(rows)])] for rows in sorted(args.rows)]
        print("settings", results["settings"], flush=True)
    if args.model:
        results["engine"] = {mode: engine_part(device, args.model, args.at, mode == "split_kv")
                             for mode in ("split_kv", "sdpa")}
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
