"""The planner's simulation of a logged run (layer 8): stage costs from the run's own logs (or forward, from another
run's), then the simulated tokens/s beside the measured one (planner/pipeline_sim.py, colocated_sim.py).
scripts/sim_check.py is its command line; the comparison prints both beside every run (compare/placements.py).

Stage costs read from a run's TensorBoard scalars: planner/stage_costs.py from_run_scalars (engine ms per decode
step, trainer busy seconds per token, weight-update / sync-switch seconds); the response lengths are the run's
benchmark.response_length profile (a synthetic workload; with the model's own EOS the lengths were not logged and
the simulation refuses), the prompt length the mean of prompt_length/mean, the engines' slots the run's own where its
config left max_num_seqs null (engine_<k>/slots: the count the memory model gave it at start-up; a run logged before
that metric is simulated at verl's 256).
"""
from __future__ import annotations

from typing import Any

from fully_async.compare.runs import placement_of
from fully_async.compare.stats import tokens_per_s


def _mean(values: list[float]) -> float:
    if not values:
        raise ValueError("no values")
    return sum(values) / len(values)


def _workload(run: Any) -> Any:
    from omegaconf import OmegaConf

    from fully_async.planner.pipeline_sim import Workload
    from fully_async.core.workload import LengthProfile

    cfg = OmegaConf.create(run.config)
    slots = [v for tag in run.scalars if tag.startswith("fully_async/rollouter/engine_") and tag.endswith("/slots")
             for v in run.values(tag)]
    if cfg.actor_rollout_ref.rollout.get("max_num_seqs") is None and slots:   # null: the slots the run sized, logged
        cfg.actor_rollout_ref.rollout.max_num_seqs = int(max(slots))
    profile = LengthProfile.from_config(cfg)
    if profile is None or not cfg.benchmark.get("ignore_eos", False):
        raise ValueError(f"{run.log_dir}: the run's response lengths are not known (needs benchmark.response_length "
                         "and benchmark.ignore_eos=true: with the model's own EOS the lengths were not logged)")
    prompt = round(_mean(run.values("prompt_length/mean")))
    return cfg, Workload(n=cfg.actor_rollout_ref.rollout.n, prompt_len=prompt, length=profile.target,
                         steps=len(run.values("timing_s/step")))


def _scalars(run: Any) -> dict[str, list[float]]:
    """The run's scalars, one value per trainer step (stage_costs.aligned_scalars)."""
    from fully_async.planner.stage_costs import aligned_scalars

    return aligned_scalars({tag: [(s, v) for s, _, v in run.series(tag)] for tag in run.scalars})


def stage_costs(run: Any, every_step: bool = True) -> Any:
    """StageCosts of one run from its own logs (stage_costs.from_run_scalars): every step kept (the check compares
    with the run's whole average, compiling steps included), or, as the planner reads a run, its compiling steps
    left out."""
    from fully_async.planner.stage_costs import OUTLIER_RATIO, from_run_scalars

    return from_run_scalars(_scalars(run), run.mode, run.devices()["trainer"], source=f"run logs {run.log_dir}",
                            outlier_ratio=None if every_step else OUTLIER_RATIO, placement=placement_of(run.config))


def forward_costs(source: Any, dp_efficiency: float) -> Any:
    """The planner's forward prediction (`python -m fully_async.plan plan.stage_costs=<source run>`): the stage costs
    of another run (a sync run, say), its compiling steps left out as the planner leaves them out.  Its
    per-device-token training cost holds its own data-parallel efficiency, so one device's is that times the
    efficiency assumed at its device count (other counts then scale by `dp_efficiency` per doubling, as the planner
    does); a weight update the source did not push is priced at the source's own engine load
    (timing_s/param_sync/load: the same bytes into the same engines)."""
    from dataclasses import replace

    from fully_async.planner.sim_engine import data_parallel_speedup

    costs = stage_costs(source, every_step=False)
    n = max(1, source.devices()["trainer"])
    loads = [v for v in source.values("timing_s/param_sync/load") if v > 0]
    return replace(costs, dp_efficiency=dp_efficiency,
                   train_token_s=costs.train_token_s * data_parallel_speedup(n, dp_efficiency) / n,
                   weight_sync_s=costs.weight_sync_s or (_mean(loads) if loads else 0.0),
                   source=f"{costs.source}, forward (dp_efficiency {dp_efficiency})")


def first_train_s(run: Any) -> float:
    """What the run's first trainer step cost beyond its steady rate (compiling, first allocations): its trainer
    seconds minus its tokens at the run's own steady per-device-token cost.  The one input a forward prediction
    takes from the run it predicts: at the 0.5B shape on H200 it was 5-8 s (2-GPU colocated, elastic), 15-20 s
    (1-GPU colocated, splits, 4-GPU colocated) and 22-35 s (sync), so no other run's value stands in for it."""
    from fully_async.planner.stage_costs import trainer_busy

    costs = stage_costs(run, every_step=False)
    scalars = _scalars(run)
    busy, _ = trainer_busy(scalars, run.mode)
    tokens = scalars.get("perf/total_num_tokens") or [0.0]
    if not busy:
        return 0.0
    return max(0.0, busy[0] - tokens[0] * costs.train_token_s / max(1, run.devices()["trainer"]))


def predict(run: Any, costs: Any = None, compiling: bool = True) -> dict:
    """Simulated tokens/s of the run from its own stage costs (or `costs`: forward_costs of another run, with the
    run's own first-step compiling unless `compiling` is False: the planner's steady view), next to the measured
    one."""
    from dataclasses import replace

    from fully_async.planner.colocated_sim import simulate_colocated
    from fully_async.planner.pipeline_sim import simulate_async, simulate_sync
    from fully_async.planner.search import PipelineShape

    # forward: the source's steady costs, and this run's own first-step compiling (so the simulation is of the run
    # as it went: a split's engines run ahead while its trainer compiles, and the next steps drain that queue)
    priced = costs is not None and compiling
    if costs is None:
        costs = stage_costs(run)
    elif priced:
        costs = replace(costs, first_train_s=first_train_s(run))
    cfg, work = _workload(run)
    shape = PipelineShape.of(cfg)
    d = run.devices()
    if run.mode == "async" and placement_of(run.config) == "colocated":
        sim = simulate_colocated(d["trainer"], shape.async_setup(d["trainer"], d["trainer"], shape.async_groups),
                                 costs, work)
    elif run.mode == "async":   # split, or elastic: an engine per trainer device group joins while the trainer waits
        elastic = d["trainer"] // shape.rollout_tp if placement_of(run.config) == "elastic" else 0
        sim = simulate_async(shape.async_setup(max(1, d["rollout"] // shape.rollout_tp), d["trainer"],
                                               shape.async_groups, elastic), costs, work)
    else:
        sim = simulate_sync(d["trainer"], shape.sync_groups, shape.max_num_seqs, costs, work)
    measured, steady = tokens_per_s(run), tokens_per_s(run, skip_first=1)
    # the simulated run's steps after its first, beside the measured run's (a steady simulation: every step)
    after = sim.steady_tokens_per_s(1) if priced else sim.tokens_per_s
    return {"mode": run.mode, "log_dir": run.log_dir, "devices": d, "costs": costs.as_dict(),
            "predicted": sim.as_dict(), "measured_tokens_per_s": measured, "measured_after_first_tokens_per_s": steady,
            "predicted_after_first_tokens_per_s": after,
            "error": sim.tokens_per_s / measured - 1.0, "error_after_first": after / steady - 1.0}
