"""Benchmark the rollout engines and transformers' own generate on the same workload, in one invocation.

For each engine (`hf`: the embedded engine as configured by default: llama-family decode as fused per-layer
functions, compiled on CUDA, replayed from device graphs on CUDA/NPU, attention by the split-KV kernel that
reads each sequence's own length on CUDA; `hf_sdpa`: the same with the masked SDPA over the longest sequence's
span bucket (the attention before the split-KV kernel); `hf_modules`: the same with transformers'
own modules in the graphs; `hf_eager`: no graphs, `vllm`) and each baseline (`generate`: model.generate with its
default cache, `generate_static`: model.generate(cache_implementation="static"), which transformers compiles
on CUDA), at each concurrency c: c sequences of --prompt-len random prompt tokens, --new-tokens sampled
tokens each (EOS ignored, so every contender generates exactly c x new-tokens tokens), temperature 1.
`--lengths lognormal` makes the workload ragged instead: --waves x c requests, each with its own max_tokens
drawn like benchmark.response_length=lognormal (median a quarter of --new-tokens, sigma 0.75, clipped to it;
fully_async/core/workload.py), the same draws for every contender; baselines are skipped there (generate pads
every sequence to the longest).
Reported per (contender, c): the first run's tokens/s (start-up effects: kernel selection, compilation,
allocator growth) and the warm tokens/s (best of --repeats later runs), ms per decode step (wall / new
tokens) and the start-up time of the contender.  Engines also get the cost of a partial-rollout weight
update as the rollouter pays it (pause = interrupt(), load = update_weights(), resume = resubmit prompt +
partial), and vLLM pause_mode=keep (update with requests in flight), unless --no-updates.  `--resume-budgets`
(embedded engines) measures an abort update's re-prefill burst at full occupancy under each prefill budget
(actor_rollout_ref.rollout.max_num_batched_tokens; 0: none), on the same partial responses (resume_burst).

  python scripts/build_shaped_model.py --shape 0.5b --out /tmp/m05
  python scripts/bench_engines.py --model /tmp/m05 --device cuda --dtype bfloat16 --engines hf \\
      --baselines generate_static --concurrency 64 256 --new-tokens 256 --out bench_engines.json

Prints a table and writes JSON.  Every number of one invocation comes from the same device.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any, Callable, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from fully_async.core.config import asset_path  # noqa: E402
from fully_async.device import describe_hardware, get_device, parse_dtype  # noqa: E402
from fully_async.rollout.engines.base import run_requests  # noqa: E402
from fully_async.core.partial import PendingResponse  # noqa: E402
from fully_async.core.types import GenRequest, SamplingParams  # noqa: E402

ENGINES = ("hf", "hf_sdpa", "hf_modules", "hf_eager", "vllm")
BASELINES = ("generate", "generate_static")


def make_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Random token prompts of one length (no padding: every contender sees the same tensor shapes)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def build_engine(name: str, model_dir: str, device: Any, dtype: str, max_num_seqs: int, max_len: int,
                 budget: Optional[int] = None) -> Any:
    if name.startswith("hf"):   # hf: fused (compiled) decode replayed from device graphs where the device has them
        from fully_async.rollout.engines.hf_engine import HFEngine
        return HFEngine(model_dir, device, dtype=dtype, max_num_seqs=max_num_seqs, eos_token_ids=[], pad_token_id=0,
                        max_model_len=max_len, enforce_eager=name == "hf_eager", fused_decode=name != "hf_modules",
                        split_kv=False if name == "hf_sdpa" else None, max_num_batched_tokens=budget)
    from fully_async.rollout.engines.vllm_engine import VLLMEngine
    return VLLMEngine(model_dir, device, dtype=dtype, max_num_seqs=max_num_seqs, eos_token_ids=[],
                      max_model_len=max_len)


def engine_runner(engine: Any, new_tokens: int, lengths: dict[int, list[int]] | None = None
                  ) -> Callable[[list[list[int]]], int]:
    """Each prompt generates new_tokens, or (ragged) its own length from `lengths[len(prompts)]`."""
    def run(prompts: list[list[int]]) -> int:
        per = lengths[len(prompts)] if lengths else [new_tokens] * len(prompts)
        outs = run_requests(engine, [GenRequest(f"r{i}", p, SamplingParams(1.0, 1.0, -1, n))
                                     for i, (p, n) in enumerate(zip(prompts, per))])
        return sum(len(o.token_ids) for o in outs.values())
    return run


def lognormal_lengths(n: int, max_len: int, seed: int) -> list[int]:
    from fully_async.core.workload import LengthProfile
    profile = LengthProfile.lognormal(max_len, seed=seed)
    return [profile.target(f"s{i}") for i in range(n)]


def generate_runner(model: Any, device: Any, new_tokens: int, static: bool) -> Callable[[list[list[int]]], int]:
    def run(prompts: list[list[int]]) -> int:
        ids = torch.tensor(prompts, device=device.torch_device())
        kwargs = {"cache_implementation": "static"} if static else {}
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 pad_token_id=0, **kwargs)
        return int(out[:, ids.shape[1]:].numel())
    return run


def timed(run: Callable[[list[list[int]]], int], prompts: list[list[int]], device: Any) -> dict:
    device.synchronize()
    start = time.perf_counter()
    tokens = run(prompts)
    device.synchronize()
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def measure(run: Callable[[list[list[int]]], int], prompts_by_c: dict[int, list[list[int]]], device: Any,
            repeats: int, new_tokens: int) -> dict:
    out = {}
    for c, prompts in prompts_by_c.items():
        first = timed(run, prompts, device)
        warm = [timed(run, prompts, device) for _ in range(repeats)]
        best = max(warm, key=lambda r: r["tokens_per_s"])
        out[str(c)] = {"first": first, "warm": best, "warm_all_tokens_per_s": [r["tokens_per_s"] for r in warm],
                       "ms_per_step": 1e3 * best["wall_s"] / (best["tokens"] / c)}   # steps at c in flight
    return out


def partial_update(engine: Any, prompts: list[list[int]], weights: dict, version: int, new_tokens: int,
                   run_s: float = 0.5) -> dict:
    """Interrupt mid-generation, load weights, resubmit prompt + partial (what the rollouter does)."""
    params = SamplingParams(1.0, 1.0, -1, new_tokens)
    pend = {f"u{i}": PendingResponse(f"u{i}", f"u{i}", p, params) for i, p in enumerate(prompts)}
    engine.submit([p.request() for p in pend.values()])
    until = time.perf_counter() + run_s
    while time.perf_counter() < until and engine.num_in_flight():
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


def resume_burst(engine: Any, prompts: list[list[int]], lengths: list[int], weights: dict, version: int,
                 budget: int | None, run_steps: int) -> dict:
    """An abort weight update at full occupancy, as the rollouter pays it, under one prefill budget: the requests
    (more than the engine's slots: the rest wait) generate for `run_steps` engine steps, are interrupted, the
    weights load, and every response resumes from prompt + partial (re-prefilled under
    `engine.max_num_batched_tokens = budget`).  Reported: how long until no resumed request waits (`admitted_s`),
    the tokens of the responses finished by then, and the time to finish everything after the resume (the same
    partial responses and remaining tokens for every budget: each engine step generates one token per running
    sequence, and the budget applies from the resume on)."""
    configured, engine.max_num_batched_tokens = engine.max_num_batched_tokens, None   # the same partials for all
    pend = {f"b{i}": PendingResponse(f"b{i}", f"b{i}", p, SamplingParams(1.0, 1.0, -1, n))
            for i, (p, n) in enumerate(zip(prompts, lengths))}
    engine.submit([p.request() for p in pend.values()])
    for _ in range(run_steps):
        for o in engine.collect():
            pend[o.request_id].extend(o)
    resumed = [p for o in engine.interrupt() if not (p := pend[o.request_id]).extend(o)]
    engine.update_weights(weights, version)
    engine.max_num_batched_tokens = budget
    prefix = [len(p.prompt_ids) + len(p.token_ids) for p in resumed]
    remaining = sum(p.budget - len(p.token_ids) for p in resumed)
    t0 = time.perf_counter()
    engine.submit([p.request() for p in resumed])
    admitted_s, tokens_by_admitted, tokens, steps = None, 0, 0, 0
    while engine.num_in_flight():
        for o in engine.collect():
            tokens += len(o.token_ids)
        steps += 1
        if admitted_s is None and not engine.waiting:
            admitted_s, tokens_by_admitted = time.perf_counter() - t0, tokens
    finish_s = time.perf_counter() - t0
    engine.max_num_batched_tokens = configured
    return {"budget": budget, "resumed": len(resumed), "prefix_tokens_mean": sum(prefix) / max(1, len(prefix)),
            "prefix_tokens_max": max(prefix, default=0), "remaining_tokens": remaining,
            "generated_tokens": tokens, "admitted_s": admitted_s, "finished_tokens_by_admitted": tokens_by_admitted,
            "finish_after_resume_s": finish_s, "collect_calls": steps,
            "tokens_per_s_after_resume": remaining / finish_s}


def keep_update(engine: Any, prompts: list[list[int]], weights: dict, version: int, new_tokens: int,
                run_s: float = 0.5) -> dict:
    """vLLM pause_mode=keep: update weights while requests stay in flight."""
    engine.pause_mode = "keep"
    engine.submit([GenRequest(f"k{i}", p, SamplingParams(1.0, 1.0, -1, new_tokens)) for i, p in enumerate(prompts)])
    time.sleep(run_s)
    in_flight = engine.num_in_flight()
    engine.update_weights(weights, version)
    out = {"in_flight": in_flight, **{f"{k}_s": v for k, v in engine.last_update_timings.items()}}
    run_requests(engine, [])
    engine.pause_mode = "abort"
    return out


def engine_arguments(doc: str) -> argparse.ArgumentParser:
    """The parser of an engine benchmark: its docstring as help, and the model, device and dtype to run."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    ap.add_argument("--model", default=asset_path("tiny_arithmetic/model"), help="local HF model folder")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | npu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = engine_arguments(__doc__)
    ap.add_argument("--engines", default="hf", help=f"comma-separated from {ENGINES}, or '' for none")
    ap.add_argument("--baselines", default="generate_static",
                    help=f"comma-separated from {BASELINES}, or '' for none")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256], help="sequences generated together")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence (EOS ignored)")
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per sequence")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="the embedded engine's prefill budget (actor_rollout_ref.rollout.max_num_batched_tokens: a "
                         "run's default is verl's 8192; 0: none, as the earlier measurements ran)")
    ap.add_argument("--repeats", type=int, default=3, help="warm runs per concurrency (the best is reported)")
    ap.add_argument("--lengths", default="fixed", choices=("fixed", "lognormal"),
                    help="fixed: every sequence generates --new-tokens; lognormal: ragged (see above)")
    ap.add_argument("--waves", type=int, default=4, help="--lengths lognormal: requests = waves x concurrency")
    ap.add_argument("--no-updates", action="store_true", help="skip the weight-update measurements")
    ap.add_argument("--resume-budgets", type=int, nargs="*", default=[],
                    help="embedded engines: an abort update's re-prefill at full occupancy under each "
                         "max_num_batched_tokens (0: no bound), lognormal lengths up to --new-tokens, "
                         "2 x the largest concurrency requests (resume_burst)")
    ap.add_argument("--resume-after-steps", type=int, default=1000, help="--resume-budgets: engine steps before "
                    "the update (more: longer partial responses to re-prefill)")
    ap.add_argument("--hbm-gbs", type=float, default=None,
                    help="device memory bandwidth (GB/s) for the decode floor; default: the planner's row for the "
                         "device found (none on the cpu)")
    ap.add_argument("--out", default="bench_engines.json")
    args = ap.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    baselines = [b for b in args.baselines.split(",") if b]
    bad = [e for e in engines if e not in ENGINES] + [b for b in baselines if b not in BASELINES]
    if bad or not engines + baselines or min(args.concurrency) < 1 or args.new_tokens < 1 or args.repeats < 1:
        ap.error(f"--engines from {ENGINES}, --baselines from {BASELINES} (at least one contender; got {bad or 'none'}),"
                 " --concurrency/--new-tokens/--repeats >= 1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = get_device(args.device)
    device.set_device(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=parse_dtype(args.dtype)).to(
        device.torch_device()).eval()
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    ragged = args.lengths == "lognormal"
    n_req = {c: c * args.waves if ragged else c for c in args.concurrency}
    prompts_by_c = {c: make_prompts(model.config.vocab_size, n_req[c], args.prompt_len, seed=c)
                    for c in args.concurrency}
    lengths = {n: lognormal_lengths(n, args.new_tokens, seed=c) for c, n in n_req.items()} if ragged else None
    if ragged:
        baselines = []
    max_len = args.prompt_len + args.new_tokens
    results: dict = {"hardware": describe_hardware(device), "model": args.model, "dtype": args.dtype,
                     "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "repeats": args.repeats,
                     "max_num_batched_tokens": args.max_num_batched_tokens or None,
                     "torch_threads": torch.get_num_threads(), "lengths": args.lengths, "contenders": {}}
    if ragged:
        results["requests"] = {str(c): {"n": n, "mean_len": sum(lengths[n]) / n, "max_len": max(lengths[n])}
                               for c, n in n_req.items()}
    for name in baselines:
        results["contenders"][name] = {"startup_s": 0.0, **measure(
            generate_runner(model, device, args.new_tokens, static=name == "generate_static"), prompts_by_c, device,
            args.repeats, args.new_tokens)}
    for name in engines:
        start = time.perf_counter()
        engine = build_engine(name, args.model, device, args.dtype, max(args.concurrency), max_len,
                              args.max_num_batched_tokens or None)
        res: dict = {"startup_s": time.perf_counter() - start,
                     "graph_capture_s": getattr(engine, "graph_capture_s", None)}   # part of start-up
        res.update(measure(engine_runner(engine, args.new_tokens, lengths), prompts_by_c, device, args.repeats,
                           args.new_tokens))
        if not args.no_updates:
            few = prompts_by_c[min(args.concurrency)]
            res["partial_update"] = partial_update(engine, few, weights, 1, args.new_tokens)
            if name == "vllm":
                res["keep_update"] = keep_update(engine, few, weights, 2, args.new_tokens)
        if args.resume_budgets and name.startswith("hf"):
            c = max(args.concurrency)
            burst = make_prompts(model.config.vocab_size, 2 * c, args.prompt_len, seed=7)
            burst_lengths = lognormal_lengths(2 * c, args.new_tokens, seed=7)
            res["resume_burst"] = [resume_burst(engine, burst, burst_lengths, weights, 3 + i, b or None,
                                                args.resume_after_steps) for i, b in enumerate(args.resume_budgets)]
        if name == "vllm":
            res["vllm_version"] = engine.vllm_version
            engine.close()
        results["contenders"][name] = res
        del engine
        device.empty_cache()
    add_floor(results, args, device)
    print(format_table(results, args.concurrency))
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    print(f"wrote {args.out}")
    return 0


# the planner's device rows (planner/hardware.py DEVICES) by the name torch reports (core/flops.py match_device)
HBM_ROWS = {"H200 SXM": "h200", "H200 NVL": "h200", "H100 SXM": "h100", "H800 SXM": "h100", "A100": "a100",
            "A800": "a100", "Ascend 910B": "ascend910b", "Ascend 910C": "ascend910c"}


def add_floor(results: dict, args: Any, device: Any) -> None:
    """Each contender's decode step against the memory-bandwidth floor (planner/stage_costs.py decode_floor_s: the
    weights and every sequence's KV at the workload's mean context read once per step at the device's bandwidth).
    Fixed lengths only (a ragged workload's context changes with its schedule); no floor without a bandwidth."""
    from fully_async.core.flops import match_device
    from fully_async.planner.hardware import DEVICES, Shape
    from fully_async.planner.stage_costs import decode_floor_s

    hbm, source = args.hbm_gbs, "--hbm-gbs"
    if hbm is None and device.is_accelerator:
        row = HBM_ROWS.get(match_device(device.module().get_device_name(0)) or "")
        hbm, source = (DEVICES[row].hbm_gbs, f"planner row {row}") if row else (None, "")
    shape = Shape.from_dir(args.model)
    if hbm is None or shape is None or args.lengths != "fixed":
        results["floor"] = None
        return
    context = args.prompt_len + (args.new_tokens + 1) / 2   # the positions a step attends to, on average
    dtype_bytes = parse_dtype(args.dtype).itemsize
    results["floor"] = {"hbm_gbs": hbm, "source": source, "mean_context": context}
    for res in results["contenders"].values():
        for c in args.concurrency:
            r = res[str(c)]
            r["floor_ms"] = 1e3 * decode_floor_s(shape, hbm, c, context, dtype_bytes)
            r["floor_fraction"] = r["floor_ms"] / r["ms_per_step"]


def format_table(results: dict, concurrency: list[int]) -> str:
    """One row per (contender, c); `vs static` = warm tok/s over generate_static's warm tok/s at the same c,
    `warm/first` = how much slower the first run was (1.0: no warm-up cost left after start-up)."""
    static = results["contenders"].get("generate_static")
    rows = [("contender", "c", "first tok/s", "warm tok/s", "ms/step", "floor ms", "of floor", "vs static",
             "warm/first", "start-up s")]
    for name, res in results["contenders"].items():
        for c in concurrency:
            r = res[str(c)]
            warm, first = r["warm"]["tokens_per_s"], r["first"]["tokens_per_s"]
            ratio = f"{warm / static[str(c)]['warm']['tokens_per_s']:.2f}x" if static else "-"
            floor = (f"{r['floor_ms']:.2f}", f"{100 * r['floor_fraction']:.0f}%") if "floor_ms" in r else ("-", "-")
            rows.append((name, str(c), f"{first:.0f}", f"{warm:.0f}", f"{r['ms_per_step']:.2f}", *floor, ratio,
                         f"{warm / first:.2f}", f"{res['startup_s']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"{results['hardware']}; {results['dtype']}; {results['prompt_len']} prompt + {results['new_tokens']} new "
             f"tokens per sequence, EOS ignored; warm = best of {results['repeats']}"]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    if results.get("floor"):
        f = results["floor"]
        lines.append(f"floor: the weights and each sequence's KV at {f['mean_context']:.0f} positions read once a step at "
                     f"{f['hbm_gbs']:.0f} GB/s ({f['source']}); of floor = floor / ms per step")
    for name, res in results["contenders"].items():
        for key in ("partial_update", "keep_update", "resume_burst"):
            for r in ([res[key]] if isinstance(res.get(key), dict) else res.get(key, [])):
                lines.append(f"{name} {key}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in r.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
