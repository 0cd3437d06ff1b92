"""Run the same workload in sync and async mode on equal total devices (or take two saved runs) and compare.

  python -m fully_async.compare [--devices N] [--placements split,colocated,elastic] [--split R]
                               [--dp-efficiency E] [--bench] [--out DIR] [--threshold 0.8] [overrides...]
  python -m fully_async.compare --from-logs RUN_A RUN_B [--bench] [--out DIR] [--threshold 0.8]

The first form compares at equal total devices N on one node (--devices; default the overrides'
trainer.n_gpus_per_node, else 2; the script sets the placement keys per mode, so the overrides must
not set rollout.n_gpus_per_node or an nnodes other than 1):
  sync   `mode=sync trainer.n_gpus_per_node=N`: one colocated engine + trainer rank per device,
         generate and train alternate;
  async  `mode=async rollout.n_gpus_per_node=r trainer.n_gpus_per_node=N-r`: the split r chosen from
         the measured ceilings (compare/bench.py: R, T = rollout-only and train-only tokens/s of
         one device): the r in 1..N-1 maximising min(r R, k T e^log2(k)), k = N-r, e = --dp-efficiency
         (ties: fewer rollout devices).  `--split R` forces r (ceilings are still reported with --bench).
`--placements` (comma-separated; default split, or colocated at --devices 1) runs async once per placement
(async_training.placement), each against the same sync run:
  split      as above (the run dir is DIR/runs/async);
  elastic    the split r + N-r as above, `async_training.placement=elastic` (every trainer device also hosts an
             engine that generates while the trainer waits): DIR/runs/async_elastic;
  colocated  `async_training.placement=colocated rollout.n_gpus_per_node=0 trainer.n_gpus_per_node=N`: every device
             an engine and a trainer rank taking turns, as sync, over-provisioned (DIR/runs/async_colocated).
`--placement-override P:KEY=VALUE` adds an override to placement P's run only (the key may then differ from sync).
At --devices 1 only sync and colocated exist.  With one placement the comparison is written into DIR as before;
with several, each pair into DIR/<placement>/.  Either way a summary of every run (tokens/s, x sync, the planner's
forward prediction of each from the sync run's costs and the run's own first-step compiling, per-step generating /
train / switch seconds, the simulation of each from its own logs) is printed and written to DIR/placements.json.
A trainer on more than one device gets `actor_rollout_ref.actor.strategy=fsdp2` unless the overrides
set a strategy.  The bench runs first (always when the split is chosen; with --split only with
--bench).  Each run writes TensorBoard to DIR/runs/<mode> under the same experiment name and starts
with trainer.resume_mode=disable (the second run must not resume from the first one's checkpoint).

The second form compares two existing TensorBoard run dirs (one async, one sync), taking devices from
each run's config.json/summary.json.

Either way the two `config.json` must agree on every key except `mode` and, when both runs use the
same total number of devices, the placement keys (compare/runs.py PLACEMENT_KEYS, listed in the report);
any other difference is refused (exit 2 naming the keys; `--allow-diff KEY` accepts a known one, and
the report lists it).  Runs whose summary.json names different hardware (a sync run reused from another machine
with --sync-log or --from-logs) are refused too: a ratio across cards is no speedup (`--allow-diff hardware`).

`--repeats K` (default 3 on CPU, 1 on accelerators) runs both modes K times, alternating which goes first,
each repeat into DIR/repeat_<i>/, and writes one report over them, DIR/report.md (DIR/<placement>/ with several):
every row's mean, standard deviation and min..max, the headline figures plotted with error bars (repeats.png); it
prints the median, min, max and spread of tokens/s, time/step and the speedup (DIR/repeats.json), warning when a
spread exceeds 20% or the load average before a run was high.  On a CPU the report opens by saying that both sides
share the machine's cores (so async can read below 1x there).

Writes into DIR: report.md, table.json, PNG plots (and bench.json when it ran the bench); prints the side-by-side
table: devices, the split and why (candidate splits with predicted ceilings), each mode's pipeline efficiency =
tokens/s / ceiling of its placement, the speedup async/sync, and a benchmark.response_length workload when set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from fully_async.compare.driver import (REFUSED, _key, compare, default_repeats, load_run_config,  # noqa: F401
                                        machine_busy, mode_overrides, parse_placement_overrides, parse_placements,
                                        plan_devices, plan_runs, refuse, run_bench, run_command, run_mode, run_name,
                                        saved_bench)
from fully_async.compare.placements import format_placements, placements_summary
from fully_async.compare.plots import pyplot
from fully_async.compare.repeats import write_report as repeats_report
from fully_async.compare.report import format_repeats, summarize_repeats
from fully_async.compare.runs import CompareError
from fully_async.compare.stats import format_split
from fully_async.planner.search import choose_split


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fully_async.compare", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default="compare_out", help="output folder (default compare_out)")
    ap.add_argument("--threshold", type=float, default=0.8, help="validation reward to time (default 0.8)")
    ap.add_argument("--warmup-steps", type=int, default=0, metavar="K",
                    help="read throughput, step times and idle ratios from the steps after each run's first K (their "
                         "compiles and first allocations; the every-step figure is reported too; default 0)")
    ap.add_argument("--tail-steps", type=int, default=0, metavar="K",
                    help="and from the steps before each run's last K (the end of the run: once the rollouter has "
                         "admitted the run's last prompts, its last step waits for its own slowest responses; "
                         "default 0)")
    ap.add_argument("--devices", type=int, help="total devices N of each mode (default: trainer.n_gpus_per_node "
                    "of the overrides, else 2)")
    ap.add_argument("--placements", metavar="P[,P...]", help="async placements to compare with sync: split, "
                    "colocated, elastic (comma-separated; default split, colocated at --devices 1)")
    ap.add_argument("--split", type=int, metavar="R", help="async rollout devices (1..N-1), instead of choosing")
    ap.add_argument("--dp-efficiency", type=float, default=1.0,
                    help="data-parallel scaling efficiency of a trainer, kept per doubling of its devices, in (0, 1] "
                         "(default 1.0)")
    ap.add_argument("--bench", action="store_true", help="measure rollout-only/train-only ceilings (implied when "
                    "the split is chosen)")
    ap.add_argument("--bench-batches", type=int, default=3, help="timed batches per bench stage (default 3)")
    ap.add_argument("--bench-json", metavar="FILE", help="use this saved bench.json (of the same overrides) "
                    "instead of measuring again")
    ap.add_argument("--sync-log", metavar="DIR", help="reuse this sync run's TensorBoard dir (same overrides and "
                    "devices) instead of running sync again, e.g. to compare a second async split")
    ap.add_argument("--repeats", type=int, help="run both modes K times (alternating which runs first) and report "
                    "each figure's median and spread, warning above 20%% (default 3 on CPU, 1 on accelerators)")
    ap.add_argument("--from-logs", nargs=2, metavar=("RUN_A", "RUN_B"), help="compare two TensorBoard run dirs")
    ap.add_argument("--allow-diff", action="append", default=[], metavar="KEY",
                    help="a dotted config key allowed to differ (listed in the report); repeatable")
    ap.add_argument("--placement-override", action="append", default=[], metavar="P:KEY=VALUE",
                    help="an override of one async placement's run only, allowed to differ from sync and listed in "
                         "the report (e.g. colocated:actor_rollout_ref.rollout.weight_sync=device_ipc); repeatable")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides passed to both runs")
    args = ap.parse_intermixed_args(argv)
    out_dir = os.path.abspath(args.out)

    if any(_key(o) == "mode" for o in args.overrides):
        return refuse("do not pass mode=...: this script runs both modes with otherwise identical overrides")
    if not 0.0 < args.dp_efficiency <= 1.0:
        return refuse(f"--dp-efficiency {args.dp_efficiency} must be in (0, 1]")
    if args.repeats is not None and args.repeats < 1:
        return refuse(f"--repeats {args.repeats} must be >= 1")
    try:
        pyplot()  # the plots' extra, checked before any run starts
        return from_logs(args, out_dir) if args.from_logs else run_both(args, out_dir)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def from_logs(args: argparse.Namespace, out_dir: str) -> int:
    """--from-logs: compare two saved runs (with --bench, measured on the async run's config)."""
    if args.overrides or args.devices is not None or args.split is not None or args.placement_override:
        return refuse("overrides, --devices, --split and --placement-override are only used when this script runs "
                      "the two modes itself; --from-logs takes the devices from the runs")

    def measure(cfg: dict) -> dict:
        from fully_async.compare.bench import measure_config
        return measure_config(load_run_config(cfg), args.bench_batches)

    bench = saved_bench(args.bench_json) if args.bench_json else (measure if args.bench else None)
    rc, _ = compare(list(args.from_logs), out_dir, args.threshold, bench,
                    tuple(args.allow_diff), dp_efficiency=args.dp_efficiency, warmup_steps=args.warmup_steps,
                    tail_steps=args.tail_steps)
    return rc



def run_both(args: argparse.Namespace, out_dir: str) -> int:
    """Bench (to choose the split), sync and each async placement, the comparisons."""
    try:
        devices, overrides = plan_devices(args.overrides, args.devices)
        placements = parse_placements(args.placements, devices)
        extra = parse_placement_overrides(args.placement_override, placements)
        needs_split = bool(set(placements) & {"split", "elastic"})
        if needs_split:   # flag check before anything runs (no ceilings yet: a forced split needs none)
            choose_split(devices, None, None, args.dp_efficiency, force=1 if args.split is None else args.split)
        elif args.split is not None:
            raise ValueError(f"--split {args.split}: only split and elastic placements have a rollout/trainer split")
    except ValueError as exc:
        return refuse(str(exc))
    if args.bench_json:
        bench = saved_bench(args.bench_json)
    else:
        measure = args.bench or (needs_split and args.split is None)
        bench = run_bench(overrides, args.bench_batches, out_dir) if measure else None
    split = None
    if needs_split:
        R, T = (bench["rollout"]["tokens_per_s"], bench["train"]["tokens_per_s"]) if bench else (None, None)
        split = choose_split(devices, R, T, args.dp_efficiency, force=args.split)
        print("\n".join(["=== async split"] + format_split(split)), flush=True)
    repeats = args.repeats or default_repeats(overrides)
    if repeats > 1 and args.sync_log:
        return refuse("--sync-log reuses one sync run, so repeats would not measure its spread: use --repeats 1")
    runs = plan_runs(devices, placements, split["rollout"] if split else None, overrides, extra)
    tables: dict[str, list[dict]] = {p: [] for p in placements}
    busy: list[str] = []
    for i in range(repeats):
        rep_dir = out_dir if repeats == 1 else os.path.join(out_dir, f"repeat_{i}")
        dirs = {}
        for name, mode, _, run_overrides in (runs if i % 2 == 0 else runs[::-1]):   # alternate which goes first
            if mode == "sync" and args.sync_log:
                dirs[name] = args.sync_log
                continue
            busy += machine_busy(f"repeat {i}, {name}")
            dirs[name] = run_mode(mode, run_overrides, rep_dir, name)
        for p in placements:
            pair_dir = rep_dir if len(placements) == 1 else os.path.join(rep_dir, p)
            allowed = tuple(args.allow_diff) + tuple(_key(o) for o in extra.get(p, []))
            rc, table = compare([dirs[run_name("async", p)], dirs["sync"]], pair_dir, args.threshold, bench,
                                allowed, split if p != "colocated" else None, args.dp_efficiency,
                                args.warmup_steps, args.tail_steps)
            if rc:
                return rc
            tables[p].append(table)
    if repeats == 1 or len(placements) > 1:   # the rows with the planner's prediction of each (one placement too)
        summary = placements_summary({p: t[-1] for p, t in tables.items()})
        with open(os.path.join(out_dir, "placements.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
        print(format_placements(summary))
    if repeats > 1:
        for p, ts in tables.items():
            summary = summarize_repeats(ts, busy)
            name = "repeats.json" if len(placements) == 1 else f"repeats_{p}.json"
            with open(os.path.join(out_dir, name), "w") as fh:
                json.dump(summary, fh, indent=1)
            print(f"=== {p}\n" + format_repeats(summary) if len(placements) > 1 else format_repeats(summary))
            pair_dirs = [os.path.join(out_dir, f"repeat_{i}") if len(placements) == 1 else
                         os.path.join(out_dir, f"repeat_{i}", p) for i in range(repeats)]
            report = repeats_report(out_dir if len(placements) == 1 else os.path.join(out_dir, p), ts, summary,
                                    pair_dirs)
            print(f"report over {repeats} repeats (mean and spread of every row): {report}")
    else:
        for warning in busy:
            print(f"WARNING: {warning}")
    return 0




if __name__ == "__main__":
    sys.exit(main())
