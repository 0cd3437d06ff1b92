"""The comparison's runs: which runs with which overrides, each as a subprocess, and the comparison of two run
dirs into a report (layer 8; the command line is compare/__main__.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any, Optional

from fully_async.compare.plots import make_plots
from fully_async.compare.report import write_report
from fully_async.compare.runs import MODES, CompareError, check_diff, config_diff, read_run
from fully_async.compare.stats import build_table, format_table
from fully_async.planner.search import choose_split

REFUSED = 2


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
    """The bench (compare/bench.py) in a subprocess (its device memory is freed before the runs start)."""
    path = os.path.join(out_dir, "bench.json")
    cmd = [sys.executable, "-m", "fully_async.compare.bench", "--batches", str(batches), "--out", path, *overrides]
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



def saved_bench(path: str) -> dict:
    """A bench.json written by an earlier run of this script or python -m fully_async.compare.bench --out."""
    try:
        with open(path) as fh:
            bench = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CompareError(f"--bench-json {path}: cannot read it ({exc})") from None
    if not all(k in bench and "tokens_per_s" in bench[k] for k in ("rollout", "train")):
        raise CompareError(f"--bench-json {path}: not a bench result (needs rollout/train tokens_per_s)")
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
