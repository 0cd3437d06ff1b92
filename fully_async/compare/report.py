"""The comparison's report.md and the summary of repeated comparisons (layer 8)."""
from __future__ import annotations

import os
from typing import Any, Optional

from fully_async.compare.runs import PLACEMENT_KEYS, Run
from fully_async.compare.stats import _fmt, _speedup, device_lines, format_split, markdown_table


def write_report(out_dir: str, table: dict, runs: dict[str, Run], plots: dict[str, str]) -> str:
    hw = table["hardware"]
    same_hw = len(set(hw.values())) == 1
    lines = ["# Sync vs async comparison", ""]
    lines += [f"> {table['shared_cpu']}", ""] if table.get("shared_cpu") else []
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
                     f" (fully_async.compare.bench), data-parallel efficiency e = {table['dp_efficiency']:g}: async "
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
