"""Several jobs on one device pool vs the same jobs one after another: each job's end-to-end time, both ways.

    python scripts/multi_job_compare.py --jobs 2 --devices 2 --out multi_job_out/compare [key=value ...]

"shared": the N jobs start together, each `python -m fully_async.main mode=<--mode> multi_job.pool=...` on one
Ray cluster, time-sharing the pool's devices under its leases (README "Several jobs on one device pool"); async
jobs lease their trainer (--job-devices) and rollout (--rollout-devices) devices separately.
"sequential": the same jobs (same config without multi_job.*), one after another, each alone on the devices.
Job i gets trainer.experiment_name=job<i> and data.seed=trainer.seed=i+1 (different jobs, same size); extra
arguments are Hydra overrides for every job.  Without --ray-address (or $RAY_ADDRESS) the script starts a
private Ray head (`ray start --head --block`, its own temp dir) and stops it by killing the process group it
started.  Writes <out>/multi_job.json (per job: both wall times, validation before/after, the mean per phase
and event of the multi_job/* metrics: onload/offload seconds, memory before/after) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_head(num_cpus: Optional[int], env: dict) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="mjray", dir="/tmp")   # short: Ray's socket paths must stay under 107 bytes
    # the ray CLI as a module: works where Ray sits on PYTHONPATH without its console script (offline bundles)
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
           f"--temp-dir={temp}", "--include-dashboard=false", "--disable-usage-stats"]
    cmd += [f"--num-cpus={num_cpus}"] if num_cpus else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(2)
            return proc, f"127.0.0.1:{port}", temp
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"ray start --head exited with {proc.returncode}")
            time.sleep(0.5)
    raise SystemExit("ray start --head did not come up in 120 s")


def stop_head(proc: subprocess.Popen, temp: str) -> None:
    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(20)
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    shutil.rmtree(temp, ignore_errors=True)


def job_args(i: int, out: str, phase: str, overrides: list[str], mode: str = "sync") -> list[str]:
    name = f"job{i}"
    return [sys.executable, "-u", "-m", "fully_async.main", f"mode={mode}", "trainer.progress_bar=false",
            f"trainer.experiment_name={name}", f"data.seed={i + 1}", f"trainer.seed={i + 1}",
            "trainer.resume_mode=disable", f"trainer.default_local_dir={out}/{phase}/ckpt_{name}",
            f"hydra.run.dir={out}/{phase}/hydra_{name}", *overrides]


def launch(cmd: list[str], env: dict, log: str) -> tuple[subprocess.Popen, float]:
    os.makedirs(os.path.dirname(log), exist_ok=True)
    fh = open(log, "w")
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env), time.perf_counter()


def multi_job_means(tb_dir: str) -> dict:
    """Mean of every multi_job/* scalar over the run (TensorBoard events)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir)
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        if tag.startswith("multi_job/"):
            vals = [s.value for s in acc.Scalars(tag)]
            out[tag] = sum(vals) / len(vals)
    return out


def run_phase(phase: str, n: int, out: str, env: dict, overrides: list[list[str]], together: bool,
              mode: str = "sync") -> list[dict]:
    results: list[dict] = [{} for _ in range(n)]
    t0 = time.perf_counter()
    procs = []
    for i in range(n):
        job_env = dict(env, TENSORBOARD_DIR=f"{out}/{phase}/tb_job{i}")
        proc, start = launch(job_args(i, out, phase, overrides[i], mode), job_env, f"{out}/{phase}/job{i}.log")
        procs.append((i, proc, start))
        if not together:
            rc = proc.wait()
            results[i] = {"rc": rc, "wall_s": time.perf_counter() - start, "started_s": start - t0}
            print(f"[{phase}] job{i}: exit {rc} after {results[i]['wall_s']:.1f}s", flush=True)
    if together:
        for i, proc, start in procs:
            rc = proc.wait()
            results[i] = {"rc": rc, "wall_s": time.perf_counter() - start, "started_s": start - t0}
            print(f"[{phase}] job{i}: exit {rc} after {results[i]['wall_s']:.1f}s", flush=True)
    for i, res in enumerate(results):
        tb = f"{out}/{phase}/tb_job{i}"
        try:
            with open(os.path.join(tb, "summary.json")) as fh:
                s = json.load(fh)
            res.update({k: s[k] for k in ("steps", "val_before", "val_after", "val_last", "hardware") if k in s})
            res["metrics"] = multi_job_means(tb)
        except (OSError, ValueError) as exc:
            res["error"] = f"no summary ({exc}); see {out}/{phase}/job{i}.log"
    return results


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--devices", type=int, default=2, help="devices of the pool (multi_job.devices)")
    p.add_argument("--job-devices", default=None,
                   help="per job, the pool devices it leases (async: its trainer's): '0,1;0;1' (default: sync "
                        "every job the whole pool, async the first ones)")
    p.add_argument("--rollout-devices", default=None,
                   help="async, per job, the pool devices its rollout side leases: '1;0' (default: after the "
                        "trainer's)")
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    p.add_argument("--pool", default="compare_pool")
    p.add_argument("--out", default=os.environ.get("MULTI_JOB_OUT", "multi_job_out/compare"))
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS"))
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the private Ray head (default: Ray's count)")
    p.add_argument("--modes", default="shared,sequential")
    args, overrides = p.parse_known_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    per_job = [s.split(",") for s in args.job_devices.split(";")] if args.job_devices else [None] * args.jobs
    per_roll = [s.split(",") for s in args.rollout_devices.split(";")] if args.rollout_devices else [None] * args.jobs
    if len(per_job) != args.jobs or len(per_roll) != args.jobs:
        p.error(f"--job-devices/--rollout-devices name {len(per_job)}/{len(per_roll)} jobs, --jobs is {args.jobs}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("RAY_AUTH_MODE", "disabled")  # a private head: without this, a token in ~/.ray switches it on
    head = None
    report: dict = {"jobs": args.jobs, "mode": args.mode, "pool_devices": args.devices, "overrides": overrides,
                    "command": sys.argv}
    try:
        modes = args.modes.split(",")
        if "shared" in modes:
            address = args.ray_address
            if not address:
                proc, address, temp = start_head(args.num_cpus, env)
                head = (proc, temp)
            shared_env = dict(env, RAY_ADDRESS=address)
            pool = [f"multi_job.pool={args.pool}", f"multi_job.devices={args.devices}",
                    f"multi_job.pool_dir={out}/shared/pool"]
            ov = [overrides + pool + ([f"multi_job.job_devices=[{','.join(d)}]"] if d else [])
                  + ([f"multi_job.rollout_devices=[{','.join(r)}]"] if r else []) for d, r in zip(per_job, per_roll)]
            t0 = time.perf_counter()
            report["shared"] = run_phase("shared", args.jobs, out, shared_env, ov, together=True, mode=args.mode)
            report["shared_makespan_s"] = time.perf_counter() - t0
            report["pool_timeline"] = f"{out}/shared/pool/{args.pool}/timeline.json"
        if "sequential" in modes:
            seq_env = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}   # each job alone, its own Ray
            t0 = time.perf_counter()
            report["sequential"] = run_phase("sequential", args.jobs, out, seq_env, [overrides] * args.jobs,
                                             together=False, mode=args.mode)
            report["sequential_total_s"] = time.perf_counter() - t0
    finally:
        if head is not None:
            stop_head(*head)
    if "shared_makespan_s" in report and "sequential_total_s" in report:
        report["shared_over_sequential"] = report["shared_makespan_s"] / report["sequential_total_s"]
    with open(os.path.join(out, "multi_job.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    print_table(report)
    print(f"written: {out}/multi_job.json")
    failed = [r for m in ("shared", "sequential") for r in report.get(m, []) if r.get("rc") != 0]
    return 1 if failed else 0


def print_table(report: dict) -> None:
    print(f"\n{'job':6} {'shared e2e s':>13} {'alone e2e s':>12} {'val before->after (shared)':>28}")
    for i in range(report["jobs"]):
        sh = report.get("shared", [{}] * report["jobs"])[i]
        sq = report.get("sequential", [{}] * report["jobs"])[i]
        val = f"{sh['val_before']:.3f} -> {sh['val_after']:.3f}" if "val_after" in sh else "-"
        print(f"job{i:<3} {sh.get('wall_s', float('nan')):13.1f} {sq.get('wall_s', float('nan')):12.1f} {val:>28}")
    if "shared_makespan_s" in report:
        print(f"all jobs shared (start to last finish): {report['shared_makespan_s']:.1f}s")
    if "sequential_total_s" in report:
        print(f"one after another (sum):               {report['sequential_total_s']:.1f}s")
    if "shared_over_sequential" in report:
        print(f"shared / one after another:            {report['shared_over_sequential']:.2f}")
    for i, sh in enumerate(report.get("shared", [])):
        m = sh.get("metrics", {})
        if not m:
            continue
        print(f"job{i} per phase (mean over the run; memory of rank 0's process, GiB):")
        for phase in ("rollout", "train"):
            for event in ("onload", "offload"):
                secs = m.get(f"multi_job/{phase}/{event}_s")
                mem = [f"{stat} {m[f'multi_job/{phase}/{event}/{stat}_before']:.3f}->"
                       f"{m[f'multi_job/{phase}/{event}/{stat}_after']:.3f}"
                       for stat in ("allocated_gib", "reserved_gib", "host_rss_gib")
                       if f"multi_job/{phase}/{event}/{stat}_before" in m]
                if secs is not None:
                    print(f"  {phase:8} {event:8} {secs:7.3f}s  " + "  ".join(mem))
            wait = m.get(f"multi_job/{phase}/lease_wait_s")
            if wait is not None:
                print(f"  {phase:8} lease wait {wait:.3f}s")
            together, kept = m.get(f"multi_job/{phase}/shared"), m.get(f"multi_job/{phase}/kept")
            if together is not None:   # co-tenancy: leases granted on the measured need, state kept between them
                print(f"  {phase:8} shared leases {together:.0%}, state kept after {kept or 0.0:.0%}")
        if "multi_job/need_gib" in m:
            print(f"  declared need (mean over steps) {m['multi_job/need_gib']:.1f} GiB")


if __name__ == "__main__":
    sys.exit(main())
