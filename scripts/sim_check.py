"""Does the pipeline simulation reproduce a measured run?  Stage costs from each run's own logs, then the
simulated tokens/s next to the measured one (fully_async/planner/pipeline_sim.py).

  python scripts/sim_check.py ASYNC_TB_DIR SYNC_TB_DIR [--json]
  python scripts/sim_check.py --costs-from SYNC_TB_DIR RUN_DIR... [--dp-efficiency 0.9]   (forward: below)

Stage costs read from a run's TensorBoard scalars: fully_async/planner/stage_costs.py from_run_scalars (engine
ms per decode step, trainer busy seconds per token, weight-update / sync-switch seconds), and
  lengths         the run's benchmark.response_length profile (a synthetic workload; with the model's own
                  EOS the lengths were not logged and the check refuses)
  prompt length   mean of prompt_length/mean
From a saved comparison table instead (compare_sync_async.py's table.json, when the TensorBoard dirs are gone):
  decode_step_s, train_token_s  from the bench JSON of the same hardware (bench_pipeline.py, stage_costs.from_bench)
  weight_sync_s   async: trainer busy per step (1 - trainer_idle_ratio) x time_per_step minus the bench's
                  train time of a step's tokens on the run's trainer devices
  sync_step_s     sync: (1 - trainer_idle_ratio) x time_per_step (everything but generation; train_token_s = 0)
  lengths         the workload the table records
  python scripts/sim_check.py --table table.json --bench bench.json
The simulation then runs the run's own config (devices, n, groups per step, max_num_seqs, staleness_threshold,
trigger_parameter_sync_step, partial_rollout) for its number of steps; tokens/s is compared with compare_lib's
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
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _mean(values: list[float]) -> float:
    if not values:
        raise ValueError("no values")
    return sum(values) / len(values)


def _workload(run: Any) -> Any:
    from omegaconf import OmegaConf

    from fully_async.planner.pipeline_sim import Workload
    from fully_async.core.workload import LengthProfile

    cfg = OmegaConf.create(run.config)
    profile = LengthProfile.from_config(cfg)
    if profile is None or not cfg.benchmark.get("ignore_eos", False):
        raise ValueError(f"{run.log_dir}: the run's response lengths are not known (needs benchmark.response_length "
                         "and benchmark.ignore_eos=true: with the model's own EOS the lengths were not logged)")
    prompt = round(_mean(run.values("prompt_length/mean")))
    return cfg, Workload(n=cfg.actor_rollout_ref.rollout.n, prompt_len=prompt, length=profile.target,
                         steps=len(run.values("timing_s/step")))


def _scalars(run: Any) -> dict[str, list[float]]:
    """The run's scalars, one value per trainer step (stage_costs.aligned_scalars)."""
    from fully_async.planner.stage_costs import aligned_scalars

    return aligned_scalars({tag: [(s, v) for s, _, v in run.series(tag)] for tag in run.scalars})


def stage_costs(run: Any, every_step: bool = True) -> Any:
    """StageCosts of one run from its own logs (stage_costs.from_run_scalars): every step kept (the check compares
    with the run's whole average, compiling steps included), or, as the planner reads a run, its compiling steps
    left out."""
    from compare_lib import placement_of

    from fully_async.planner.stage_costs import OUTLIER_RATIO, from_run_scalars

    return from_run_scalars(_scalars(run), run.mode, run.devices()["trainer"], source=f"run logs {run.log_dir}",
                            outlier_ratio=None if every_step else OUTLIER_RATIO, placement=placement_of(run.config))


def forward_costs(source: Any, dp_efficiency: float) -> Any:
    """The planner's forward prediction (`python -m fully_async.plan plan.stage_costs=<source run>`): the stage costs
    of another run (a sync run, say), its compiling steps left out as the planner leaves them out.  Its
    per-device-token training cost holds its own data-parallel efficiency, so one device's is that times the
    efficiency assumed at its device count (other counts then scale by `dp_efficiency` per doubling, as the planner
    does); a weight update the source did not push is priced at the source's own engine load
    (timing_s/param_sync/load: the same bytes into the same engines)."""
    from dataclasses import replace

    from fully_async.planner.sim_engine import data_parallel_speedup

    costs = stage_costs(source, every_step=False)
    n = max(1, source.devices()["trainer"])
    loads = [v for v in source.values("timing_s/param_sync/load") if v > 0]
    return replace(costs, dp_efficiency=dp_efficiency,
                   train_token_s=costs.train_token_s * data_parallel_speedup(n, dp_efficiency) / n,
                   weight_sync_s=costs.weight_sync_s or (_mean(loads) if loads else 0.0),
                   source=f"{costs.source}, forward (dp_efficiency {dp_efficiency})")


def first_train_s(run: Any) -> float:
    """What the run's first trainer step cost beyond its steady rate (compiling, first allocations): its trainer
    seconds minus its tokens at the run's own steady per-device-token cost.  The one input a forward prediction
    takes from the run it predicts: at the 0.5B shape on H200 it was 5-8 s (2-GPU colocated, elastic), 15-20 s
    (1-GPU colocated, splits, 4-GPU colocated) and 22-35 s (sync), so no other run's value stands in for it."""
    from fully_async.planner.stage_costs import trainer_busy

    costs = stage_costs(run, every_step=False)
    scalars = _scalars(run)
    busy, _ = trainer_busy(scalars, run.mode)
    tokens = scalars.get("perf/total_num_tokens") or [0.0]
    if not busy:
        return 0.0
    return max(0.0, busy[0] - tokens[0] * costs.train_token_s / max(1, run.devices()["trainer"]))


def predict(run: Any, costs: Any = None, compiling: bool = True) -> dict:
    """Simulated tokens/s of the run from its own stage costs (or `costs`: forward_costs of another run, with the
    run's own first-step compiling unless `compiling` is False: the planner's steady view), next to the measured
    one."""
    from dataclasses import replace

    from compare_lib import placement_of, tokens_per_s

    from fully_async.planner.colocated_sim import simulate_colocated
    from fully_async.planner.pipeline_sim import AsyncSetup, simulate_async, simulate_sync
    from fully_async.planner.search import PipelineShape

    # forward: the source's steady costs, and this run's own first-step compiling (so the simulation is of the run
    # as it went: a split's engines run ahead while its trainer compiles, and the next steps drain that queue)
    priced = costs is not None and compiling
    if costs is None:
        costs = stage_costs(run)
    elif priced:
        costs = replace(costs, first_train_s=first_train_s(run))
    cfg, work = _workload(run)
    shape = PipelineShape.of(cfg)
    d = run.devices()
    if run.mode == "async" and placement_of(run.config) == "colocated":
        sim = simulate_colocated(d["trainer"], AsyncSetup(replicas=d["trainer"], trainer_devices=d["trainer"],
                                                          max_num_seqs=shape.max_num_seqs, required=shape.async_groups,
                                                          staleness_threshold=shape.staleness_threshold,
                                                          trigger_parameter_sync_step=shape.trigger,
                                                          partial_rollout=shape.partial_rollout), costs, work)
    elif run.mode == "async":   # split, or elastic: an engine per trainer device group joins while the trainer waits
        elastic = d["trainer"] // shape.rollout_tp if placement_of(run.config) == "elastic" else 0
        sim = simulate_async(AsyncSetup(replicas=max(1, d["rollout"] // shape.rollout_tp), trainer_devices=d["trainer"],
                                        max_num_seqs=shape.max_num_seqs, required=shape.async_groups,
                                        staleness_threshold=shape.staleness_threshold,
                                        trigger_parameter_sync_step=shape.trigger,
                                        partial_rollout=shape.partial_rollout, elastic_replicas=elastic), costs, work)
    else:
        sim = simulate_sync(d["trainer"], shape.sync_groups, shape.max_num_seqs, costs, work)
    measured, steady = tokens_per_s(run), tokens_per_s(run, skip_first=1)
    # the simulated run's steps after its first, beside the measured run's (a steady simulation: every step)
    after = sim.steady_tokens_per_s(1) if priced else sim.tokens_per_s
    return {"mode": run.mode, "log_dir": run.log_dir, "devices": d, "costs": costs.as_dict(),
            "predicted": sim.as_dict(), "measured_tokens_per_s": measured, "measured_after_first_tokens_per_s": steady,
            "predicted_after_first_tokens_per_s": after,
            "error": sim.tokens_per_s / measured - 1.0, "error_after_first": after / steady - 1.0}


def predict_from_table(table: dict, bench: dict, steps: int | None = None) -> list[dict]:
    """Both modes of a compare_sync_async.py table.json, simulated from the bench's stage costs plus the
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
    from compare_lib import read_run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", help="TensorBoard run dirs (any mode)")
    ap.add_argument("--table", help="a compare_sync_async.py table.json (with --bench)")
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
