"""Helpers of compare_sync_async.py: read two TensorBoard runs, diff configs, tabulate, plot, report.

Everything is computed from what a run wrote into its TensorBoard directory (scalars, the event
wall times, `config.json`, `summary.json`), so a comparison can be redone from saved logs.

Definitions (per run):
  tokens/s         sum(perf/total_num_tokens) / sum(timing_s/step)   (all devices together)
  tokens/s/device  tokens/s / devices.total (summary.json)
  samples/step     perf/total_num_tokens / (prompt_length/mean + response_length/mean)
  elapsed          event wall_time - wall_time of the run's first event
  time to reward   elapsed of the first validation point whose reward >= threshold
  ceiling          best tokens/s of the run's placement predicted from one device's rollout-only (R) and
                   train-only (T) tokens/s (scripts/bench_pipeline.py): async r+k: min(r R, k T e);
                   sync on N: 1 / (1/(N R) + 1/(N T e)) (e, the data-parallel efficiency, only when > 1 device)
  pipeline eff.    tokens/s / ceiling
  generating s     mean timing_s/gen per step (the trainer's wait for its batch; sync: the generation phase)
  switch s         mean timing_s/param_sync + onload + offload per step (the weight push / engine-trainer switch)
  train s          time/step - generating - switch

Fair comparison: equal total devices.  Two runs whose configs differ only in PLACEMENT_KEYS (and
`mode`) are compared when both use the same number of devices; any other difference is refused.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from bench_pipeline import async_ceiling, format_split, sync_ceiling

VAL_PREFIX = "val-core/"
MODES = ("async", "sync")
# what may differ between the two runs of an equal-devices comparison (compare_sync_async.py sets them per mode)
PLACEMENT_KEYS = ("trainer.n_gpus_per_node", "rollout.n_gpus_per_node", "actor_rollout_ref.actor.strategy",
                  "async_training.placement")


OLD_TAGS = {"trainer/idle_ratio": "fully_async/trainer/idle_ratio"}  # verl's name -> ours before we took verl's


@dataclass
class Run:
    log_dir: str
    scalars: dict[str, list[tuple[int, float, float]]]   # tag -> [(step, wall_time, value)] in write order
    first_wall: float                                    # wall_time of the first event in the dir
    config: dict
    summary: dict = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return str(self.config.get("mode", self.summary.get("mode", "?")))

    def series(self, tag: str) -> list[tuple[int, float, float]]:
        if tag not in self.scalars and tag in OLD_TAGS:  # a run logged before the tag took verl's name
            return self.scalars.get(OLD_TAGS[tag], [])
        return self.scalars.get(tag, [])

    def values(self, tag: str) -> list[float]:
        return [v for _, _, v in self.series(tag)]

    def after(self, warmup_steps: int, tail_steps: int = 0) -> "Run":
        """This run without the points of its first `warmup_steps` trainer steps (compiles, first allocations) and of
        its last `tail_steps` (the end of the run: the rollouter has admitted the run's last prompts, so the last
        step waits for its own slowest responses, once per run): the steady steps both modes' throughput is read from
        when --warmup-steps / --tail-steps are given."""
        if warmup_steps <= 0 and tail_steps <= 0:
            return self
        steps = ([s for s, _, _ in self.series("timing_s/step")]
                 or [s for pts in self.scalars.values() for s, _, _ in pts])
        first, last = min(steps, default=0), max(steps, default=0)
        kept = {tag: [p for p in pts if first + warmup_steps <= p[0] <= last - tail_steps]
                for tag, pts in self.scalars.items()}
        return Run(self.log_dir, kept, self.first_wall, self.config, self.summary)

    def devices(self) -> dict:
        if "devices" in self.summary:
            out = dict(self.summary["devices"])
        else:
            t, r = self.config["trainer"], self.config["rollout"]
            n_train = t["nnodes"] * t["n_gpus_per_node"]
            n_roll = r["nnodes"] * r["n_gpus_per_node"] if self.mode == "async" else 0
            out = {"trainer": n_train, "rollout": n_roll, "total": n_train + n_roll, "device": t["device"]}
        if out.get("device") == "auto":   # print what it resolved to, from the run's hardware line
            hw = str(self.summary.get("hardware", ""))
            out["device"] = ("cpu" if hw.startswith("CPU") else "npu" if "Ascend" in hw else
                             "cuda" if hw and hw[0].isdigit() else "auto")
        return out

    @property
    def strategy(self) -> str:
        """The trainer backend the run used (verl's `fsdp` resolved as config.actor_strategy resolves it)."""
        return resolved_strategy(self.config)


def resolved_strategy(config: dict) -> str:
    """actor.strategy of a saved config.json, verl's `fsdp` resolved by the trainer's device count: torch on one,
    fsdp2 on several (config.actor_strategy), so runs that trained alike compare alike."""
    strategy = str(config.get("actor_rollout_ref", {}).get("actor", {}).get("strategy", "?"))
    if strategy != "fsdp":
        return strategy
    t = config.get("trainer", {})
    return "fsdp2" if t.get("nnodes", 1) * t.get("n_gpus_per_node", 1) > 1 else "torch"


class CompareError(RuntimeError):
    """A run dir that cannot be compared (missing files, missing scalars)."""


def _read_json(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


def read_run(log_dir: str) -> Run:
    """All scalars of one TensorBoard run dir plus its config.json and (when present) summary.json."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config_path = os.path.join(log_dir, "config.json")
    if not os.path.isfile(config_path):
        raise CompareError(f"{log_dir}: no config.json (not a fully_async TensorBoard run dir; "
                           "was trainer.logger missing 'tensorboard'?)")
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    if not scalars.get("timing_s/step"):
        raise CompareError(f"{log_dir}: no timing_s/step scalars (the run logged no training step)")
    try:
        first = acc.FirstEventTimestamp()
    except ValueError:
        first = min(w for s in scalars.values() for _, w, _ in s)
    summary_path = os.path.join(log_dir, "summary.json")
    summary = _read_json(summary_path) if os.path.isfile(summary_path) else {}
    return Run(log_dir, scalars, first, _read_json(config_path), summary)


# ----------------------------------------------------------------------------------- config diff
def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(flatten(v, key) if isinstance(v, dict) and v else {key: v})
    return out


# where a run writes, not what it trains: the default experiment name carries the mode (tiny_arithmetic_${mode})
OUTPUT_KEYS = ("trainer.experiment_name", "trainer.default_local_dir")


def config_diff(a: dict, b: dict, ignore: tuple[str, ...] = ("mode",) + OUTPUT_KEYS) -> list[tuple[str, Any, Any]]:
    """(key, value in a, value in b) for every dotted key whose values differ, except `ignore` (the mode and the
    output locations) and the keys a sync run does not read (async_only_keys: the bundled preset sets them for
    async mode only)."""
    ignore = tuple(ignore) + tuple(sorted(async_only_keys()))
    fa, fb = flatten(a), flatten(b)
    for flat, config in ((fa, a), (fb, b)):
        if "actor_rollout_ref.actor.strategy" in flat:
            flat["actor_rollout_ref.actor.strategy"] = resolved_strategy(config)
    missing = object()
    diff = []
    for key in sorted(set(fa) | set(fb)):
        if key in ignore:
            continue
        va, vb = fa.get(key, missing), fb.get(key, missing)
        if va != vb:
            diff.append((key, "<absent>" if va is missing else va, "<absent>" if vb is missing else vb))
    return diff


def check_diff(diff: list[tuple[str, Any, Any]], allow_diff: tuple[str, ...],
               totals: dict[str, int]) -> tuple[list, bool]:
    """(differences that block the comparison, fair).  fair: equal total devices; then the PLACEMENT_KEYS
    may differ too.  With unequal totals a placement difference blocks (it is not a fair split either)."""
    fair = totals["async"] == totals["sync"]
    allowed = set(allow_diff) | (set(PLACEMENT_KEYS) if fair else set())
    return [d for d in diff if d[0] not in allowed], fair


def async_only_keys() -> set[str]:
    """Keys a sync run does not read (core/mode_keys.py: the staleness knobs, the rollout devices, ...): an async and
    a sync run may differ in them and still run the same workload."""
    from fully_async.core.mode_keys import MODE_ONLY, SYNC

    return {key for key, only in MODE_ONLY.items() if SYNC not in only.acts_in}


def workload_of(config: dict) -> Optional[dict]:
    """workload_report() of a run's config: its benchmark.response_length profile and benchmark.ignore_eos
    (None when neither applies)."""
    from omegaconf import OmegaConf

    from fully_async.core.config import ConfigError
    from fully_async.core.workload import workload_report

    bench = config.get("benchmark", {})
    if str(bench.get("response_length", "none")) == "none" and not bench.get("ignore_eos"):
        return None
    try:
        return workload_report(OmegaConf.create(config))
    except ConfigError as exc:  # e.g. a histogram file that moved since the run
        kind = bench.get("response_length")
        return {"kind": kind, "description": f"synthetic response lengths: {kind} (cannot describe: {exc})"}


def run_ceiling(run: "Run", bench: Optional[dict], dp_efficiency: float = 1.0) -> Optional[float]:
    """Predicted best tokens/s of the run's placement (module docstring), None without a bench."""
    if not bench:
        return None
    R, T, d = bench["rollout"]["tokens_per_s"], bench["train"]["tokens_per_s"], run.devices()
    if run.mode == "async" and d["rollout"]:
        return async_ceiling(d["rollout"], d["trainer"], R, T, dp_efficiency)
    # sync and colocated async: every device generates, then trains
    return sync_ceiling(d["trainer"], R, T, dp_efficiency)


# ----------------------------------------------------------------------------------- numbers
def tokens_per_s(run: Run, skip_first: int = 0) -> float:
    """Trained tokens over step seconds, every step (or without the first `skip_first`: compiling)."""
    return sum(run.values("perf/total_num_tokens")[skip_first:]) / sum(run.values("timing_s/step")[skip_first:])


def samples_per_step(run: Run) -> dict[int, int]:
    """step -> trained responses, recovered exactly from token totals and mean lengths."""
    prompt = {s: v for s, _, v in run.series("prompt_length/mean")}
    resp = {s: v for s, _, v in run.series("response_length/mean")}
    out = {}
    for step, _, tokens in run.series("perf/total_num_tokens"):
        per_sample = prompt.get(step, 0.0) + resp.get(step, 0.0)
        if per_sample > 0:
            out[step] = int(round(tokens / per_sample))
    return out


def val_points(run: Run) -> list[tuple[int, float, float]]:
    """(step, wall_time, mean over data sources) per validation, in time order."""
    tags = sorted(t for t in run.scalars if t.startswith(VAL_PREFIX))
    if not tags:
        return []
    per_tag = [run.series(t) for t in tags]
    points = []
    for events in zip(*per_tag):  # each validation writes every data source's tag once
        points.append((events[0][0], max(e[1] for e in events), sum(e[2] for e in events) / len(events)))
    return sorted(points, key=lambda p: p[1])


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def run_stats(run: Run, threshold: float, ceiling: Optional[float] = None, warmup_steps: int = 0,
              tail_steps: int = 0) -> dict:
    """The numbers of one run for the side-by-side table: throughput, step times and idle ratios over the steps after
    the first `warmup_steps` and before the last `tail_steps` (all steps: `tokens_per_s_all_steps`), the validation
    curve over the whole run."""
    whole, run = run, run.after(warmup_steps, tail_steps)
    step_s = run.values("timing_s/step")
    if not step_s:
        raise CompareError(f"{run.log_dir}: no trainer step after the first {warmup_steps} (--warmup-steps) and before "
                           f"the last {tail_steps} (--tail-steps)")
    devices = run.devices()
    tps = tokens_per_s(run)
    samples = samples_per_step(run)
    vals = val_points(whole)
    reached = next((p for p in vals if p[2] >= threshold), None)
    stats = {
        "mode": run.mode, "log_dir": run.log_dir, "devices": devices, "strategy": run.strategy, "steps": len(step_s),
        "wall_s": run.summary.get("wall_s"),
        "tokens_per_s": tps, "tokens_per_s_per_device": tps / max(1, devices["total"]),
        "time_per_step_s": sum(step_s) / len(step_s),
        "samples_per_s": sum(samples.values()) / sum(step_s) if samples else None,
        "val_first": vals[0][2] if vals else None, "val_final": vals[-1][2] if vals else None,
        "val_best": max(p[2] for p in vals) if vals else None,
        "time_to_threshold_s": reached[1] - run.first_wall if reached else None,
        "warmup_steps": warmup_steps, "tail_steps": tail_steps, "tokens_per_s_all_steps": tokens_per_s(whole),
        "trainer_idle_ratio": _mean(run.values("trainer/idle_ratio")),
        "rollouter_idle_ratio": _mean(run.values("fully_async/rollouter/idle_ratio")),
        "staleness_mean": _mean(run.values("fully_async/staleness/mean")),
        "staleness_max": max(run.values("fully_async/staleness/max"), default=None),
        "ceiling_tokens_per_s": ceiling, "pipeline_efficiency": tps / ceiling if ceiling else None,
        "placement": placement_of(run.config),
    }
    stats.update(step_phases(run, step_s))
    return stats


def placement_of(config: dict) -> str:
    """sync | split | colocated | elastic (async_training.placement of an async run)."""
    if config.get("mode") == "sync":
        return "sync"
    return str(config.get("async_training", {}).get("placement", "split"))


def step_phases(run: Run, step_s: list[float]) -> dict:
    """Mean seconds per step generating (the trainer's wait), switching (weight push, onload, offload) and training
    (the rest; module docstring)."""
    n = len(step_s)
    gen = run.values("timing_s/gen")
    switch = [0.0] * n
    for tag in ("timing_s/param_sync", "timing_s/onload", "timing_s/offload"):
        for i, v in enumerate(run.values(tag)[:n]):
            switch[i] += v
    gen_s = sum(gen[:n]) / n if gen else None
    switch_s = sum(switch) / n
    train_s = sum(step_s) / n - (gen_s or 0.0) - switch_s if gen else None
    return {"generate_s_per_step": gen_s, "train_s_per_step": train_s, "switch_s_per_step": switch_s}


ROWS = (  # (key, label, format)
    ("devices", "devices (trainer+rollout)", None),
    ("tokens_per_s", "tokens/s (total)", "{:.1f}"),
    ("tokens_per_s_all_steps", "tokens/s (total, every step)", "{:.1f}"),
    ("tokens_per_s_per_device", "tokens/s per device", "{:.1f}"),
    ("time_per_step_s", "time/step (s)", "{:.3f}"),
    ("generate_s_per_step", "  generating (trainer waits) (s)", "{:.3f}"),
    ("train_s_per_step", "  train (s)", "{:.3f}"),
    ("switch_s_per_step", "  switch / weight push (s)", "{:.3f}"),
    ("samples_per_s", "samples/s", "{:.2f}"),
    ("steps", "steps", "{:d}"),
    ("wall_s", "wall time incl. start-up (s)", "{:.1f}"),
    ("val_first", "val reward: first", "{:.3f}"),
    ("val_final", "val reward: final", "{:.3f}"),
    ("val_best", "val reward: best", "{:.3f}"),
    ("time_to_threshold_s", "time to val >= {thr} (s)", "{:.1f}"),
    ("trainer_idle_ratio", "trainer idle ratio (mean)", "{:.3f}"),
    ("rollouter_idle_ratio", "rollouter idle ratio (mean)", "{:.3f}"),
    ("staleness_mean", "staleness (mean)", "{:.3f}"),
    ("ceiling_tokens_per_s", "predicted ceiling (tokens/s)", "{:.1f}"),
    ("pipeline_efficiency", "pipeline efficiency (tokens/s / ceiling)", "{:.3f}"),
)


def build_table(runs: dict[str, Run], threshold: float, bench: Optional[dict] = None,
                config_diff_rows: Optional[list] = None, split: Optional[dict] = None,
                dp_efficiency: float = 1.0, warmup_steps: int = 0, tail_steps: int = 0) -> dict:
    """table.json content: per-mode stats, async/sync ratios, the headline speedups, devices and split."""
    stats = {mode: run_stats(run, threshold, run_ceiling(run, bench, dp_efficiency), warmup_steps, tail_steps)
             for mode, run in runs.items()}
    a, s = stats["async"], stats["sync"]
    ratio = {}
    for key, _, fmt in ROWS:
        if fmt and isinstance(a.get(key), (int, float)) and isinstance(s.get(key), (int, float)) and s[key]:
            ratio[key] = a[key] / s[key]
    speedup = {"tokens_per_s": ratio.get("tokens_per_s"),
               "tokens_per_s_per_device": ratio.get("tokens_per_s_per_device"),
               "samples_per_s": ratio.get("samples_per_s"),
               "time_to_threshold": (s["time_to_threshold_s"] / a["time_to_threshold_s"]
                                     if a["time_to_threshold_s"] and s["time_to_threshold_s"] is not None else None)}
    hardware = {mode: run.summary.get("hardware", "unknown") for mode, run in runs.items()}
    totals = {mode: st["devices"]["total"] for mode, st in stats.items()}
    diff = [list(d) for d in (config_diff_rows or [])]
    return {"threshold": threshold, "modes": stats, "ratio_async_over_sync": ratio, "speedup": speedup,
            "hardware": hardware, "config_diff": diff, "bench": bench, "devices_total": totals,
            "fair": totals["async"] == totals["sync"], "dp_efficiency": dp_efficiency,
            "placement_diff": [d[0] for d in diff if d[0] in PLACEMENT_KEYS and totals["async"] == totals["sync"]],
            "split": split, "workload": workload_of(runs["async"].config)}


def _fmt(value: Any, fmt: Optional[str]) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):  # devices
        return f"{value['trainer']}+{value['rollout']} ({value['device']})"
    if fmt == "{:d}":
        return str(int(value))
    return fmt.format(value) if fmt else str(value)


def table_rows(table: dict) -> list[tuple[str, str, str, str]]:
    rows = [("metric", "async", "sync", "async/sync")]
    for key, label, fmt in ROWS:
        if key in ("ceiling_tokens_per_s", "pipeline_efficiency") and not table["bench"]:
            continue
        label = label.format(thr=f"{table['threshold']:g}")
        a, s = table["modes"]["async"].get(key), table["modes"]["sync"].get(key)
        if key == "time_to_threshold_s":
            a_s = _fmt(a, fmt) if a is not None else "not reached"
            s_s = _fmt(s, fmt) if s is not None else "not reached"
        else:
            a_s, s_s = _fmt(a, fmt), _fmt(s, fmt)
        r = table["ratio_async_over_sync"].get(key)
        rows.append((label, a_s, s_s, f"{r:.3f}" if r is not None else "-"))
    return rows


def device_lines(table: dict) -> list[str]:
    """Total devices and each mode's placement (the header of the printed table and of the report)."""
    a, s = table["modes"]["async"], table["modes"]["sync"]
    da, ds = a["devices"], s["devices"]
    return [f"total devices: {da['total']} {da['device']} per mode (equal)" if table["fair"] else
            f"total devices DIFFER: async {da['total']}, sync {ds['total']} (not an equal-devices comparison; "
            "compare_sync_async.py --devices N runs one)",
            f"async: rollout {da['rollout']} + trainer {da['trainer']} device(s), strategy {a['strategy']}"
            + ("" if a.get("placement", "split") == "split" else f", placement {a['placement']}"),
            f"sync: {ds['trainer']} device(s), colocated (each trainer rank generates its share, then trains), "
            f"strategy {s['strategy']}"]


def format_table(table: dict) -> str:
    rows = table_rows(table)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    header = device_lines(table) + (format_split(table["split"]) if table["split"] else [])
    lines = header + ([table["workload"]["description"]] if table["workload"] else []) + [""] + lines
    sp = table["speedup"]
    lines.append(f"speedup async/sync: tokens/s {_fmt(sp['tokens_per_s'], '{:.2f}')}x, "
                 f"time to val >= {table['threshold']:g}: {_speedup(sp['time_to_threshold'])}")
    return "\n".join(lines)


def markdown_table(table: dict) -> str:
    rows = table_rows(table)
    out = ["| " + " | ".join(rows[0]) + " |", "| " + " | ".join(["---"] + ["---:"] * 3) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


# ----------------------------------------------------------------------------------- plots
COLORS = {"async": "tab:blue", "sync": "tab:orange"}


def _elapsed(run: Run, tag: str) -> tuple[list[float], list[float]]:
    pts = sorted(run.series(tag), key=lambda p: p[1])
    return [w - run.first_wall for _, w, _ in pts], [v for _, _, v in pts]


def _by_step(run: Run, tag: str) -> tuple[list[int], list[float]]:
    pts = sorted(run.series(tag), key=lambda p: p[0])
    return [s for s, _, _ in pts], [v for _, _, v in pts]


def _step_tokens_per_s(run: Run) -> tuple[list[float], list[float]]:
    step_s = {s: v for s, _, v in run.series("timing_s/step")}
    xs, ys = [], []
    for step, wall, tokens in sorted(run.series("perf/total_num_tokens"), key=lambda p: p[1]):
        if step_s.get(step):
            xs.append(wall - run.first_wall)
            ys.append(tokens / step_s[step])
    return xs, ys


def _samples_axis(run: Run) -> tuple[list[float], list[float]]:
    per_step = samples_per_step(run)
    total, xs, ys = 0, [], []
    for step, _, reward in sorted(run.series("critic/score/mean"), key=lambda p: p[0]):
        total += per_step.get(step, 0)
        xs.append(total)
        ys.append(reward)
    return xs, ys


PLOTS_EXTRA = "pip install 'fully_async[plots]'"


def pyplot():
    """matplotlib's pyplot on the Agg backend; matplotlib is the `plots` extra, so a missing one is named with the
    command that installs it (a CompareError: the comparison checks it before any run starts)."""
    try:
        import matplotlib
    except ImportError as e:
        raise CompareError(f"the comparison's plots need matplotlib, which is not installed: {PLOTS_EXTRA} "
                           f"(or pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _figure(path: str, title: str, panels: list[tuple[str, str, dict]], hline: Optional[float] = None) -> str:
    """One PNG with a panel per (xlabel, ylabel, {label: (xs, ys)})."""
    plt = pyplot()

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (xlabel, ylabel, series) in zip(axes[0], panels):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", markersize=3, label=label, color=COLORS.get(label.split()[0]))
        if hline is not None:
            ax.axhline(hline, color="gray", linestyle="--", linewidth=1, label=f"threshold {hline:g}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def make_plots(runs: dict[str, Run], out_dir: str, threshold: float) -> dict[str, str]:
    """Write the comparison PNGs into out_dir; returns {name: file name}."""
    def each(fn: Any, tag: Optional[str] = None) -> dict:
        return {m: (fn(r, tag) if tag else fn(r)) for m, r in runs.items()}

    t = "elapsed wall-clock (s)"
    specs = {
        "throughput": ("Throughput over time", [(t, "tokens/s (all devices)", each(_step_tokens_per_s)),
                                                (t, "perf/throughput (tokens/s per device)",
                                                 each(_elapsed, "perf/throughput"))], None),
        "reward_vs_time": ("Training reward vs wall-clock",
                           [(t, "critic/score/mean", each(_elapsed, "critic/score/mean"))], None),
        "val_reward_vs_time": ("Validation reward vs wall-clock",
                               [(t, "validation reward", {m: ([w - r.first_wall for _, w, _ in val_points(r)],
                                                              [v for _, _, v in val_points(r)])
                                                          for m, r in runs.items()})], threshold),
        "reward_vs_samples": ("Training reward vs trained samples",
                              [("trained samples (responses)", "critic/score/mean", each(_samples_axis))], None),
        "time_per_step": ("Time per step", [("step", "timing_s/step (s)", each(_by_step, "timing_s/step"))], None),
        "idle_ratios": ("Idle ratios", [("step", "trainer idle ratio",
                                         each(_by_step, "trainer/idle_ratio")),
                                        ("step", "rollouter idle ratio",
                                         each(_by_step, "fully_async/rollouter/idle_ratio"))], None),
        "staleness": ("Staleness of trained samples (param versions)",
                      [("step", "staleness mean", each(_by_step, "fully_async/staleness/mean")),
                       ("step", "staleness max", each(_by_step, "fully_async/staleness/max"))], None),
    }
    files = {}
    for name, (title, panels, hline) in specs.items():
        _figure(os.path.join(out_dir, f"{name}.png"), title, panels, hline)
        files[name] = f"{name}.png"
    return files


# ----------------------------------------------------------------------------------- report
def write_report(out_dir: str, table: dict, runs: dict[str, Run], plots: dict[str, str]) -> str:
    hw = table["hardware"]
    same_hw = len(set(hw.values())) == 1
    lines = ["# Sync vs async comparison", ""]
    lines.append(f"Hardware: {hw['async']}" if same_hw else
                 f"Hardware DIFFERS: async on {hw['async']}, sync on {hw['sync']}")
    for mode, run in runs.items():
        d = run.devices()
        lines.append(f"- {mode}: {d['total']} {d['device']} device(s) (trainer {d['trainer']}, rollout "
                     f"{d['rollout']}{', colocated' if mode == 'sync' else ''}, strategy {run.strategy}); "
                     f"log dir `{run.log_dir}`")
    lines += ["", "## Devices, split and workload", "", f"- {device_lines(table)[0]}", f"- {device_lines(table)[2]}"]
    lines += [f"- {table['workload']['description']}"] if table["workload"] else []
    lines += ["", "Async split:", "", "```text", *format_split(table["split"]), "```"] if table["split"] else []
    lines += ["", "## Config diff (apart from `mode`)", ""]
    if table["placement_diff"]:
        lines.append("Placement keys allowed to differ at equal total devices: "
                     + ", ".join(f"`{k}`" for k in PLACEMENT_KEYS) + ".")
    for k, a, b in table["config_diff"]:
        why = "placement" if k in table["placement_diff"] else "allowed by --allow-diff"
        lines.append(f"- `{k}`: async `{a}` vs sync `{b}` ({why})")
    if not table["config_diff"]:
        lines.append("none: both runs used the same resolved config except `mode`.")
    lines += ["", "## Results", "", markdown_table(table), ""]
    sp = table["speedup"]
    lines.append(f"Speedup async/sync in tokens/s: **{_fmt(sp['tokens_per_s'], '{:.2f}')}x**; "
                 f"in time to validation reward >= {table['threshold']:g}: {_speedup(sp['time_to_threshold'])}.")
    if table["bench"]:
        b, a, s = table["bench"], table["modes"]["async"], table["modes"]["sync"]
        r, k, n = a["devices"]["rollout"], a["devices"]["trainer"], s["devices"]["trainer"]
        lines.append(f"Pipeline efficiency = tokens/s / predicted ceiling of the run's placement, from R = "
                     f"{b['rollout']['tokens_per_s']:.1f} rollout-only and T = {b['train']['tokens_per_s']:.1f} "
                     f"train-only tokens/s of one {b['device']} device{' (1 thread)' if b.get('threads') == 1 else ''}"
                     f" (scripts/bench_pipeline.py), data-parallel efficiency e = {table['dp_efficiency']:g}: async "
                     f"{r}+{k}: min({r} R, {k} T{' e' if k > 1 else ''}) = {a['ceiling_tokens_per_s']:.1f} tokens/s "
                     f"(efficiency {a['pipeline_efficiency']:.3f}); sync on {n} (generate and train alternate): 1 / "
                     f"(1/({n} R) + 1/({n} T{' e' if n > 1 else ''})) = {s['ceiling_tokens_per_s']:.1f} tokens/s "
                     f"(efficiency {s['pipeline_efficiency']:.3f}).")
    lines += ["", "Definitions: tokens/s = sum(perf/total_num_tokens) / sum(timing_s/step) (prompt + response "
              "tokens of trained samples, all devices of the mode together); per device = divided by the "
              "mode's device count; samples/s counts trained responses; times to the reward threshold are "
              "wall-clock seconds from each run's first TensorBoard event; idle ratios and staleness are "
              "means over steps.  Neither mode counts validation in a step's time: sync validates after the "
              "step's clock stops (timing_s/testing), async validates on the rollouter, outside the trainer's step."]
    warm = table["modes"]["async"].get("warmup_steps") or 0
    tail = table["modes"]["async"].get("tail_steps") or 0
    if warm or tail:
        lines[-1] += (f"  Throughput, step times, idle ratios and staleness leave out each run's first {warm} step(s) "
                      f"(compiles, first allocations; --warmup-steps) and last {tail} (the end of the run, where the "
                      "last step waits for its own tail; --tail-steps); 'every step' keeps them.")
    lines += ["", "## Plots", ""]
    lines += [f"![{name}]({fname})" for name, fname in plots.items()]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def _speedup(value: Optional[float]) -> str:
    return "not reached (by one mode or both)" if value is None else f"{value:.2f}x"


# ----------------------------------------------------------------------------------- repeats
REPEAT_FIGURES = (("tokens/s async", ("modes", "async", "tokens_per_s")),
                  ("tokens/s sync", ("modes", "sync", "tokens_per_s")),
                  ("speedup async/sync", ("speedup", "tokens_per_s")),
                  ("time/step async (s)", ("modes", "async", "time_per_step_s")),
                  ("time/step sync (s)", ("modes", "sync", "time_per_step_s")))
SPREAD_WARNING = 0.20


def summarize_repeats(tables: list[dict], busy: Optional[list[str]] = None) -> dict:
    """Median, min, max and spread ((max - min) / median) of each headline figure over repeated comparisons of
    the same workload; warnings when a spread exceeds 20% or the machine was busy before a run started."""
    import statistics

    figures, warnings = {}, []
    for name, path in REPEAT_FIGURES:
        values = []
        for t in tables:
            v: Any = t
            for key in path:
                v = v.get(key) if isinstance(v, dict) else None
            if v is not None:
                values.append(float(v))
        if not values:
            continue
        med = statistics.median(values)
        spread = (max(values) - min(values)) / med if med else float("nan")
        figures[name] = {"values": values, "median": med, "min": min(values), "max": max(values), "spread": spread}
        if len(values) > 1 and spread > SPREAD_WARNING:
            warnings.append(f"{name}: spread {spread:.0%} over {len(values)} repeats (> {SPREAD_WARNING:.0%}): "
                            "the difference between the modes may be noise; run more steps or repeats")
    warnings += list(busy or [])
    return {"repeats": len(tables), "figures": figures, "warnings": warnings}


def format_repeats(summary: dict) -> str:
    rows = [("figure", "median", "min", "max", "spread")]
    for name, f in summary["figures"].items():
        rows.append((name, f"{f['median']:.3g}", f"{f['min']:.3g}", f"{f['max']:.3g}", f"{f['spread']:.0%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"over {summary['repeats']} repeats (each: async and sync on the same workload):"]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines += [f"WARNING: {w}" for w in summary["warnings"]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- several placements
def simulated(log_dir: str) -> Optional[dict]:
    """The planner's simulation of a run from its own logs (scripts/sim_check.py predict: its stage costs, config
    and synthetic lengths), every step as measured; None where it cannot (lengths not logged, no engine timings)."""
    from sim_check import predict

    try:
        return predict(read_run(log_dir))
    except (ValueError, CompareError, KeyError):
        return None


def sync_costs(sync_dir: str) -> Optional[Any]:
    """The sync run's stage costs as the planner reads them (scripts/sim_check.py forward_costs: compiling steps
    left out, dp efficiency 0.9 per doubling), read once per summary; None where they cannot be read."""
    from sim_check import forward_costs

    try:
        return forward_costs(read_run(sync_dir), 0.9)
    except (ValueError, CompareError, KeyError):
        return None


def forecast(log_dir: str, costs: Any) -> Optional[dict]:
    """The planner's forward prediction of a run from the sync run's stage costs (`sync_costs`) and the run's own
    first-step compiling (sim_check.predict); None where it cannot."""
    from sim_check import predict

    try:
        return predict(read_run(log_dir), costs)
    except (ValueError, CompareError, KeyError):
        return None


def placements_summary(tables: dict[str, dict], simulate: bool = True) -> dict:
    """One row per run of a comparison of placements (placement -> its table with the shared sync run): devices,
    tokens/s, x sync, time/step and its generating / train / switch seconds; with `simulate`, the planner's
    simulated tokens/s of every step next to the measured one (`simulated`), and its forward prediction from the
    sync run's costs (`forecast`: the run's own first-step compiling priced) next to it too."""
    keys = ("tokens_per_s", "tokens_per_s_all_steps", "time_per_step_s", "generate_s_per_step", "train_s_per_step",
            "switch_s_per_step", "trainer_idle_ratio", "rollouter_idle_ratio", "log_dir")
    first = next(iter(tables.values()))
    rows = [dict({k: first["modes"]["sync"].get(k) for k in keys}, placement="sync",
                 devices=first["modes"]["sync"]["devices"], x_sync=1.0)]
    for placement, table in tables.items():
        a = table["modes"]["async"]
        rows.append(dict({k: a.get(k) for k in keys}, placement=placement, devices=a["devices"],
                         x_sync=table["speedup"]["tokens_per_s"]))
    sync_dir = rows[0].get("log_dir")
    costs = sync_costs(sync_dir) if simulate and sync_dir else None
    for row in rows:
        sim = simulated(row["log_dir"]) if simulate and row.get("log_dir") else None
        row["simulated_tokens_per_s"] = sim["predicted"]["tokens_per_s"] if sim else None
        row["simulation_error"] = sim["error"] if sim else None
        ahead = forecast(row["log_dir"], costs) if costs is not None and row.get("log_dir") else None
        row["predicted_tokens_per_s"] = ahead["predicted"]["tokens_per_s"] if ahead else None
        row["prediction_error"] = ahead["predicted"]["tokens_per_s"] / row["tokens_per_s_all_steps"] - 1.0 \
            if ahead and row.get("tokens_per_s_all_steps") else None
    best = max(rows, key=lambda r: r["tokens_per_s"] or 0.0)
    return {"rows": rows, "best": best["placement"], "best_over_sync": best["x_sync"]}


def _percent(value: Optional[float]) -> str:
    return _fmt(100 * value if value is not None else None, "{:+.1f}%")


def format_placements(summary: dict) -> str:
    head = ("run", "devices (t+r)", "tokens/s", "x sync", "time/step s", "generating s", "train s", "switch s",
            "every step", "predicted", "error", "simulated", "error")
    rows = [head] + [(r["placement"], _fmt(r["devices"], None), _fmt(r["tokens_per_s"], "{:.1f}"),
                      _fmt(r["x_sync"], "{:.2f}"), _fmt(r["time_per_step_s"], "{:.3f}"),
                      _fmt(r["generate_s_per_step"], "{:.3f}"), _fmt(r["train_s_per_step"], "{:.3f}"),
                      _fmt(r["switch_s_per_step"], "{:.3f}"), _fmt(r.get("tokens_per_s_all_steps"), "{:.1f}"),
                      _fmt(r.get("predicted_tokens_per_s"), "{:.1f}"), _percent(r.get("prediction_error")),
                      _fmt(r.get("simulated_tokens_per_s"), "{:.1f}"), _percent(r.get("simulation_error")))
                     for r in summary["rows"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["=== every placement against the same sync run"]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.append(f"fastest: {summary['best']} ({summary['best_over_sync']:.2f}x sync's tokens/s); simulated: the "
                 "planner's pipeline simulation of each run from its own logs (scripts/sim_check.py), against its "
                 "every-step tokens/s; predicted: the planner's forward prediction from the sync run's costs and the "
                 "run's own first-step compiling (sim_check.py --costs-from), against its every-step tokens/s too")
    return "\n".join(lines)
