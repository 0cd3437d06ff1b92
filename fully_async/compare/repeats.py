"""One report of a repeated comparison (layer 8): every row of the side-by-side table as the mean and the spread of
its values over the repeats (each repeat: both modes on the same workload, alternating which goes first), and the
headline figures plotted with error bars.

Spread: the sample standard deviation (n - 1) and the min..max of the values; with one value the deviation is 0.
The repeats' own tables and reports stay in DIR/repeat_<i>/.
"""
from __future__ import annotations

import os
import statistics
from typing import Optional

from fully_async.compare.report import format_repeats
from fully_async.compare.stats import ROWS, _fmt

MODES = ("async", "sync")
PLOTTED = (("tokens_per_s", "tokens/s (total)"), ("time_per_step_s", "time/step (s)"),
           ("samples_per_s", "samples/s"))


def spread(values: list[float]) -> dict:
    """mean, std (n - 1; 0 for one value), min, max and n of `values`."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def combine(tables: list[dict]) -> dict:
    """{"rows": {key: {mode: spread}}, "ratio": {key: spread of async/sync}, "speedup": spread of tokens/s async/sync}
    over the repeats' tables; a row a repeat has no number for (None) is combined over the repeats that have one."""
    rows: dict[str, dict] = {}
    ratio: dict[str, dict] = {}
    for key, _, fmt in ROWS:
        if not fmt or key == "devices":
            continue
        per_mode = {m: [t["modes"][m][key] for t in tables if isinstance(t["modes"][m].get(key), (int, float))]
                    for m in MODES}
        if any(per_mode.values()):
            rows[key] = {m: spread(v) if v else None for m, v in per_mode.items()}
        ratios = [t["ratio_async_over_sync"][key] for t in tables if t["ratio_async_over_sync"].get(key) is not None]
        if ratios:
            ratio[key] = spread(ratios)
    speedups = [t["speedup"]["tokens_per_s"] for t in tables if t["speedup"].get("tokens_per_s") is not None]
    return {"repeats": len(tables), "rows": rows, "ratio": ratio, "speedup": spread(speedups) if speedups else None}


def _cell(s: Optional[dict], fmt: str) -> str:
    if s is None:
        return "-"
    if fmt == "{:d}":
        fmt = "{:.1f}"
    return f"{fmt.format(s['mean'])} ± {fmt.format(s['std'])} ({fmt.format(s['min'])}..{fmt.format(s['max'])})"


def markdown_rows(combined: dict, threshold: float) -> list[str]:
    out = ["| metric | async | sync | async/sync |", "| --- | ---: | ---: | ---: |"]
    for key, label, fmt in ROWS:
        if key not in combined["rows"]:
            continue
        r = combined["rows"][key]
        out.append(f"| {label.format(thr=f'{threshold:g}')} | {_cell(r['async'], fmt)} | {_cell(r['sync'], fmt)} | "
                   f"{_cell(combined['ratio'].get(key), '{:.3f}')} |")
    return out


def plot(combined: dict, out_dir: str, name: str = "repeats.png") -> str:
    """The headline rows per mode as bars of the mean with the standard deviation as error bars, and the speedup."""
    from fully_async.compare.plots import COLORS, pyplot

    plt = pyplot()
    panels = [(key, label) for key, label in PLOTTED if key in combined["rows"]]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4 * (len(panels) + 1), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        stats = [combined["rows"][key][m] for m in MODES]
        xs = [i for i, s in enumerate(stats) if s]
        ax.bar([MODES[i] for i in xs], [stats[i]["mean"] for i in xs], yerr=[stats[i]["std"] for i in xs],
               capsize=6, color=[COLORS[MODES[i]] for i in xs])
        ax.set_title(label)
        ax.grid(alpha=0.3, axis="y")
    ax = axes[0][-1]
    if combined["speedup"]:
        sp = combined["speedup"]
        ax.bar(["async/sync"], [sp["mean"]], yerr=[sp["std"]], capsize=6, color="tab:green")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_title("speedup (tokens/s)")
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Mean and standard deviation over {combined['repeats']} repeats")
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return name


def write_report(out_dir: str, tables: list[dict], summary: dict, repeat_dirs: list[str]) -> str:
    """DIR/report.md of a repeated comparison (module docstring); returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    combined = combine(tables)
    first = tables[0]
    lines = [f"# Sync vs async comparison: {combined['repeats']} repeats", ""]
    lines += [f"> {first['shared_cpu']}", ""] if first.get("shared_cpu") else []
    sp = combined["speedup"]
    if sp:
        lines.append(f"Speedup async/sync in tokens/s: **{sp['mean']:.2f}x ± {sp['std']:.2f}** (mean ± standard "
                     f"deviation; {sp['min']:.2f}x..{sp['max']:.2f}x over {sp['n']} repeats).")
    hw = first["hardware"]
    lines += [f"Hardware: {hw['async']}" if len(set(hw.values())) == 1 else
              f"Hardware DIFFERS: async on {hw['async']}, sync on {hw['sync']}",
              f"- async: {_fmt(first['modes']['async']['devices'], None)}; sync: "
              f"{_fmt(first['modes']['sync']['devices'], None)} (trainer+rollout devices)"]
    lines += [f"- {first['workload']['description']}"] if first["workload"] else []
    lines += ["", "## Results (mean ± std (min..max) over the repeats)", "", *markdown_rows(combined,
                                                                                          first["threshold"]), ""]
    lines += ["```text", format_repeats(summary), "```", ""]
    lines += ["## Plots", "", f"![repeats]({plot(combined, out_dir)})", "", "## Each repeat", ""]
    lines += [f"- [{os.path.relpath(d, out_dir)}]({os.path.relpath(os.path.join(d, 'report.md'), out_dir)})"
              for d in repeat_dirs]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path
