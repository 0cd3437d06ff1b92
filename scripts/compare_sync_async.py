"""Run the same workload in sync and async mode (or take two saved runs) and compare them.

  python scripts/compare_sync_async.py [--out DIR] [--threshold 0.8] [--bench] [overrides...]
  python scripts/compare_sync_async.py --from-logs RUN_A RUN_B [--out DIR] [--threshold 0.8]

The first form runs `python -m fully_async.main mode=async <overrides>` and then the same with
`mode=sync`, each writing TensorBoard to DIR/runs/<mode> under the same experiment name, so the
two resolved configs differ only in `mode` (both get trainer.resume_mode=disable first, so the
second run never resumes from the first one's checkpoint).  The second form compares two
existing TensorBoard run dirs (one async, one sync).  Either way the two `config.json` must agree on every key but
`mode` (exit 2 naming the differing keys otherwise; `--allow-diff KEY` accepts a known
difference, e.g. device placement, and the report lists it).

Writes into DIR: report.md, table.json and PNG plots; prints the side-by-side table.  `--bench`
also measures rollout-only and train-only throughput (scripts/bench_pipeline.py) once for the
config and reports each mode's pipeline efficiency = tokens/s / min(rollout-only, train-only).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_lib import (MODES, CompareError, build_table, config_diff, format_table, make_plots,  # noqa: E402
                         read_run, write_report)

REFUSED = 2


# Both runs share trainer.default_local_dir (same experiment name): with the default resume_mode=auto
# the second run would resume from a checkpoint the first one left there.  Users may override it.
DEFAULT_OVERRIDES = ["trainer.resume_mode=disable"]


def run_mode(mode: str, overrides: list[str], out_dir: str) -> str:
    """One training run as a subprocess; returns its TensorBoard dir (output also in DIR/logs/<mode>.log)."""
    tb_dir = os.path.join(out_dir, "runs", mode)
    shutil.rmtree(tb_dir, ignore_errors=True)  # stale event files would mix into this run's curves
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    log_path = os.path.join(out_dir, "logs", f"{mode}.log")
    cmd = [sys.executable, "-m", "fully_async.main", f"mode={mode}", *DEFAULT_OVERRIDES, *overrides,
           f"hydra.run.dir={os.path.join(out_dir, 'hydra', mode)}"]
    env = dict(os.environ, TENSORBOARD_DIR=tb_dir)
    print(f"=== {mode}: {' '.join(cmd[1:])}", flush=True)
    with open(log_path, "w") as log, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True, bufsize=1) as proc:
        for line in proc.stdout:
            log.write(line)
            sys.stdout.write(f"[{mode}] {line}")
        rc = proc.wait()
    if rc != 0:
        raise CompareError(f"the {mode} run failed with exit code {rc}; its output is in {log_path}")
    return tb_dir


def load_run_config(config: dict):
    """An OmegaConf config (schema-checked) from a run's resolved config.json."""
    from omegaconf import OmegaConf

    from fully_async.hydra_setup import load_config

    return OmegaConf.merge(load_config([]), OmegaConf.create(config))


def refuse(message: str) -> int:
    print(f"refusing to compare: {message}", file=sys.stderr)
    return REFUSED


def compare(dirs: list[str], out_dir: str, threshold: float, bench: Any,
            allow_diff: tuple[str, ...] = ()) -> tuple[int, Optional[dict]]:
    """Compare two run dirs; returns (exit code, table).  `bench`: None, a result dict, or config -> dict."""
    runs = [read_run(d) for d in dirs]
    modes = sorted(r.mode for r in runs)
    if modes != sorted(MODES):
        return refuse(f"need one async and one sync run, got modes {modes} ({dirs[0]}, {dirs[1]})"), None
    by_mode = {r.mode: r for r in sorted(runs, key=lambda r: MODES.index(r.mode))}
    diff = config_diff(by_mode["async"].config, by_mode["sync"].config)
    blocking = [d for d in diff if d[0] not in allow_diff]
    if blocking:
        keys = "\n".join(f"  {k}: async={a!r} sync={b!r}" for k, a, b in blocking)
        return refuse(f"the two config.json differ in more than `mode`:\n{keys}\n"
                      "rerun with identical overrides (or pass --allow-diff KEY for a deliberate difference)"), None
    if callable(bench):  # measured lazily: only once the configs are known to be comparable
        bench = bench(by_mode["async"].config)
    os.makedirs(out_dir, exist_ok=True)
    table = build_table(by_mode, threshold, bench, diff)
    plots = make_plots(by_mode, out_dir, threshold)
    write_report(out_dir, table, by_mode, plots)
    with open(os.path.join(out_dir, "table.json"), "w") as fh:
        json.dump(table, fh, indent=1, default=str)
    print(format_table(table))
    print(f"report: {os.path.join(out_dir, 'report.md')}")
    return 0, table


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default="compare_out", help="output folder (default compare_out)")
    ap.add_argument("--threshold", type=float, default=0.8, help="validation reward to time (default 0.8)")
    ap.add_argument("--bench", action="store_true", help="measure rollout-only/train-only ceilings too")
    ap.add_argument("--bench-batches", type=int, default=3, help="timed batches per bench stage (default 3)")
    ap.add_argument("--from-logs", nargs=2, metavar=("RUN_A", "RUN_B"), help="compare two TensorBoard run dirs")
    ap.add_argument("--allow-diff", action="append", default=[], metavar="KEY",
                    help="a dotted config key allowed to differ (listed in the report); repeatable")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides passed to both runs")
    args = ap.parse_intermixed_args(argv)
    out_dir = os.path.abspath(args.out)

    if any(o.split("=", 1)[0].lstrip("+~") == "mode" for o in args.overrides):
        return refuse("do not pass mode=...: this script runs both modes with otherwise identical overrides")
    bench = None
    if args.bench:
        import bench_pipeline
        if args.from_logs:
            bench = lambda cfg: bench_pipeline.measure_config(load_run_config(cfg), args.bench_batches)  # noqa: E731
        else:
            bench = lambda cfg: bench_pipeline.measure(args.overrides, args.bench_batches)  # noqa: E731
    try:
        if args.from_logs:
            if args.overrides:
                return refuse("overrides are only used when this script runs the two modes itself")
            dirs = list(args.from_logs)
        else:
            dirs = [run_mode(mode, args.overrides, out_dir) for mode in MODES]
        rc, _ = compare(dirs, out_dir, args.threshold, bench, tuple(args.allow_diff))
        return rc
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
