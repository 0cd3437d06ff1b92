"""Where a decode step of the embedded engine goes: wall time per step against the device's kernel time per step,
and the kernels that take it, at a given occupancy and context length (elsewhere than CUDA: the ops' own host time).

c sequences of 16 prompt tokens are admitted together and decode --warm steps (their context is then ~16 + warm
tokens), then 100 steps are timed and 20 profiled (torch.profiler, kernels inside replayed device graphs included).
Kernel time close to the wall time means the device is the bound (the host keeps up); the kernel table says which
work to shorten.

  python scripts/build_shaped_model.py --shape 0.5b --out /tmp/m05
  python scripts/profile_engine_step.py --model /tmp/m05 --device cuda --dtype bfloat16 --concurrency 256 \\
      --warm 200 1500 --out profile_engine_step.json

Prints a table per case and writes JSON.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from fully_async.core.types import GenRequest, SamplingParams  # noqa: E402
from fully_async.device import describe_hardware, get_device  # noqa: E402


def profile_case(engine: Any, device: Any, concurrency: int, warm: int, timed: int = 100, profiled: int = 20,
                 top: int = 15) -> dict:
    """One (occupancy, context) case on a fresh batch: every sequence runs past the profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    total = warm + timed + profiled + 8
    engine.submit([GenRequest(f"w{warm}-{i}", [2 + i % 13] * 16, SamplingParams(1.0, 1.0, -1, total))
                   for i in range(concurrency)])
    for _ in range(warm):
        engine.collect()
    device.synchronize()
    start = time.perf_counter()
    for _ in range(timed):
        engine.collect()
    device.synchronize()
    wall_ms = (time.perf_counter() - start) / timed * 1e3
    on_device = device.name == "cuda"   # the profiler's device activity (elsewhere: the ops' host time)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        for _ in range(profiled):
            engine.collect()
        device.synchronize()
    events = prof.key_averages()
    # CUDA's kernels (replayed graphs included); elsewhere the ops' own host time
    busy = (lambda e: e.self_device_time_total) if on_device else (lambda e: e.self_cpu_time_total)
    kernels = sorted((e for e in events if busy(e) > 0), key=lambda e: -busy(e))
    engine.interrupt()
    return {"concurrency": concurrency, "context": 16 + warm, "wall_ms_per_step": wall_ms,
            "busy": "device kernels" if on_device else "host ops",
            "busy_ms_per_step": sum(busy(e) for e in events) / profiled / 1e3,
            "kernels": [{"name": e.key, "ms_per_step": busy(e) / profiled / 1e3, "calls_per_step": e.count / profiled}
                        for e in kernels[:top]]}


def main(argv: list[str] | None = None) -> int:
    from bench_engines import engine_arguments

    ap = engine_arguments(__doc__)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[256], help="sequences decoding together")
    ap.add_argument("--warm", type=int, nargs="+", default=[200], help="decode steps before timing (context)")
    ap.add_argument("--timed", type=int, default=100)
    ap.add_argument("--profiled", type=int, default=20)
    ap.add_argument("--eager", action="store_true", help="no device graphs (rollout.enforce_eager=true)")
    ap.add_argument("--out", default="profile_engine_step.json")
    args = ap.parse_args(argv)
    if min(args.concurrency) < 1 or min(args.warm) < 0 or args.timed < 1 or args.profiled < 1:
        ap.error("--concurrency, --timed, --profiled >= 1 and --warm >= 0")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = get_device(args.device)
    device.set_device(0)
    from fully_async.rollout.engines.hf_engine import HFEngine

    longest = 16 + max(args.warm) + args.timed + args.profiled + 8
    engine = HFEngine(args.model, device, dtype=args.dtype, max_num_seqs=max(args.concurrency), eos_token_ids=[],
                      pad_token_id=0, max_model_len=longest, enforce_eager=args.eager)
    cases = [profile_case(engine, device, c, w, args.timed, args.profiled)
             for c in args.concurrency for w in args.warm]
    out = {"hardware": describe_hardware(device), "model": args.model, "dtype": args.dtype,
           "graphs": bool(engine._graphs), "cases": cases}
    for case in cases:
        print(f"c={case['concurrency']} context~{case['context']}: wall {case['wall_ms_per_step']:.3f} ms/step, "
              f"{case['busy']} {case['busy_ms_per_step']:.3f} ms/step")
        for k in case["kernels"]:
            print(f"  {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:6.1f}  {k['name'][:90]}")
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.out} ({out['hardware']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
