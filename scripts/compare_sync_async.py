"""Run the same workload in sync and async mode on equal total devices (or take two saved runs) and compare.

  python scripts/compare_sync_async.py [--devices N] [--placements split,colocated,elastic] [--split R]
                                       [--dp-efficiency E] [--bench] [--out DIR] [--threshold 0.8] [overrides...]
  python scripts/compare_sync_async.py --from-logs RUN_A RUN_B [--bench] [--out DIR] [--threshold 0.8]

The first form compares at equal total devices N on one node (--devices; default the overrides'
trainer.n_gpus_per_node, else 2; the script sets the placement keys per mode, so the overrides must
not set rollout.n_gpus_per_node or an nnodes other than 1):
  sync   `mode=sync trainer.n_gpus_per_node=N`: one colocated engine + trainer rank per device,
         generate and train alternate;
  async  `mode=async rollout.n_gpus_per_node=r trainer.n_gpus_per_node=N-r`: the split r chosen from
         the measured ceilings (scripts/bench_pipeline.py: R, T = rollout-only and train-only tokens/s of
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
same total number of devices, the placement keys (compare_lib.PLACEMENT_KEYS, listed in the report);
any other difference is refused (exit 2 naming the keys; `--allow-diff KEY` accepts a known one, and
the report lists it).  Runs whose summary.json names different hardware (a sync run reused from another machine
with --sync-log or --from-logs) are refused too: a ratio across cards is no speedup (`--allow-diff hardware`).

`--repeats K` (default 3 on CPU, 1 on accelerators) runs both modes K times, alternating which goes first,
each repeat into DIR/repeat_<i>/, and prints the median, min, max and spread of tokens/s, time/step and the
speedup (DIR/repeats.json), warning when a spread exceeds 20% or the load average before a run was high.

Writes into DIR: report.md, table.json, PNG plots (and bench.json when it ran the bench); prints the side-by-side table: devices, the
split and why (candidate splits with predicted ceilings), each mode's pipeline efficiency = tokens/s /
ceiling of its placement, the speedup async/sync, and a benchmark.response_length workload when set.
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

from bench_pipeline import choose_split, format_split  # noqa: E402
from compare_lib import (MODES, CompareError, build_table, check_diff, config_diff, format_placements,  # noqa: E402
                         format_repeats, format_table, make_plots, placements_summary, pyplot, read_run,
                         summarize_repeats, write_report)

REFUSED = 2
HERE = os.path.dirname(os.path.abspath(__file__))


# Both runs share trainer.default_local_dir (same experiment name): with the default resume_mode=auto
# the second run would resume from a checkpoint the first one left there.  Users may override it.
DEFAULT_OVERRIDES = ["trainer.resume_mode=disable"]
PLACED = ("trainer.n_gpus_per_node", "trainer.nnodes", "rollout.n_gpus_per_node", "rollout.nnodes",
          "async_training.placement")
PLACEMENTS = ("split", "colocated", "elastic")
PLACEMENT_KEY = "async_training.placement"
STRATEGY = "actor_rollout_ref.actor.strategy"


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _value(overrides: list[str], key: str) -> Optional[str]:
    return next((o.split("=", 1)[1] for o in overrides if _key(o) == key and "=" in o), None)


def parse_placements(text: Optional[str], devices: int) -> list[str]:
    """The async placements to run (--placements; default split, colocated at one device).  Raises ValueError
    naming the flag."""
    if text is None:
        return ["split"] if devices >= 2 else ["colocated"]
    items = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in items if p not in PLACEMENTS]
    if not items or bad:
        raise ValueError(f"--placements {text!r}: expected a comma-separated subset of {','.join(PLACEMENTS)}")
    if devices < 2 and set(items) - {"colocated"}:
        raise ValueError(f"--placements {text} at --devices {devices}: split and elastic need a rollout and a trainer "
                         "device (>= 2); one device has only sync and colocated (--placements colocated)")
    return list(dict.fromkeys(items))


def plan_devices(overrides: list[str], devices: Optional[int]) -> tuple[int, list[str]]:
    """(N, the overrides without placement keys).  Raises ValueError naming the key/flag."""
    for key in ("trainer.nnodes", "rollout.nnodes"):
        if _value(overrides, key) not in (None, "1"):
            raise ValueError(f"{key}={_value(overrides, key)}: the equal-devices comparison places all N devices "
                             "on one node; pass --devices N instead")
    if _value(overrides, "rollout.n_gpus_per_node") is not None:
        raise ValueError("rollout.n_gpus_per_node is set per mode by this script: pass --split R (async rollout "
                         "devices) and --devices N instead")
    if _value(overrides, PLACEMENT_KEY) is not None:
        raise ValueError(f"{PLACEMENT_KEY} is set per run by this script: pass --placements instead")
    given = _value(overrides, "trainer.n_gpus_per_node")
    if given is not None and not given.isdigit():
        raise ValueError(f"trainer.n_gpus_per_node={given} is not a device count")
    if devices is None:
        devices = int(given) if given is not None else 2
    elif given is not None and int(given) != devices:
        raise ValueError(f"trainer.n_gpus_per_node={given} contradicts --devices {devices}; pass one of them")
    if devices < 1:
        raise ValueError(f"--devices {devices}: needs at least 1 device")
    return devices, [o for o in overrides if _key(o) not in PLACED]


def mode_overrides(mode: str, devices: int, rollout: int, overrides: list[str], placement: str = "split") -> list[str]:
    """The placement of one run: sync on all `devices`; async split / elastic `rollout` + the rest; colocated async
    on all `devices` with no rollout devices (fsdp2 when the trainer has several devices and the overrides set no
    strategy)."""
    if mode == "sync" or placement == "colocated":
        trainer, rollout = devices, 0
    else:
        trainer = devices - rollout
    out = [f"trainer.n_gpus_per_node={trainer}"] + ([f"rollout.n_gpus_per_node={rollout}"] if mode == "async" else [])
    if mode == "async" and placement != "split":
        out.append(f"{PLACEMENT_KEY}={placement}")
    if trainer > 1 and _value(overrides, STRATEGY) is None:
        out.append(f"{STRATEGY}=fsdp2")
    return out


def run_name(mode: str, placement: str = "split") -> str:
    """sync | async (split) | async_<placement>: the run's dir under DIR/runs and its log's name."""
    return mode if mode == "sync" or placement == "split" else f"{mode}_{placement}"


def run_command(mode: str, overrides: list[str], out_dir: str, name: Optional[str] = None) -> tuple[list[str], str]:
    """(the command of one training run, its TensorBoard dir)."""
    name = name or mode
    cmd = [sys.executable, "-m", "fully_async.main", f"mode={mode}", *DEFAULT_OVERRIDES, *overrides,
           f"hydra.run.dir={os.path.join(out_dir, 'hydra', name)}"]
    return cmd, os.path.join(out_dir, "runs", name)


def run_mode(mode: str, overrides: list[str], out_dir: str, name: Optional[str] = None) -> str:
    """One training run as a subprocess; returns its TensorBoard dir (output also in DIR/logs/<name>.log)."""
    cmd, tb_dir = run_command(mode, overrides, out_dir, name)
    shutil.rmtree(tb_dir, ignore_errors=True)  # stale event files would mix into this run's curves
    _stream(name or mode, cmd, out_dir, dict(os.environ, TENSORBOARD_DIR=tb_dir))
    return tb_dir


def run_bench(overrides: list[str], batches: int, out_dir: str) -> dict:
    """scripts/bench_pipeline.py in a subprocess (its device memory is freed before the runs start)."""
    path = os.path.join(out_dir, "bench.json")
    cmd = [sys.executable, os.path.join(HERE, "bench_pipeline.py"), "--batches", str(batches), "--out", path,
           *overrides]
    _stream("bench", cmd, out_dir, dict(os.environ))
    with open(path) as fh:
        return json.load(fh)


def _stream(name: str, cmd: list[str], out_dir: str, env: dict) -> None:
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    log_path = os.path.join(out_dir, "logs", f"{name}.log")
    print(f"=== {name}: {' '.join(cmd[1:])}", flush=True)
    with open(log_path, "w") as log, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True, bufsize=1) as proc:
        for line in proc.stdout:
            log.write(line)
            sys.stdout.write(f"[{name}] {line}")
        rc = proc.wait()
    if rc != 0:
        raise CompareError(f"the {name} run failed with exit code {rc}; its output is in {log_path}")


def load_run_config(config: dict):
    """An OmegaConf config (schema-checked) from a run's resolved config.json."""
    from omegaconf import OmegaConf

    from fully_async.run.hydra_setup import load_config

    return OmegaConf.merge(load_config([]), OmegaConf.create(config))


def refuse(message: str) -> int:
    print(f"refusing to compare: {message}", file=sys.stderr)
    return REFUSED


def compare(dirs: list[str], out_dir: str, threshold: float, bench: Any, allow_diff: tuple[str, ...] = (),
            split: Optional[dict] = None, dp_efficiency: float = 1.0,
            warmup_steps: int = 0, tail_steps: int = 0) -> tuple[int, Optional[dict]]:
    """Compare two run dirs; returns (exit code, table).  `bench`: None, a result dict, or config -> dict.
    `split`: choose_split's result for the async run (None: derived from the runs when bench is given)."""
    runs = [read_run(d) for d in dirs]
    modes = sorted(r.mode for r in runs)
    if modes != sorted(MODES):
        return refuse(f"need one async and one sync run, got modes {modes} ({dirs[0]}, {dirs[1]})"), None
    by_mode = {r.mode: r for r in sorted(runs, key=lambda r: MODES.index(r.mode))}
    hardware = {m: str(r.summary.get("hardware") or "") for m, r in by_mode.items()}
    if all(hardware.values()) and hardware["async"] != hardware["sync"] and "hardware" not in allow_diff:
        return refuse(f"the runs ran on different hardware (async: {hardware['async']}; sync: {hardware['sync']}): a "
                      "ratio across cards is not a speedup; rerun the baseline on the same machine (or pass "
                      "--allow-diff hardware to compare anyway)"), None
    totals = {m: r.devices()["total"] for m, r in by_mode.items()}
    diff = config_diff(by_mode["async"].config, by_mode["sync"].config)
    blocking, fair = check_diff(diff, allow_diff, totals)
    if blocking:
        keys = "\n".join(f"  {k}: async={a!r} sync={b!r}" for k, a, b in blocking)
        placement = "" if fair else (f"\n(placement keys may differ only at equal total devices; these runs use "
                                     f"async {totals['async']} vs sync {totals['sync']})")
        return refuse(f"the two config.json differ in more than `mode`:\n{keys}{placement}\n"
                      "rerun with identical overrides (or pass --allow-diff KEY for a deliberate difference)"), None
    if callable(bench):  # measured lazily: only once the configs are known to be comparable
        bench = bench(by_mode["async"].config)
    d = by_mode["async"].devices()
    if split is None and bench and fair and d["rollout"]:  # the predicted ceilings of every split, this run's marked
        split = choose_split(d["total"], bench["rollout"]["tokens_per_s"], bench["train"]["tokens_per_s"],
                             dp_efficiency, force=d["rollout"], forced_by=f"the async run's split {d['rollout']}+"
                             f"{d['trainer']}")
    os.makedirs(out_dir, exist_ok=True)
    table = build_table(by_mode, threshold, bench, diff, split, dp_efficiency, warmup_steps, tail_steps)
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
        import bench_pipeline
        return bench_pipeline.measure_config(load_run_config(cfg), args.bench_batches)

    bench = saved_bench(args.bench_json) if args.bench_json else (measure if args.bench else None)
    rc, _ = compare(list(args.from_logs), out_dir, args.threshold, bench,
                    tuple(args.allow_diff), dp_efficiency=args.dp_efficiency, warmup_steps=args.warmup_steps,
                    tail_steps=args.tail_steps)
    return rc


def saved_bench(path: str) -> dict:
    """A bench.json written by an earlier run of this script or bench_pipeline.py --out."""
    try:
        with open(path) as fh:
            bench = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CompareError(f"--bench-json {path}: cannot read it ({exc})") from None
    if not all(k in bench and "tokens_per_s" in bench[k] for k in ("rollout", "train")):
        raise CompareError(f"--bench-json {path}: not a bench_pipeline result (needs rollout/train tokens_per_s)")
    return bench


def parse_placement_overrides(items: list[str], placements: list[str]) -> dict[str, list[str]]:
    """--placement-override P:KEY=VALUE (repeatable) -> {placement: [KEY=VALUE, ...]}: overrides of one async
    placement's run only (e.g. colocated with device-IPC weight sync, which the split run refuses).  Raises
    ValueError naming the flag."""
    out: dict[str, list[str]] = {}
    for item in items:
        placement, _, override = item.partition(":")
        if placement not in placements or "=" not in override or not override.split("=", 1)[0]:
            raise ValueError(f"--placement-override {item!r}: expected P:KEY=VALUE with P one of the runs' placements "
                             f"({','.join(placements)})")
        if _key(override) in ("mode", PLACEMENT_KEY, "trainer.n_gpus_per_node", "rollout.n_gpus_per_node"):
            raise ValueError(f"--placement-override {item!r}: {_key(override)} is set per run by this script")
        out.setdefault(placement, []).append(override)
    return out


def plan_runs(devices: int, placements: list[str], rollout: Optional[int], overrides: list[str],
              extra: Optional[dict[str, list[str]]] = None) -> list[tuple]:
    """(name, mode, placement, overrides) of every run: sync, then each async placement (rollout: the split's
    rollout devices, used by split and elastic; extra: a placement's own overrides, last so they win)."""
    runs = [("sync", "sync", "split", overrides + mode_overrides("sync", devices, 0, overrides))]
    for p in placements:
        runs.append((run_name("async", p), "async", p,
                     overrides + mode_overrides("async", devices, rollout or 0, overrides, p)
                     + (extra or {}).get(p, [])))
    return runs


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
        bench = run_bench(overrides, args.bench_batches, out_dir) if args.bench or (needs_split and args.split is None) \
            else None
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
        print(f"per-repeat reports: {os.path.join(out_dir, 'repeat_<i>', 'report.md')}")
    else:
        for warning in busy:
            print(f"WARNING: {warning}")
    return 0


def default_repeats(overrides: list[str]) -> int:
    """3 on CPU (a shared machine's noise is large next to the differences measured), else 1."""
    from fully_async.device import get_device

    try:
        return 3 if get_device(_value(overrides, "trainer.device") or "auto").name == "cpu" else 1
    except Exception:  # noqa: BLE001 - an unusable device fails in the runs themselves, with its own message
        return 1


def machine_busy(what: str) -> list[str]:
    """A warning when the load average before a run exceeds half the cores (other work skews the timing)."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return [f"{what}: load average {load:.1f} on {cores} cores before it started: the machine was busy, timings "
            "are less reliable"] if load > 0.5 * cores else []


if __name__ == "__main__":
    sys.exit(main())
