"""The numbers of a comparison: per-run statistics, the side-by-side table and its text forms (layer 8).

Definitions (per run):
  tokens/s         sum(perf/total_num_tokens) / sum(timing_s/step)   (all devices together)
  tokens/s/device  tokens/s / devices.total (summary.json)
  samples/step     perf/total_num_tokens / (prompt_length/mean + response_length/mean)
  elapsed          event wall_time - wall_time of the run's first event
  time to reward   elapsed of the first validation point whose reward >= threshold
  ceiling          best tokens/s of the run's placement predicted from one device's rollout-only (R) and
                   train-only (T) tokens/s (compare/bench.py; planner/search.py prices them): async r+k:
                   min(r R, k T e); sync on N: 1 / (1/(N R) + 1/(N T e)) (e, the data-parallel efficiency)
  pipeline eff.    tokens/s / ceiling
  generating s     mean timing_s/gen per step (the trainer's wait for its batch; sync: the generation phase)
  switch s         mean timing_s/param_sync + onload + offload per step (the weight push / engine-trainer switch)
  train s          time/step - generating - switch
  update s         mean timing_s/update_actor per step (the policy update alone, inside train s)
  mfu              mean perf/mfu/actor (the update's model FLOPs utilisation; train/train_step.py counts it)
  after an update  mean time/step of the steps that first train on a new weight version (the version of the
                   step before was another: fully_async/count/current_param_version), and of the others; only
                   where the version holds for several steps (async with trigger_parameter_sync_step > 1); sync
                   and an update every step: none.  The first step of a version waits for groups the staleness
                   bound let start only after the update, so these steps are the slow ones
  whole versions   mean time/step over the versions whose every step is timed (from an update to the next): the
                   long-run mean of a run with an update every k steps, which a window cutting a version weighs
                   wrongly (steps 3-9 of a run updating every 4 hold two first steps in seven, not one in four)
"""
from __future__ import annotations

import os
from typing import Any, Optional

from fully_async.compare.runs import PLACEMENT_KEYS, VAL_PREFIX, CompareError, Run, placement_of, workload_of
from fully_async.planner.search import async_ceiling, sync_ceiling


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
    stats.update(steps_by_version(whole, run))
    return stats


VERSION_TAG = "fully_async/count/current_param_version"


def first_steps_of_versions(run: Run) -> tuple[set[int], set[int]]:
    """The steps whose weight version differs from the step before's (the first of each version after the first)
    and the other steps that have a step before them, from fully_async/count/current_param_version."""
    version = {step: v for step, _, v in run.series(VERSION_TAG)}
    first = {step for step in version if step - 1 in version and version[step] != version[step - 1]}
    return first, {step for step in version if step - 1 in version} - first


def whole_versions(whole: Run, first_steps: set[int], timed_steps: set[int]) -> list[list[int]]:
    """The weight versions whose every step is timed: each begins with an update (one of `first_steps`, from
    first_steps_of_versions) and ends where the next version begins inside the run (not cut off by its end)."""
    version = {step: v for step, _, v in whole.series(VERSION_TAG)}
    spans = []
    for start in sorted(first_steps):
        end = start
        while end + 1 in version and version[end + 1] == version[start]:
            end += 1
        if end + 1 in version and all(step in timed_steps for step in range(start, end + 1)):
            spans.append(list(range(start, end + 1)))
    return spans


def steps_by_version(whole: Run, run: Run) -> dict:
    """Mean seconds of `run`'s steps that first train on a new weight version and of its other steps (module
    docstring), and of the steps of the versions timed whole (`whole_versions`: a window that starts or ends inside
    a version weighs its first step too much or too little; with an update every k steps, the long-run mean is
    this one); the version of the step before the first timed one is read from `whole`."""
    first_steps, other_steps = first_steps_of_versions(whole)
    step_s = run.series("timing_s/step")
    first = [seconds for step, _, seconds in step_s if step in first_steps]
    inside = [seconds for step, _, seconds in step_s if step in other_steps]
    if not first or not inside:
        return {"step_after_update_s": None, "step_inside_version_s": None, "step_whole_versions_s": None,
                "whole_versions": None}
    seconds = {step: t for step, _, t in step_s}
    spans = whole_versions(whole, first_steps, set(seconds))
    return {"step_after_update_s": _mean(first), "step_inside_version_s": _mean(inside),
            "step_whole_versions_s": _mean([seconds[step] for span in spans for step in span]),
            "whole_versions": len(spans)}


def step_phases(run: Run, step_s: list[float]) -> dict:
    """Mean seconds per step generating (the trainer's wait), switching (weight push, onload, offload) and training
    (the rest), the update's own seconds and its perf/mfu/actor (module docstring)."""
    n = len(step_s)
    gen = run.values("timing_s/gen")
    switch = [0.0] * n
    for tag in ("timing_s/param_sync", "timing_s/onload", "timing_s/offload"):
        for i, v in enumerate(run.values(tag)[:n]):
            switch[i] += v
    gen_s = sum(gen[:n]) / n if gen else None
    switch_s = sum(switch) / n
    train_s = sum(step_s) / n - (gen_s or 0.0) - switch_s if gen else None
    return {"generate_s_per_step": gen_s, "train_s_per_step": train_s, "switch_s_per_step": switch_s,
            "update_s_per_step": _mean(run.values("timing_s/update_actor")[:n]),
            "mfu_actor": _mean(run.values("perf/mfu/actor")[:n])}


ROWS = (  # (key, label, format)
    ("devices", "devices (trainer+rollout)", None),
    ("tokens_per_s", "tokens/s (total)", "{:.1f}"),
    ("tokens_per_s_all_steps", "tokens/s (total, every step)", "{:.1f}"),
    ("tokens_per_s_per_device", "tokens/s per device", "{:.1f}"),
    ("time_per_step_s", "time/step (s)", "{:.3f}"),
    ("step_after_update_s", "  the first after a weight update (s)", "{:.3f}"),
    ("step_inside_version_s", "  the others (s)", "{:.3f}"),
    ("step_whole_versions_s", "  over the whole versions timed (s)", "{:.3f}"),
    ("whole_versions", "  whole versions timed", "{:d}"),
    ("generate_s_per_step", "  generating (trainer waits) (s)", "{:.3f}"),
    ("train_s_per_step", "  train (s)", "{:.3f}"),
    ("switch_s_per_step", "  switch / weight push (s)", "{:.3f}"),
    ("update_s_per_step", "  the update alone, in train (s)", "{:.3f}"),
    ("mfu_actor", "perf/mfu/actor (mean)", "{:.3f}"),
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
            "split": split, "workload": workload_of(runs["async"].config),
            "shared_cpu": shared_cpu_note({m: st["devices"] for m, st in stats.items()})}


def shared_cpu_note(devices: dict[str, dict], cores: Optional[int] = None) -> Optional[str]:
    """What a reader must know first about a comparison run on a CPU (None elsewhere): a CPU "device" is a process,
    and both sides of each mode run on the same cores, so async's overlap of generation and training adds no compute
    there and it can read below 1x."""
    if any(d.get("device") != "cpu" for d in devices.values()):
        return None
    cores = cores or os.cpu_count() or 1
    n = max(d["total"] for d in devices.values())
    return (f"CPU comparison: each mode's {n} \"device(s)\" are processes sharing this machine's {cores} core(s), the "
            "rollout and trainer sides included, so async's overlap of generation and training adds no compute here "
            "(both sides compete for the same cores, and it pays the weight pushes on top): async can read below 1x "
            "sync.  Its speedup needs devices each side has to itself (accelerators); read CPU numbers as a check "
            "that both modes run, not as a speedup.")


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
            "python -m fully_async.compare --devices N runs one)",
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
    header = ([table["shared_cpu"]] if table.get("shared_cpu") else []) + device_lines(table) + \
        (format_split(table["split"]) if table["split"] else [])
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


def format_split(split: dict) -> list[str]:
    """The candidate splits as plain-text lines (the chosen one marked)."""
    if not split["candidates"]:
        return [f"async split {split['rollout']}+{split['trainer']}: {split['reason']}"]
    rows = [("rollout", "trainer", "r x R", "capacity(N-r)", "ceiling", "bottleneck", "")]
    rows += [(str(c["rollout"]), str(c["trainer"]), f"{c['rollout_tokens_per_s']:.1f}",
              f"{c['train_tokens_per_s']:.1f}", f"{c['ceiling']:.1f}", c["bottleneck"],
              "<- chosen" if c["rollout"] == split["rollout"] else "")
             for c in split["candidates"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"candidate splits of N={split['devices']} devices (R = {split['rollout_tokens_per_s_per_device']:.1f}, "
             f"T = {split['train_tokens_per_s_per_device']:.1f} tokens/s per device, dp efficiency "
             f"e = {split['dp_efficiency']:g}; capacity(k) = k T e^log2(k)):"]
    lines += ["  " + "  ".join(x.rjust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(f"why: {split['reason']}")
    lines.append(f"sync ceiling on N={split['devices']} (generate and train alternate): 1 / (1/(N R) + 1/capacity(N)) "
                 f"= {split['sync_ceiling']:.1f} tokens/s")
    return lines


def _speedup(value: Optional[float]) -> str:
    return "not reached (by one mode or both)" if value is None else f"{value:.2f}x"
