"""Generation throughput of sync mode at 1, 2, ... devices: does rollout use every device?

  python scripts/bench_rollout_scaling.py [--devices 1 2] [--skip-steps 1] [--out DIR] [overrides...]

For each device count K it runs `python -m fully_async.main mode=sync trainer.n_gpus_per_node=K` with the
same overrides (strategy fsdp2 when K > 1 unless the overrides set one), so every run generates the same
batches with the same workload; sync mode runs one engine per trainer rank (engines/pool.py).  From each
run's TensorBoard scalars:

  generation tokens/s  = sum over steps of the tokens all engines generated (fully_async/rollouter/engine_<i>/tokens)
                         / sum of timing_s/gen, the first --skip-steps steps left out (warm-up: first runs are
                         3-4x slower on GPUs)
  engine share         = each engine's fraction of those tokens
  busy ratio           = mean per-engine fraction of the generate phase it had work
  engine ms/step       = mean per-engine milliseconds inside one engine iteration (its own decode step; the
                         rest of the generate phase is the pool's, Ray's and the caller's overhead)
  scaling              = generation tokens/s / that of the smallest K

Prints a table, writes DIR/rollout_scaling.json; runs' logs and TensorBoard dirs stay under DIR.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fully_async.compare.runs import read_run, workload_of  # noqa: E402
from fully_async.compare.driver import STRATEGY, _key, _stream, _value  # noqa: E402


def run_sync(devices: int, overrides: list[str], out_dir: str) -> str:
    tb_dir = os.path.join(out_dir, "runs", f"sync_{devices}")
    shutil.rmtree(tb_dir, ignore_errors=True)
    placement = [f"trainer.n_gpus_per_node={devices}"]
    if devices > 1 and _value(overrides, STRATEGY) is None:
        placement.append(f"{STRATEGY}=fsdp2")
    cmd = [sys.executable, "-m", "fully_async.main", "mode=sync", "trainer.resume_mode=disable", *overrides,
           *placement, f"hydra.run.dir={os.path.join(out_dir, 'hydra', f'sync_{devices}')}"]
    _stream(f"sync_{devices}", cmd, out_dir, dict(os.environ, TENSORBOARD_DIR=tb_dir))
    return tb_dir


def generation_stats(log_dir: str, skip_steps: int) -> dict:
    """Generation throughput and per-engine split of one sync run's TensorBoard dir."""
    run = read_run(log_dir)
    gen = {step: v for step, _, v in run.series("timing_s/gen")}
    engines = sorted(int(t.split("/")[2].split("_")[1]) for t in run.scalars
                     if t.startswith("fully_async/rollouter/engine_") and t.endswith("/tokens"))
    if not engines:
        raise SystemExit(f"{log_dir}: no fully_async/rollouter/engine_<i>/tokens scalars (not a pool-era run)")
    steps = sorted(s for s in gen if s > skip_steps)
    if not steps:
        raise SystemExit(f"{log_dir}: only {len(gen)} steps, none left after --skip-steps {skip_steps}")
    per_engine = []
    for i in engines:
        tokens = {s: v for s, _, v in run.series(f"fully_async/rollouter/engine_{i}/tokens")}
        busy = {s: v for s, _, v in run.series(f"fully_async/rollouter/engine_{i}/busy_ratio")}
        ms = [v for s, _, v in run.series(f"fully_async/rollouter/engine_{i}/ms_per_step") if s in steps]
        per_engine.append({"tokens": sum(tokens.get(s, 0.0) for s in steps),
                           "busy_ratio": sum(busy.get(s, 0.0) for s in steps) / len(steps),
                           "ms_per_step": sum(ms) / len(ms) if ms else None})
    total = sum(e["tokens"] for e in per_engine)
    seconds = sum(gen[s] for s in steps)
    for e in per_engine:
        e["share"] = e["tokens"] / total if total else 0.0
    return {"log_dir": log_dir, "engines": len(engines), "steps": len(steps), "gen_seconds": seconds,
            "generated_tokens": total, "gen_tokens_per_s": total / seconds if seconds else float("nan"),
            "per_engine": per_engine, "hardware": run.summary.get("hardware", ""), "workload": workload_of(run.config)}


def format_table(results: list[dict]) -> str:
    base = results[0]["gen_tokens_per_s"]
    rows = [("devices", "engines", "steps", "gen s", "gen tokens", "gen tok/s", "scaling", "share per engine",
             "busy per engine", "engine ms/step")]
    for r in results:
        rows.append((str(r["devices"]), str(r["engines"]), str(r["steps"]), f"{r['gen_seconds']:.2f}",
                     f"{r['generated_tokens']:.0f}", f"{r['gen_tokens_per_s']:.0f}", f"{r['gen_tokens_per_s'] / base:.2f}x",
                     " ".join(f"{e['share']:.2f}" for e in r["per_engine"]),
                     " ".join(f"{e['busy_ratio']:.2f}" for e in r["per_engine"]),
                     " ".join("-" if e.get("ms_per_step") is None else f"{e['ms_per_step']:.1f}"
                              for e in r["per_engine"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    hardware = results[-1].get("hardware")
    if hardware:
        lines.insert(0, f"hardware: {hardware}")
    workload = results[-1].get("workload")
    if workload:
        lines.append(f"workload: {workload.get('description', workload)}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="device counts to run (default 1 2)")
    ap.add_argument("--skip-steps", type=int, default=1, help="warm-up steps left out (default 1)")
    ap.add_argument("--out", default="rollout_scaling_out", help="output folder")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides passed to every run")
    args = ap.parse_intermixed_args(argv)
    bad = [o for o in args.overrides if _key(o) in ("mode", "trainer.n_gpus_per_node", "trainer.nnodes")]
    if bad:
        print(f"error: {bad}: this script sets mode and the device count itself (--devices)", file=sys.stderr)
        return 2
    if any(d < 1 for d in args.devices):
        print(f"error: --devices {args.devices}: every count must be >= 1", file=sys.stderr)
        return 2
    out_dir = os.path.abspath(args.out)
    results = []
    for devices in sorted(set(args.devices)):
        stats = generation_stats(run_sync(devices, args.overrides, out_dir), args.skip_steps)
        results.append(dict(stats, devices=devices))
    text = format_table(results)
    print(text)
    with open(os.path.join(out_dir, "rollout_scaling.json"), "w") as fh:
        json.dump({"overrides": args.overrides, "skip_steps": args.skip_steps, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
