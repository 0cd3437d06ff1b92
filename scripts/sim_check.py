"""Does the pipeline simulation reproduce a measured run?  Stage costs from each run's own logs, then the
simulated tokens/s next to the measured one (fully_async/planner/pipeline_sim.py).

  python scripts/sim_check.py ASYNC_TB_DIR SYNC_TB_DIR [--json]
  python scripts/sim_check.py --costs-from SYNC_TB_DIR RUN_DIR... [--dp-efficiency 0.9]   (forward: below)

Stage costs read from a run's TensorBoard scalars: fully_async/planner/stage_costs.py from_run_scalars (engine
ms per decode step, trainer busy seconds per token, weight-update / sync-switch seconds), and
  lengths         the run's benchmark.response_length profile (a synthetic workload; with the model's own
                  EOS the lengths were not logged and the check refuses)
  prompt length   mean of prompt_length/mean
From a saved comparison table instead (python -m fully_async.compare's table.json, when the TensorBoard dirs are gone):
  decode_step_s, train_token_s  from the bench JSON of the same hardware (bench_pipeline.py, stage_costs.from_bench)
  weight_sync_s   async: trainer busy per step (1 - trainer_idle_ratio) x time_per_step minus the bench's
                  train time of a step's tokens on the run's trainer devices
  sync_step_s     sync: (1 - trainer_idle_ratio) x time_per_step (everything but generation; train_token_s = 0)
  lengths         the workload the table records
  python scripts/sim_check.py --table table.json --bench bench.json
The simulation then runs the run's own config (devices, n, groups per step, max_num_seqs, staleness_threshold,
trigger_parameter_sync_step, partial_rollout) for its number of steps; tokens/s is compared with the comparison's
tokens/s = sum(perf/total_num_tokens) / sum(timing_s/step).
--costs-from predicts forward, as `python -m fully_async.plan plan.stage_costs=<that run>` does: every run from one
run's stage costs (the async placements from the sync run of the same comparison), compiling steps left out, the
training cost scaled to other device counts by --dp-efficiency (forward_costs).  The one thing taken from the run
predicted is its first step's compiling (first_train_s: it differs between placements by a factor of 6), priced on
the simulated trainer's first step, so the simulation is of the run as it went; each prediction is printed beside
both the whole-run measurement and the one without the run's first step (the simulation's own steps likewise).
"""
from __future__ import annotations

import argparse
import json
import sys

from fully_async.compare.simulate import _mean, first_train_s, forward_costs, predict, stage_costs  # noqa: F401


def predict_from_table(table: dict, bench: dict, steps: int | None = None) -> list[dict]:
    """Both modes of a comparison's table.json, simulated from the bench's stage costs plus the
    trainer-side times the table's idle ratios give (module docstring)."""
    from dataclasses import replace

    from fully_async.planner.pipeline_sim import AsyncSetup, Workload, simulate_async, simulate_sync
    from fully_async.planner.stage_costs import bench_lengths, from_bench

    costs, derived = from_bench(bench, source="bench")
    length, _ = bench_lengths(bench, 0)
    over = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in bench.get("overrides", [])}
    n, groups = int(bench["n"]), int(bench["prompts_per_batch"])
    slots = int(over.get("actor_rollout_ref.rollout.max_num_seqs", 256))
    out = []
    for mode in ("async", "sync"):
        row = table["modes"][mode]
        d = row["devices"]
        work = Workload(n, round(derived["prompt_tokens_per_sample"]), length, steps or int(row["steps"]))
        busy = (1.0 - row["trainer_idle_ratio"]) * row["time_per_step_s"]
        if mode == "async":
            step_tokens = row["tokens_per_s"] * row["time_per_step_s"]
            c = replace(costs, weight_sync_s=max(0.0, busy - costs.train_time(round(step_tokens), d["trainer"])))
            sim = simulate_async(AsyncSetup(d["rollout"], d["trainer"], slots, groups, float(over.get(
                "async_training.staleness_threshold", 0.1)), int(over.get("async_training.trigger_parameter_sync_step",
                                                                          1))), c, work)
        else:
            c = replace(costs, train_token_s=0.0, sync_step_s=busy)
            sim = simulate_sync(d["trainer"], groups, slots, c, work)
        out.append({"mode": mode, "log_dir": row["log_dir"], "devices": d, "costs": c.as_dict(),
                    "predicted": sim.as_dict(), "measured_tokens_per_s": row["tokens_per_s"],
                    "error": sim.tokens_per_s / row["tokens_per_s"] - 1.0})
    return out


def main(argv: list[str] | None = None) -> int:
    from fully_async.compare.runs import read_run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", help="TensorBoard run dirs (any mode)")
    ap.add_argument("--table", help="a comparison's table.json (with --bench)")
    ap.add_argument("--bench", help="the bench_pipeline.py JSON of the table's hardware and workload")
    ap.add_argument("--costs-from", metavar="RUN", help="predict every run from this run's stage costs (the "
                    "planner's forward prediction, e.g. async placements from the sync run) instead of its own")
    ap.add_argument("--dp-efficiency", type=float, default=0.9, help="with --costs-from: the per-device rate kept "
                    "at each doubling of the trainer's devices (plan.dp_efficiency; default 0.9)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if bool(args.table) != bool(args.bench) or not (args.runs or args.table):
        ap.error("give TensorBoard run dirs, or --table with --bench")
    costs = forward_costs(read_run(args.costs_from), args.dp_efficiency) if args.costs_from else None
    out = [predict(read_run(d), costs) for d in args.runs]
    if args.table:
        with open(args.table) as fh, open(args.bench) as fb:
            out += predict_from_table(json.load(fh), json.load(fb))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r in out:
            # a forward prediction prices the run's own first-step compiling: the simulation's steps after the first
            # beside the run's too
            after = (f"; without the first step simulated {r['predicted_after_first_tokens_per_s']:.1f}, measured "
                     f"{r['measured_after_first_tokens_per_s']:.1f} ({100 * r['error_after_first']:+.1f}%)"
                     ) if costs else ""
            print(f"{r['mode']:5} {r['devices']['trainer']}+{r['devices']['rollout']} devices: simulated "
                  f"{r['predicted']['tokens_per_s']:.1f} tokens/s, measured {r['measured_tokens_per_s']:.1f} "
                  f"({100 * r['error']:+.1f}%){after}  [{r['log_dir']}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
