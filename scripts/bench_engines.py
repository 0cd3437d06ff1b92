"""Benchmark the rollout engines on the same workloads in one invocation: embedded (hf) vs vLLM.

Measures, per engine: start-up time; generated tokens/s for each workload (prompts x samples x max
tokens, EOS ignored so both engines generate exactly the same number of tokens); the cost of a
partial-rollout weight update as the rollouter pays it (pause = interrupt(), load = update_weights(),
resume = resubmitting prompt + partial), and for vLLM also pause_mode=keep (update with requests in
flight).  Prints a table and writes JSON.

Usage: python scripts/bench_engines.py [--model DIR] [--device cpu] [--engines hf,vllm] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from fully_async.config import asset_path  # noqa: E402
from fully_async.device import describe_hardware, get_device  # noqa: E402
from fully_async.engines.base import run_requests  # noqa: E402
from fully_async.partial import PendingResponse  # noqa: E402
from fully_async.types import GenRequest, SamplingParams  # noqa: E402

WORKLOADS = [("short", 64, 8, 8), ("long", 64, 8, 48)]  # name, prompts, samples per prompt, max tokens


def make_prompts(model_dir: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    return [tok(f"{rng.randint(0, 49)}+{rng.randint(0, 49)}=", add_special_tokens=False)["input_ids"] for _ in range(n)]


def build(name: str, model_dir: str, device, max_num_seqs: int):
    if name == "hf":
        from fully_async.engines.hf_engine import HFEngine
        return HFEngine(model_dir, device, max_num_seqs=max_num_seqs, eos_token_ids=[], pad_token_id=0)
    from fully_async.engines.vllm_engine import VLLMEngine
    return VLLMEngine(model_dir, device, max_num_seqs=max_num_seqs, eos_token_ids=[], max_model_len=64)


def throughput(engine, prompts, samples: int, max_tokens: int) -> dict:
    params = SamplingParams(1.0, 1.0, -1, max_tokens)
    reqs = [GenRequest(f"p{i}-s{j}", p, params) for i, p in enumerate(prompts) for j in range(samples)]
    start = time.perf_counter()
    outs = run_requests(engine, reqs)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs.values())
    return {"requests": len(reqs), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def partial_update(engine, prompts, weights: dict, version: int, run_s: float = 0.5) -> dict:
    """Interrupt mid-generation, load weights, resubmit prompt + partial (what the rollouter does)."""
    params = SamplingParams(1.0, 1.0, -1, 48)
    pend = {f"u{i}-s{j}": PendingResponse(f"u{i}", f"u{i}-s{j}", p, params)
            for i, p in enumerate(prompts) for j in range(8)}
    engine.submit([p.request() for p in pend.values()])
    until = time.perf_counter() + run_s
    while time.perf_counter() < until:
        for o in engine.collect():
            pend.pop(o.request_id).extend(o)
    t0 = time.perf_counter()
    partial = engine.interrupt()
    t1 = time.perf_counter()
    engine.update_weights(weights, version)
    t2 = time.perf_counter()
    resumed = [p for o in partial if not (p := pend[o.request_id]).extend(o)]
    engine.submit([p.request() for p in resumed])
    t3 = time.perf_counter()
    run_requests(engine, [])
    return {"interrupted": len(partial), "pause_s": t1 - t0, "load_s": t2 - t1, "resume_s": t3 - t2,
            "finish_after_resume_s": time.perf_counter() - t3}


def keep_update(engine, prompts, weights: dict, version: int, run_s: float = 0.5) -> dict:
    """vLLM pause_mode=keep: update weights while requests stay in flight."""
    engine.pause_mode = "keep"
    engine.submit([GenRequest(f"k{i}-s{j}", p, SamplingParams(1.0, 1.0, -1, 48))
                   for i, p in enumerate(prompts) for j in range(8)])
    time.sleep(run_s)
    in_flight = engine.num_in_flight()
    engine.update_weights(weights, version)
    out = {"in_flight": in_flight, **{f"{k}_s": v for k, v in engine.last_update_timings.items()}}
    run_requests(engine, [])
    engine.pause_mode = "abort"
    return out


def bench(name: str, model_dir: str, device, prompts, weights: dict, repeats: int) -> dict:
    start = time.perf_counter()
    engine = build(name, model_dir, device, max_num_seqs=256)
    res: dict = {"startup_s": time.perf_counter() - start}
    throughput(engine, prompts[:8], 1, 4)  # warm-up
    for wl, n_prompts, samples, max_tokens in WORKLOADS:  # best of `repeats`: the host is shared
        runs = [throughput(engine, prompts[:n_prompts], samples, max_tokens) for _ in range(repeats)]
        res[wl] = dict(max(runs, key=lambda r: r["tokens_per_s"]), all_tokens_per_s=[r["tokens_per_s"] for r in runs])
    res["partial_update"] = partial_update(engine, prompts, weights, version=1)
    if name == "vllm":
        res["keep_update"] = keep_update(engine, prompts, weights, version=2)
        res["vllm_version"] = engine.vllm_version
        engine.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=asset_path("tiny_arithmetic/model"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--out", default="bench_engines.json")
    ap.add_argument("--repeats", type=int, default=3, help="throughput runs per workload (best is reported)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = get_device(args.device)
    from transformers import AutoModelForCausalLM
    weights = {k: v.detach().clone() for k, v in
               AutoModelForCausalLM.from_pretrained(args.model).named_parameters()}
    prompts = make_prompts(args.model, 64)
    results = {"hardware": describe_hardware(device), "model": args.model, "workloads": WORKLOADS,
               "torch_threads": torch.get_num_threads(), "engines": {}}
    for name in args.engines.split(","):
        results["engines"][name] = bench(name, args.model, device, prompts, weights, args.repeats)
    print_table(results)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    print(f"wrote {args.out}")


def print_table(results: dict) -> None:
    engines = results["engines"]
    rows = [("start-up (s)", lambda r: r["startup_s"])]
    for wl, n, s, m in WORKLOADS:
        rows.append((f"{wl}: {n}x{s}x{m} tok/s", lambda r, wl=wl: r[wl]["tokens_per_s"]))
    for key in ("pause_s", "load_s", "resume_s", "finish_after_resume_s"):
        rows.append((f"partial update {key}", lambda r, key=key: r["partial_update"][key]))
    for key in ("pause_s", "load_s", "resume_s"):
        rows.append((f"keep update {key}", lambda r, key=key: r.get("keep_update", {}).get(key, float("nan"))))
    print(f"\n{results['hardware']}, torch threads {results['torch_threads']}")
    print(f"{'':34}" + "".join(f"{name:>12}" for name in engines))
    for label, get in rows:
        print(f"{label:34}" + "".join(f"{get(r):12.3f}" for r in engines.values()))


if __name__ == "__main__":
    main()
