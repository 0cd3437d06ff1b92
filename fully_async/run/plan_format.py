"""The text of `python -m fully_async.plan` (layer 7, pure formatting of build_report's dict): memory per role,
the device plan, every mode's predicted throughput per device count, the per-step breakdown (generating / train /
switch) and idle ratios of each mode at the last count, the split search around the best split, the
recommendation (the fastest mode whose memory fits) and the assumptions.  --json prints the dict itself."""
from __future__ import annotations

NEAR_BEST = 6             # splits shown either side of the best one


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(str(x).rjust(w) for x, w in zip(r, widths)).rstrip() for r in rows]


def format_text(report: dict) -> str:
    mem = report["memory"]
    out = [f"model: {report['model']['source']}; {report['model']['params'] / 1e9:.3f}B parameters",
           f"config: mode={report['mode']}"] + \
        ([f"hardware assumed: {report['hardware']['device']} ({report['hardware']['why']})"]
         if report.get("hardware") else []) + \
        ([f"engine slots: actor_rollout_ref.rollout.max_num_seqs=null -> {report['engine_slots']['max_num_seqs']} "
          f"per engine ({report['engine_slots']['why']})"] if report.get("engine_slots") else []) + \
        [f"warning: {w}" for w in report["warnings"]] + ["",
           f"== memory per device ({mem['device']}, {mem['capacity_gib']:g} GiB)"]
    for role in mem["roles"]:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in role["parts_gib"].items())
        out.append(f"  {role['role']}: {role['total_gib']:.2f} GiB -> {role['verdict'].upper()}  ({parts} GiB)")
        out.append(f"    {role['note']}")
    for key in ("sync_alternative", "elastic_alternative"):
        alt = mem.get(key)
        if alt:
            out.append(f"  ({alt['role']}: {alt['total_gib']:.2f} GiB -> {alt['verdict']}; {alt['note']})")
    ckpt = mem.get("checkpointing_not_needed")
    if ckpt:
        out += [f"  gradient checkpointing (actor_rollout_ref.model.enable_gradient_checkpointing=true) is not needed "
                f"for memory here: without it a trainer device peaks at {ckpt['without_gib']:.2f} of "
                f"{ckpt['capacity_gib']:g} GiB ({ckpt['role']})",
                f"    it recomputes each layer's forward in the backward ({ckpt['measured']}); =false trains faster, "
                "with the same results"]
    out += ["", "== device plan"] + ["  " + line for line in report["device_plan"]]
    tp = report["throughput"]
    out += ["", "== predicted throughput (steady tokens/s, all devices; discrete-event simulation)"] + \
        _mode_table(tp["results"])
    for res in tp["results"]:
        if res["best"] is None:
            out.append(f"  {res['devices']} devices: {res['reason']}")
    last = tp["results"][-1]
    out += ["", f"each mode at {last['devices']} devices (per step: generating = the trainer's wait, switch = "
            "engine sleep/wake + trainer onload; idle = share of the run):"] + _step_table(last)
    if last["candidates"]:
        cands = last["candidates"]
        i = cands.index(last["best"])
        shown = cands[max(0, i - NEAR_BEST):i + NEAR_BEST + 1]
        out += ["", f"split async at {last['devices']} devices ({len(shown)} of {len(cands)} splits simulated, "
                "around the best; all in --json):"]
        rows = [("rollout", "trainer", "tokens/s", "trainer idle", "rollout idle", "interrupted")]
        rows += [(c["rollout_devices"], c["trainer_devices"], f"{c['steady_tokens_per_s']:.0f}",
                  f"{c['trainer_idle_ratio']:.2f}", f"{c['rollout_idle_ratio']:.2f}", c["interrupted_responses"])
                 for c in shown]
        out += _table(rows)
    out += ["", "== recommendation"] + _recommendation(report)
    out += ["", "== assumptions"] + [f"  - {a}" for a in tp["assumptions"]]
    if not mem["fits"]:
        out += ["", "REFUSED: a role does not fit its device's memory (see the memory table); lower the micro-batch "
                "/ token budget, enable gradient checkpointing or offload, shard more, or raise parallelism"]
    return "\n".join(out)


def _placement(mode: str, res: dict) -> str:
    m = res["modes"].get(mode)
    if not m:
        return "-"
    if mode in ("split", "elastic"):
        return f"{m['rollout_devices']}+{m['trainer_devices']}"
    return str(res["devices"])


def _mode_table(results: list[dict]) -> list[str]:
    rows = [("devices", "sync", "split (r+t)", "split", "elastic (r+t)", "elastic", "colocated", "best",
             "best/sync")]
    for res in results:
        modes, best = res["modes"], res["recommended"]

        def rate(m: str) -> str:
            return f"{modes[m]['steady_tokens_per_s']:.0f}" if modes.get(m) else "-"
        rows.append((res["devices"], rate("sync"), _placement("split", res), rate("split"),
                     _placement("elastic", res), rate("elastic"), rate("colocated"), best or "-",
                     f"{res['recommended_speedup']:.2f}x" if res.get("recommended_speedup") else "-"))
    return _table(rows)


def _step_table(res: dict) -> list[str]:
    rows = [("mode", "devices (r+t)", "tokens/s", "x sync", "generating s", "train s", "switch s", "trainer idle",
             "rollout idle")]
    sync = res["modes"].get("sync")
    for mode in ("sync", "split", "elastic", "colocated"):
        m = res["modes"].get(mode)
        if not m:
            continue
        rows.append((mode, _placement(mode, res), f"{m['steady_tokens_per_s']:.0f}",
                     f"{m['steady_tokens_per_s'] / sync['steady_tokens_per_s']:.2f}x" if sync else "-",
                     f"{m['generate_s_per_step']:.2f}", f"{m['train_s_per_step']:.2f}", f"{m['switch_s_per_step']:.2f}",
                     f"{m['trainer_idle_ratio']:.2f}", f"{m['rollout_idle_ratio']:.2f}"))
    return _table(rows)


def _recommendation(report: dict) -> list[str]:
    """One line per device count: the fastest mode whose memory fits, every mode's ratio to sync, and a note when
    a faster mode was left out for memory."""
    from fully_async.planner.search import recommend

    fits = report["memory"]["mode_fits"]
    refused = report["memory"].get("mode_refusals", {})
    allowed = {m: fits.get(m, True) and m not in refused for m in set(fits) | set(refused)}
    out = []
    for res in report["throughput"]["results"]:
        mode, speedup = recommend(res, allowed)
        fastest, _ = recommend(res)
        if mode is None:
            out.append(f"  {res['devices']} devices: no mode simulated fits (see memory)")
            continue
        sync = res["modes"].get("sync")
        ratios = ", ".join(f"{m} {_placement(m, res) if m in ('split', 'elastic') else ''}".rstrip() +
                           f" {res['modes'][m]['steady_tokens_per_s'] / sync['steady_tokens_per_s']:.2f}x"
                           for m in ("split", "elastic", "colocated") if res["modes"].get(m) and sync)
        line = f"  {res['devices']} devices: {mode} ({_placement(mode, res)})"
        line += f" predicted {speedup:.2f}x sync's tokens/s" if speedup else ""
        line += f"; {ratios}" if ratios else ""
        if fastest != mode and fastest in refused:
            line += f"; {fastest} would be faster but the run refuses it as configured ({refused[fastest]})"
        elif fastest != mode:
            line += f"; {fastest} would be faster but does not fit as configured (see memory: offload, shard more)"
        if not fits.get("sync", True) and mode != "sync":
            line += "; sync as configured does not fit either (the ratios are to sync as if it fit)"
        out.append(line)
    return out
