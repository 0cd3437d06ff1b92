"""Several placements against one sync run: a row each, with the planner's simulation and forward prediction of
every run from the logs (layer 8; compare/simulate.py)."""
from __future__ import annotations

from typing import Any, Optional

from fully_async.compare.runs import CompareError, read_run
from fully_async.compare.simulate import forward_costs, predict
from fully_async.compare.stats import _fmt


def simulated(log_dir: str) -> Optional[dict]:
    """The planner's simulation of a run from its own logs (compare/simulate.py predict: its stage costs, config
    and synthetic lengths), every step as measured; None where it cannot (lengths not logged, no engine timings)."""
    try:
        return predict(read_run(log_dir))
    except (ValueError, CompareError, KeyError):
        return None


def sync_costs(sync_dir: str) -> Optional[Any]:
    """The sync run's stage costs as the planner reads them (compare/simulate.py forward_costs: compiling steps
    left out, dp efficiency 0.9 per doubling), read once per summary; None where they cannot be read."""
    try:
        return forward_costs(read_run(sync_dir), 0.9)
    except (ValueError, CompareError, KeyError):
        return None


def forecast(log_dir: str, costs: Any) -> Optional[dict]:
    """The planner's forward prediction of a run from the sync run's stage costs (`sync_costs`) and the run's own
    first-step compiling (simulate.predict); None where it cannot."""
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
                 "planner's pipeline simulation of each run from its own logs (compare/simulate.py), against its "
                 "every-step tokens/s; predicted: the planner's forward prediction from the sync run's costs and the "
                 "run's own first-step compiling (sim_check.py --costs-from), against its every-step tokens/s too")
    return "\n".join(lines)
