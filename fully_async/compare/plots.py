"""The comparison's PNG plots (layer 8); matplotlib is the `plots` extra, asked for before any run starts."""
from __future__ import annotations

import os
from typing import Any, Optional

from fully_async.compare.runs import CompareError, Run
from fully_async.compare.stats import first_steps_of_versions, samples_per_step, val_points


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


# the first step of each weight version on the time-per-step plot
MARKED = {"linestyle": "none", "marker": "s", "markersize": 8, "markerfacecolor": "none", "color": "tab:red"}


def _step_times(runs: dict[str, Run]) -> dict:
    """Each run's seconds a step, and where an async run's weight version holds several steps, the first step of
    each version marked apart (it waits for groups the staleness bound let start only after the update)."""
    series: dict[str, Any] = {m: _by_step(r, "timing_s/step") for m, r in runs.items()}
    for mode, run in runs.items():
        first, others = first_steps_of_versions(run)
        if first and others:
            times = dict(zip(*series[mode]))
            steps = sorted(s for s in first if s in times)
            series[f"{mode}: first step of a weight version"] = (steps, [times[s] for s in steps], MARKED)
    return series


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
    """One PNG with a panel per (xlabel, ylabel, {label: (xs, ys) or (xs, ys, matplotlib style)})."""
    plt = pyplot()

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (xlabel, ylabel, series) in zip(axes[0], panels):
        for label, (xs, ys, *style) in series.items():
            ax.plot(xs, ys, label=label, **(style[0] if style else
                                            {"marker": "o", "markersize": 3, "color": COLORS.get(label.split()[0])}))
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
        "time_per_step": ("Time per step", [("step", "timing_s/step (s)", _step_times(runs))], None),
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
