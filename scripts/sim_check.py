"""Does the pipeline simulation reproduce a measured run?  Stage costs from each run's own logs, then the
simulated tokens/s next to the measured one (fully_async/core/pipeline_sim.py).

  python scripts/sim_check.py ASYNC_TB_DIR SYNC_TB_DIR [--json]

Stage costs read from a run's TensorBoard scalars (one run, one mode, its own devices):
  decode_step_s   mean of fully_async/rollouter/engine_<k>/ms_per_step over steps and engines
  train_token_s   async: sum(timing_s/step - timing_s/gen - timing_s/param_sync) x trainer devices / tokens
                  (the trainer's busy time outside the weight push; timing_s/gen is its wait for groups);
                  sync: sum(timing_s/step - timing_s/gen - switch) x devices / tokens
  weight_sync_s   async: mean timing_s/param_sync (the trainer's push; the engines load meanwhile)
  sync_step_s     sync: mean(timing_s/param_sync + onload + offload + reward) (the colocated switch)
  lengths         the run's benchmark.response_length profile (a synthetic workload; with the model's own
                  EOS the lengths were not logged and the check refuses)
  prompt length   mean of prompt_length/mean
The simulation then runs the run's own config (devices, n, groups per step, max_num_seqs, staleness_threshold,
trigger_parameter_sync_step, partial_rollout) for its number of steps; tokens/s is compared with compare_lib's
tokens/s = sum(perf/total_num_tokens) / sum(timing_s/step).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _mean(values: list[float]) -> float:
    if not values:
        raise ValueError("no values")
    return sum(values) / len(values)


def _decode_step_s(run: Any) -> float:
    per_step = [v for tag in run.scalars if tag.startswith("fully_async/rollouter/engine_")
                and tag.endswith("/ms_per_step") for v in run.values(tag) if v > 0]
    if not per_step:
        raise ValueError(f"{run.log_dir}: no fully_async/rollouter/engine_<k>/ms_per_step scalars")
    return _mean(per_step) / 1e3


def _per_step(run: Any, tag: str) -> list[float]:
    values = run.values(tag)
    return values if values else [0.0] * len(run.values("timing_s/step"))


def stage_costs(run: Any) -> Any:
    """StageCosts of one run from its own logs (module docstring)."""
    from fully_async.core.pipeline_sim import StageCosts

    devices = run.devices()
    steps, gens = run.values("timing_s/step"), run.values("timing_s/gen")
    tokens = sum(run.values("perf/total_num_tokens"))
    sync_s = _per_step(run, "timing_s/param_sync")
    if run.mode == "async":
        busy = sum(s - g - p for s, g, p in zip(steps, gens, sync_s))
        return StageCosts(decode_step_s=_decode_step_s(run), train_token_s=busy * devices["trainer"] / tokens,
                          weight_sync_s=_mean(sync_s), source=f"run logs {run.log_dir}")
    switch = [p + a + b + c for p, a, b, c in zip(sync_s, _per_step(run, "timing_s/onload"),
                                                  _per_step(run, "timing_s/offload"), _per_step(run, "timing_s/reward"))]
    busy = sum(s - g - w for s, g, w in zip(steps, gens, switch))
    return StageCosts(decode_step_s=_decode_step_s(run), train_token_s=busy * devices["trainer"] / tokens,
                      sync_step_s=_mean(switch), source=f"run logs {run.log_dir}")


def _workload(run: Any) -> Any:
    from omegaconf import OmegaConf

    from fully_async.core.pipeline_sim import Workload
    from fully_async.core.workload import LengthProfile

    cfg = OmegaConf.create(run.config)
    profile = LengthProfile.from_config(cfg)
    if profile is None or not cfg.benchmark.get("ignore_eos", False):
        raise ValueError(f"{run.log_dir}: the run's response lengths are not known (needs benchmark.response_length "
                         "and benchmark.ignore_eos=true: with the model's own EOS the lengths were not logged)")
    prompt = round(_mean(run.values("prompt_length/mean")))
    return cfg, Workload(n=cfg.actor_rollout_ref.rollout.n, prompt_len=prompt, length=profile.target,
                         steps=len(run.values("timing_s/step")))


def predict(run: Any) -> dict:
    """Simulated tokens/s of the run from its own stage costs, next to the measured one."""
    from compare_lib import tokens_per_s

    from fully_async.core.pipeline_sim import AsyncSetup, simulate_async, simulate_sync
    from fully_async.core.planner import PipelineShape

    costs = stage_costs(run)
    cfg, work = _workload(run)
    shape = PipelineShape.of(cfg)
    d = run.devices()
    if run.mode == "async":
        sim = simulate_async(AsyncSetup(replicas=max(1, d["rollout"] // shape.rollout_tp), trainer_devices=d["trainer"],
                                        max_num_seqs=shape.max_num_seqs, required=shape.async_groups,
                                        staleness_threshold=shape.staleness_threshold,
                                        trigger_parameter_sync_step=shape.trigger,
                                        partial_rollout=shape.partial_rollout), costs, work)
    else:
        sim = simulate_sync(d["trainer"], shape.sync_groups, shape.max_num_seqs, costs, work)
    measured = tokens_per_s(run)
    return {"mode": run.mode, "log_dir": run.log_dir, "devices": d, "costs": costs.as_dict(),
            "predicted": sim.as_dict(), "measured_tokens_per_s": measured,
            "error": sim.tokens_per_s / measured - 1.0}


def main(argv: list[str] | None = None) -> int:
    from compare_lib import read_run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="TensorBoard run dirs (any mode)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = [predict(read_run(d)) for d in args.runs]
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r in out:
            print(f"{r['mode']:5} {r['devices']['trainer']}+{r['devices']['rollout']} devices: measured "
                  f"{r['measured_tokens_per_s']:.1f} tokens/s, simulated {r['predicted']['tokens_per_s']:.1f} "
                  f"({100 * r['error']:+.1f}%)  [{r['log_dir']}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
