"""Remove-padding (packed sequences) vs padded micro-batches: trainer throughput, memory, parity.

    python scripts/bench_packing.py --shape 0.5b --device cuda --out packing.json
    python scripts/bench_packing.py --shape tiny --device cpu --rows 16          # smoke test

One process, one batch, the package's real trainer path (the backend a run on one device builds, --strategy: verl's
fsdp by default; prepare_batch's log-prob pass, then train_step's PPO update with dynamic batch size), once per
variant, side by side:
`padded` (rows right-padded to the longest of each micro-batch, sdpa), `packed:<kernel>`
(actor_rollout_ref.model.use_remove_padding=true; each micro-batch's real tokens in one row, the
kernel from override_config.attn_implementation: varlen is fully_async's, sdpa builds a dense
block-diagonal mask).  By default lm_head is folded into the chunked log-prob/entropy
(model.use_fused_kernels: no logits tensor); a `/unfused` suffix computes the full logits and runs the
chunked log-prob/entropy of backends/token_stats.py over them; `/plain` (unfused too) swaps that for the
plain autograd formulas.  Both show what each step saves.  Every variant
starts from the same weights, so the log-probs of its first pass are compared with the first
variant's (max / mean absolute difference over response tokens).  The model is a Qwen2 of a
real model's shape (real vocabulary size) with random weights; sequence lengths are drawn like
RL rollouts (long-tailed responses).  Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any, Optional

TOKEN_STATS: Any = None   # backends.token_stats.token_stats, set in main()
SHAPES = {
    "tiny": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=128),
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864),
    "3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, intermediate_size=11008),
}


def build_model(shape: str, path: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=True)
                     ).save_pretrained(path)


def rollout_like_samples(rows: int, n: int, vocab: int, max_prompt: int, max_response: int, seed: int,
                         workload: bool = False) -> list:
    """`rows` responses in groups of n; prompts U[max_prompt/8, max_prompt], responses log-normal (workload: the
    lengths of benchmark.response_length=lognormal at max_response, the seed-003 runs' distribution)."""
    import torch

    from fully_async.core.types import Sample
    from fully_async.core.workload import LengthProfile

    g = torch.Generator().manual_seed(seed)
    profile = LengthProfile.lognormal(max_response, seed=seed) if workload else None
    out = []
    for gi in range(rows // n):
        plen = int(torch.randint(max_prompt // 8, max_prompt + 1, (1,), generator=g))
        prompt = torch.randint(2, vocab, (plen,), generator=g).tolist()
        for j in range(n):
            rlen = int(min(max_response, max(8, torch.empty(1).log_normal_(5.0, 0.9, generator=g).item())))
            if profile is not None:
                rlen = profile.target(f"g{gi}-{j}")
            resp = torch.randint(2, vocab, (rlen,), generator=g).tolist()
            out.append(Sample(uid=f"g{gi}", sample_id=f"g{gi}-{j}", prompt_ids=prompt, response_ids=resp,
                              rollout_log_probs=[-1.0] * rlen, versions=[0] * rlen,
                              reward=float(torch.rand(1, generator=g) > 0.5)))
    return out


def plain_token_stats(logits: Any, targets: Any, temperature: float = 1.0, with_entropy: bool = False,
                      chunk_elems: int = 0) -> tuple:
    """The straightforward autograd version that backends/token_stats.py replaces (for `<variant>/plain`)."""
    import torch

    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    return logp, (-(logp_all.exp() * logp_all).sum(-1) if with_entropy else None)


def run_variant(name: str, model_dir: str, device: Any, samples: list, args: argparse.Namespace) -> tuple[dict, Any]:
    from fully_async.train.backends import build_backend
    from fully_async.core.batch import build_batch, micro_batches
    from fully_async.run.hydra_setup import load_config
    from fully_async.train.ppo_update import ppo_update
    from fully_async.train.train_step import prepare_batch

    from fully_async.train.backends import torch_backend

    ckpt = name.endswith("/ckpt") or args.grad_ckpt   # model.enable_gradient_checkpointing for this variant
    name = name.removesuffix("/ckpt")
    compiled = name.endswith("/compiled")   # actor.use_torch_compile: each decoder layer compiled (CUDA)
    name = name.removesuffix("/compiled")
    packed = name.startswith("packed")
    plain = name.endswith("/plain")
    torch_backend.token_stats = plain_token_stats if plain else TOKEN_STATS
    unfused = plain or name.endswith("/unfused")   # full logits (token_stats over them) instead of the fused head
    name_kernel = name.removesuffix("/plain").removesuffix("/unfused")
    # --strategy fsdp (verl's default, what a run on one device trains with: a one-rank fsdp2 in bf16, float32 master
    # weights); torch: the plain backend, bf16 parameters (what the rows before 2026-11-30's session 5 measured)
    overrides = [f"actor_rollout_ref.model.path={model_dir}", f"trainer.device={device.name}",
                 f"actor_rollout_ref.actor.strategy={args.strategy}",
                 f"actor_rollout_ref.actor.dtype={args.dtype}", "actor_rollout_ref.actor.optim.lr=1e-6",
                 "async_training.use_rollout_log_probs=false", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                 f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_tokens}",
                 "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                 f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={args.max_tokens}",
                 f"actor_rollout_ref.model.use_remove_padding={str(packed).lower()}",
                 f"actor_rollout_ref.model.use_fused_kernels={str(not unfused).lower()}",
                 f"actor_rollout_ref.actor.use_torch_compile={str(compiled).lower()}",
                 f"actor_rollout_ref.model.enable_gradient_checkpointing={str(ckpt).lower()}"]
    kernel = name_kernel.split(":", 1)[1] if ":" in name_kernel else "sdpa"
    overrides.append(f"+actor_rollout_ref.model.override_config.attn_implementation={kernel}")
    cfg = load_config(overrides + list(args.set))
    backend = build_backend(cfg, device, total_optimizer_steps=100)
    if args.reduce_every_micro_batch:   # the one-rank fsdp2 as before 953cd9e: a reduce (and gather) each micro-batch
        backend._lone_rank = lambda model: False
    if compiled:
        name += "/compiled"
    if ckpt:
        name += "/ckpt"
    batch = build_batch(samples)
    real_tokens = int(batch.attention_mask.sum())
    splits = micro_batches(batch, None, True, args.max_tokens, packed)
    computed = real_tokens if packed else sum(len(idx) * max(batch.seq_lengths[i] for i in idx) for idx in splits)
    res: dict[str, Any] = {"variant": name, "micro_batches": len(splits), "real_tokens": real_tokens,
                           "computed_tokens": computed}
    logp_times, update_times = [], []
    first_logp = None
    for it in range(args.warmup + args.iters):
        device.synchronize()
        if device.is_accelerator:
            device.module().reset_peak_memory_stats()
        t0 = time.perf_counter()
        prepare_batch(backend, cfg, batch, {})
        device.synchronize()
        t1 = time.perf_counter()
        ppo_update(backend, cfg, batch, num_mini_batches=1)
        device.synchronize()
        t2 = time.perf_counter()
        if it == 0:
            first_logp = batch.old_log_probs.clone()
            res["first_iteration_s"] = t2 - t0   # includes kernel compilation (flex_attention)
        if it >= args.warmup:
            logp_times.append(t1 - t0)
            update_times.append(t2 - t1)
    res["log_prob_s"] = min(logp_times)
    res["update_s"] = min(update_times)
    res["update_tokens_per_s"] = real_tokens / res["update_s"]
    res["log_prob_tokens_per_s"] = real_tokens / res["log_prob_s"]
    if device.is_accelerator:
        res["peak_memory_gib"] = device.memory_stats()["max_allocated_gib"]
    res.update(update_mfu(model_dir, batch.seq_lengths, res["update_s"], device))
    if args.count_ops:
        res["update_ops"] = count_ops(lambda: ppo_update(backend, cfg, batch, num_mini_batches=1))
        top = ", ".join(f"{k} {n}" for k, n in list(res["update_ops"]["by_op"].items())[:8])
        print(f"--- {name}: one update dispatched {res['update_ops']['total']} operators ({top}, ...)", flush=True)
    if args.profile:
        stem = os.path.splitext(args.out)[0] + "_" + name.replace(":", "_").replace("/", "_")
        res["profile_log_prob"] = print_profile(name, lambda: prepare_batch(backend, cfg, batch, {}), device,
                                                args.profile_rows, stem + "_logp.trace.json" if args.trace else None,
                                                what="log-prob pass")
        res["profile_update"] = print_profile(name, lambda: ppo_update(backend, cfg, batch, num_mini_batches=1),
                                              device, args.profile_rows,
                                              stem + "_update.trace.json" if args.trace else None)
    backend = None   # free the model before the next variant (a `del` would leave the profiler's lambda unbound)
    device.empty_cache()
    return res, first_logp


def count_ops(step: Any) -> dict:
    """The operators one `step` dispatches below autograd (forward, backward and optimizer, FSDP2's casts and copies
    included): what launches the kernels, so a count that any machine, a CPU too, can take of what a device's host
    must launch.  Views and detaches count as well (they launch nothing but cost the host a dispatch).  Returns
    {total, by_op (name -> count, most first)}."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    mode = _Count()
    with mode:
        step()
    return {"total": sum(mode.ops.values()), "by_op": dict(mode.ops.most_common())}


def print_profile(name: str, step: Any, device: Any, rows: int = 14, trace: Optional[str] = None,
                  what: str = "update") -> dict:
    """One more `what` under torch.profiler: the kernels that take the device's time, biggest first, and how busy
    the device was (the sum of its kernels' time against the wall time; the rest is the device waiting for the
    host).  `trace`: a gzipped Chrome trace written there.  Returns {wall_s, kernels_s, kernels}."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.name == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        device.synchronize()
        wall = time.perf_counter() - t0
    from fully_async.train.train_step import profile_summary

    key = "cuda_time_total" if device.name == "cuda" else "cpu_time_total"
    summary = profile_summary(prof, wall, 0)
    busy = summary["device_kernels_s"]
    print(f"--- {name}: one {what}, top {rows} by {key}; wall {wall:.3f} s (profiled), device kernels {busy:.3f} s "
          f"({summary['device_kernels']} kernels); {summary['gaps_over_1ms']} gaps over 1 ms, "
          f"{summary['gaps_over_1ms_s']:.3f} s; largest {summary['largest_gaps'][:3]}")
    averages = prof.key_averages()
    print(averages.table(sort_by=key, row_limit=rows, max_name_column_width=60))
    # each operator's or kernel's own time (on the device where there is one, else the host's), biggest first
    own = [(getattr(e, "self_device_time_total", 0) if device.name == "cuda" else e.self_cpu_time_total, e.key,
            e.count) for e in averages]
    top = [{"name": k[:120], "own_ms": t / 1e3, "calls": n} for t, k, n in sorted(own, reverse=True)[:rows] if t > 0]
    if trace:
        import gzip
        import shutil

        prof.export_chrome_trace(trace)
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)
    return {"wall_s": wall, "kernels_s": busy, "kernels": summary["device_kernels"],
            "gaps_over_1ms_s": summary["gaps_over_1ms_s"], "largest_gaps": summary["largest_gaps"],
            "top_by_own_time": top}


def update_mfu(model_dir: str, seq_lens: Any, seconds: float, device: Any) -> dict:
    """The PPO update's FLOPs (verl's count: forward + backward over every real token) and MFU on this device, as
    the trainer reports `perf/mfu/actor`; no MFU where the device's peak is unknown (cpu)."""
    from transformers import AutoConfig

    from fully_async.core import flops

    total = flops.estimate_flops(AutoConfig.from_pretrained(model_dir), [int(n) for n in seq_lens])
    peak = flops.peak_tflops(device.device_name())
    if total is None:
        return {}
    out = {"update_tflops": total / seconds / 1e12}
    if peak is not None:
        out["mfu"] = flops.mfu(total, seconds, 1, peak)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--model", help="an HF model folder instead of a random --shape model")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="actor dtype (default: bfloat16 on accelerators, float32 on cpu)")
    p.add_argument("--reduce-every-micro-batch", action="store_true",
                   help="a one-rank fsdp2 reduces (and gathers) every micro-batch, as before 953cd9e (to measure "
                        "against)")
    p.add_argument("--strategy", default="fsdp", choices=["fsdp", "torch", "fsdp2"],
                   help="actor_rollout_ref.actor.strategy (default fsdp, a run's: on one device in bf16 a one-rank "
                        "fsdp2 with float32 master weights; torch: bf16 parameters)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every variant (repeatable), after the bench's own, e.g. "
                        "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false")
    p.add_argument("--rows", type=int, default=64, help="responses in the batch (groups of --n)")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-response", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=16384, help="ppo_max_token_len_per_gpu for every variant")
    p.add_argument("--variants", nargs="+", default=None,
                   help="padded, packed:<attn_implementation> (varlen, sdpa, eager, flex_attention, "
                        "flash_attention_2), each optionally with /unfused (full logits, then backends/token_stats.py) or "
                        "/plain (full logits, then plain autograd log-probs and entropy), then optionally /compiled "
                        "(actor.use_torch_compile=true: every decoder layer compiled; without it, false), then "
                        "optionally /ckpt (gradient checkpointing, as --grad-ckpt for every variant); default: "
                        "padded packed:varlen packed:varlen/compiled packed:varlen/unfused/compiled")
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--lengths", choices=("default", "workload"), default="default",
                   help="response lengths: log-normal(5.0, 0.9), or workload: benchmark.response_length=lognormal's "
                        "at --max-response (median 0.25 x, sigma 0.75: the seed-003 runs')")
    p.add_argument("--chunk-elems", type=int, default=None,
                   help="elements per chunk of the chunked log-prob/entropy (default: the device's, token_stats.py)")
    p.add_argument("--profile", action="store_true", help="print each variant's top kernels of one more log-prob "
                   "pass and update, and how busy the device was")
    p.add_argument("--profile-rows", type=int, default=14, help="with --profile: rows of each table (and of "
                   "top_by_own_time in --out: operators and kernels by their own device time, host time on a CPU)")
    p.add_argument("--count-ops", action="store_true", help="count the operators one more update dispatches (what its "
                   "host launches; a CPU can count them too): update_ops in --out")
    p.add_argument("--trace", action="store_true", help="with --profile: gzipped Chrome traces of both beside --out")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_packing.json")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    global TOKEN_STATS
    from fully_async.train.backends import token_stats as token_stats_module
    from fully_async.train.backends.token_stats import token_stats as TOKEN_STATS

    if args.chunk_elems:
        token_stats_module.CHUNK_ELEMS = args.chunk_elems

    import torch

    from fully_async.device import describe_hardware, get_device

    device = get_device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.is_accelerator else "float32")
    variants = args.variants or ["padded", "packed:varlen", "packed:varlen/compiled", "packed:varlen/unfused/compiled"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = os.path.join(tmp, "model")
            build_model(args.shape, model_dir)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        samples = rollout_like_samples(args.rows, args.n, vocab, args.max_prompt, args.max_response, args.seed,
                                       workload=args.lengths == "workload")
        results, logps = [], {}
        for name in variants:
            try:
                res, logps[name] = run_variant(name, model_dir, device, samples, args)
            except RuntimeError as exc:   # torch.OutOfMemoryError is one; a variant that does not fit is a result
                if "out of memory" not in str(exc).lower():
                    raise
                res = {"variant": name, "error": "out of memory"}
                print(f"{name}: out of memory", flush=True)
                gc.collect()
                device.empty_cache()
            results.append(res)
    from fully_async.core.batch import build_batch

    mask = build_batch(samples).response_mask.bool()
    base = next((r["variant"] for r in results if "error" not in r), variants[0])
    for res in results:
        if "error" in res:
            continue
        diff = (logps[res["variant"]] - logps[base])[mask].abs()
        res[f"logp_vs_{base}_max_abs"] = float(diff.max())
        res[f"logp_vs_{base}_mean_abs"] = float(diff.mean())
    lengths = [s.num_tokens for s in samples]
    report = {"hardware": describe_hardware(device), "torch": torch.__version__, "shape": args.model or args.shape,
              "dtype": args.dtype, "strategy": args.strategy,
              "reduce_every_micro_batch": args.reduce_every_micro_batch, "rows": args.rows,
              "max_tokens_per_micro_batch": args.max_tokens,
              "seq_len_mean": sum(lengths) / len(lengths), "seq_len_max": max(lengths),
              "gradient_checkpointing": args.grad_ckpt, "results": results}
    cols = [("variant", "variant", "{}"), ("micro", "micro_batches", "{}"), ("real tok", "real_tokens", "{}"),
            ("computed tok", "computed_tokens", "{}"), ("logp s", "log_prob_s", "{:.3f}"),
            ("update s", "update_s", "{:.3f}"), ("update tok/s", "update_tokens_per_s", "{:.0f}"),
            ("TFLOP/s", "update_tflops", "{:.0f}"), ("MFU", "mfu", "{:.1%}"),
            ("1st iter s", "first_iteration_s", "{:.1f}"), ("peak GiB", "peak_memory_gib", "{:.1f}"),
            (f"|dlogp| max vs {base}", f"logp_vs_{base}_max_abs", "{:.2e}")]
    print(f"{report['hardware']} | torch {report['torch']} | {report['shape']} {args.dtype} {args.strategy} | "
          f"{args.rows} rows, "
          f"mean length {report['seq_len_mean']:.0f}, max {report['seq_len_max']} | budget {args.max_tokens} tok")
    print("  ".join(f"{h:>14}" for h, _, _ in cols))
    for res in results:
        if "error" in res:
            print(f"{res['variant']:>14}  {res['error']}")
            continue
        print("  ".join(f"{(fmt.format(res[k]) if k in res else '-'):>14}" for _, k, fmt in cols))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
