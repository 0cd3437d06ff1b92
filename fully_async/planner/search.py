"""Async-vs-sync throughput at a device count: every rollout/trainer split simulated, the best one chosen
(layer 1, pure).  The simulation is planner/pipeline_sim.py; this module picks the candidates and scales the
batch.

Candidates.  Rollout devices r come in whole replicas (multiples of rollout.tensor_model_parallel_size),
trainer devices N - r in whole model-parallel groups (megatron tp x pp); up to 16 evenly spaced splits are
simulated, then the interval around the best of them is narrowed (up to 4 more per round) until the best
split's simulated neighbours are adjacent valid splits; a tie goes to fewer rollout devices.  `choose_split` runs the
same search with each split priced by its ceiling, for the comparison, which measures one device's rollout-only and
train-only tokens/s instead of the stage costs.  Every simulation draws the same responses (the
lengths are a function of the sample id), so they are computed once.

Batch at another scale (`batch_scaling`).  weak (default): the groups per step grow with the device count
(groups x N / N_config, never below the config's), as users scale a recipe to more devices; fixed: the
config's batch at every N (more devices then mostly idle).

Modes.  At each device count N: sync on all N; split async at its best rollout/trainer split; elastic at its best
split (each trainer device group of rollout.tensor_model_parallel_size also hosts an engine replica that generates
while the trainer waits; pipeline_sim.py); colocated async on all N (colocated_sim.py; one engine per device, as
sync).  `recommend` picks the fastest by the steady rate among the modes allowed (plan_cli passes the memory
verdicts: colocated and elastic put an engine next to a trainer rank, like sync).

Rate.  Candidates are ranked by their steady rate: tokens/s of the steps after the first `warmup_steps` (the
pipeline fill, when async waits for its first batch's longest response, is left out: it is paid once per run).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from fully_async.core.config import num_seqs
from fully_async.planner.colocated_sim import simulate_colocated
from fully_async.planner.pipeline_sim import AsyncSetup, StageCosts, Workload, simulate_async, simulate_sync
from fully_async.planner.sim_engine import data_parallel_speedup

MAX_COARSE = 16
TIE = 1e-9                 # relative: rates closer than this are a tie (fewer rollout devices wins)
MODES = ("sync", "split", "elastic", "colocated")


@dataclass(frozen=True)
class PipelineShape:
    """What the simulation needs from the config (PipelineShape.of)."""

    n: int
    async_groups: int               # ppo_mini_batch_size x require_batches
    sync_groups: int                # data.train_batch_size
    max_num_seqs: int
    rollout_tp: int
    trainer_mp: int                 # megatron tp x pp (1 otherwise)
    staleness_threshold: float
    trigger: int
    partial_rollout: bool
    config_devices: int             # total devices of the config as given (the batch's reference scale)
    pause_mode: str = "abort"       # rollout.pause_mode
    holds_in_flight: bool = True    # colocated: what is in flight stays through a turn switch (AsyncSetup)

    @classmethod
    def of(cls, cfg: Any) -> "PipelineShape":
        actor, rollout, at = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.async_training
        mp = actor.megatron.tensor_model_parallel_size * actor.megatron.pipeline_model_parallel_size \
            if actor.strategy == "megatron" else 1
        trainer = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
        total = trainer + (cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node if cfg.mode == "async" else 0)
        return cls(n=rollout.n, async_groups=actor.ppo_mini_batch_size * at.require_batches,
                   sync_groups=cfg.data.train_batch_size, max_num_seqs=num_seqs(rollout),
                   rollout_tp=rollout.tensor_model_parallel_size, trainer_mp=mp,
                   staleness_threshold=at.staleness_threshold, trigger=at.trigger_parameter_sync_step,
                   partial_rollout=at.partial_rollout, config_devices=total, pause_mode=rollout.pause_mode,
                   holds_in_flight=rollout.name == "hf" or not rollout.free_cache_engine)

    def async_setup(self, replicas: int, trainer_devices: int, required: int, elastic_replicas: int = 0) -> AsyncSetup:
        """The simulation's AsyncSetup of this config at `replicas` engine replicas and `trainer_devices`: the
        embedded engine swaps what is in flight out and back at a turn switch (rollout/engines/engine_memory.py),
        other engines keep it only while resident (free_cache_engine=false); parked otherwise."""
        return AsyncSetup(replicas=replicas, trainer_devices=trainer_devices, max_num_seqs=self.max_num_seqs,
                          required=required, staleness_threshold=self.staleness_threshold,
                          trigger_parameter_sync_step=self.trigger, partial_rollout=self.partial_rollout,
                          elastic_replicas=elastic_replicas, pause_mode=self.pause_mode,
                          holds_in_flight=self.holds_in_flight)

    def groups(self, groups: int, devices: int, scaling: str) -> int:
        if scaling == "fixed":
            return groups
        return max(groups, round(groups * devices / self.config_devices))


def valid_splits(devices: int, shape: PipelineShape) -> list[int]:
    return [r for r in range(shape.rollout_tp, devices, shape.rollout_tp) if (devices - r) % shape.trainer_mp == 0]


def _candidates(valid: list[int]) -> list[int]:
    if len(valid) <= MAX_COARSE:
        return list(valid)
    step = len(valid) / MAX_COARSE
    return sorted({valid[int(i * step)] for i in range(MAX_COARSE)} | {valid[-1]})


def _best_split(valid: list[int], simulate: Callable[[int], dict]) -> tuple[list[dict], dict]:
    """(every simulated candidate by rollout devices, the best): a coarse grid of `valid`, then narrowed between
    the best candidate's simulated neighbours until they are adjacent valid splits."""
    results: dict[int, dict] = {}

    def run(r: int) -> None:
        if r not in results:
            results[r] = simulate(r)

    for r in _candidates(valid):
        run(r)
    def top(rs: list[int]) -> int:   # the fastest; a tie (within rounding) goes to fewer rollout devices
        rate = max(results[r]["steady_tokens_per_s"] for r in rs)
        return next(r for r in rs if results[r]["steady_tokens_per_s"] >= rate * (1 - TIE))

    while True:
        done = sorted(results)
        k = done.index(top(done))
        lo = valid.index(done[k - 1]) if k > 0 else valid.index(done[k])
        hi = valid.index(done[k + 1]) if k + 1 < len(done) else valid.index(done[k])
        todo = [valid[j] for j in range(lo, hi + 1) if valid[j] not in results]
        if not todo:
            break
        for r in todo[::max(1, -(-len(todo) // 4))]:
            run(r)
    candidates = [results[r] for r in sorted(results)]
    return candidates, results[top(sorted(results))]


def recommend(result: dict, allowed: Optional[dict[str, bool]] = None) -> tuple[Optional[str], Optional[float]]:
    """(the fastest mode of a plan_devices result by the steady rate, its rate / sync's) among the modes simulated
    and allowed (mode -> bool; a mode left out is allowed); (None, None) when none is."""
    allowed = allowed or {}
    rates = {m: result["modes"][m]["steady_tokens_per_s"] for m in MODES
             if result["modes"].get(m) and allowed.get(m, True)}
    if not rates:
        return None, None
    best = max(rates, key=lambda m: rates[m])
    sync = result["modes"].get("sync")
    return best, rates[best] / sync["steady_tokens_per_s"] if sync else None


def plan_devices(devices: int, shape: PipelineShape, costs: StageCosts, length: Callable[[str], int],
                 prompt_len: int, steps: int, scaling: str = "weak", warmup_steps: int = 2) -> dict:
    """Sync, colocated on all `devices`, split and elastic async at every candidate split; each mode's best, the
    split's speedup (best / sync) and the recommended mode (module docstring)."""
    valid = valid_splits(devices, shape)
    cache: dict[str, int] = {}

    def length(sample_id: str, draw: Callable[[str], int] = length) -> int:
        if sample_id not in cache:
            cache[sample_id] = draw(sample_id)
        return cache[sample_id]

    sync_groups = shape.groups(shape.sync_groups, devices, scaling)
    async_groups = shape.groups(shape.async_groups, devices, scaling)
    work = Workload(shape.n, prompt_len, length, steps)
    out: dict[str, Any] = {"devices": devices, "sync_groups_per_step": sync_groups,
                           "async_groups_per_step": async_groups, "candidates": [], "elastic_candidates": []}

    def setup(r: int, elastic: int = 0) -> AsyncSetup:
        return shape.async_setup(max(1, r // shape.rollout_tp), devices - r, async_groups, elastic)

    def split(r: int, elastic: bool = False) -> dict:
        engines = (devices - r) // shape.rollout_tp if elastic else 0
        res = simulate_async(setup(r, engines), costs, work).as_dict(warmup_steps)
        res.update(rollout_devices=r, trainer_devices=devices - r, trainer_engines=engines)
        return res

    colocatable = devices % shape.trainer_mp == 0
    out["sync"] = simulate_sync(devices, sync_groups, shape.max_num_seqs, costs, work).as_dict(warmup_steps) \
        if colocatable else None
    out["colocated"] = simulate_colocated(devices, setup(0), costs, work).as_dict(warmup_steps) \
        if colocatable else None
    if valid:
        out["candidates"], out["best"] = _best_split(valid, split)
        elastic_valid = [r for r in valid if (devices - r) // shape.rollout_tp >= 1]
        if elastic_valid:
            out["elastic_candidates"], out["elastic"] = _best_split(elastic_valid, lambda r: split(r, True))
        else:
            out["elastic"] = None
        out["speedup"] = out["best"]["steady_tokens_per_s"] / out["sync"]["steady_tokens_per_s"] if out["sync"] \
            else None
    else:
        out.update(best=None, elastic=None, speedup=None,
                   reason=f"no async split of {devices} devices: rollout devices must be a multiple of "
                   f"{shape.rollout_tp}, trainer devices of {shape.trainer_mp}")
    out["modes"] = {"sync": out["sync"], "split": out["best"], "elastic": out["elastic"], "colocated": out["colocated"]}
    out["recommended"], out["recommended_speedup"] = recommend(out)
    return out


# ----------------------------------------------------------------------------------- from one device's R and T
def train_capacity(devices: int, train_tps: float, dp_efficiency: float = 1.0) -> float:
    """Train-only tokens/s of `devices` data-parallel trainer devices (e kept per doubling: data_parallel_speedup)."""
    return train_tps * data_parallel_speedup(devices, dp_efficiency)


def async_ceiling(rollout: int, trainer: int, rollout_tps: float, train_tps: float,
                  dp_efficiency: float = 1.0) -> float:
    """Best tokens/s of a split async run on `rollout` + `trainer` devices: the slower stage (they overlap)."""
    return min(rollout * rollout_tps, train_capacity(trainer, train_tps, dp_efficiency))


def sync_ceiling(devices: int, rollout_tps: float, train_tps: float, dp_efficiency: float = 1.0) -> float:
    """Best tokens/s of the sync loop on `devices` devices: generate and train alternate on all of them."""
    return 1.0 / (1.0 / (devices * rollout_tps) + 1.0 / train_capacity(devices, train_tps, dp_efficiency))


def choose_split(devices: int, rollout_tps: Optional[float], train_tps: Optional[float],
                 dp_efficiency: float = 1.0, force: Optional[int] = None, forced_by: Optional[str] = None) -> dict:
    """The async rollout/trainer split of `devices` devices when only one device's rollout-only (R) and train-only
    (T) tokens/s are measured (the comparison's bench): the same search as `plan_devices` (`_best_split`, ties to
    fewer rollout devices), each split priced by its ceiling min(r R, capacity(N - r)) instead of a simulation.

    rollout_tps/train_tps None: not measured, then `force` must be given and no ceiling is predicted.  force: use
    this rollout device count (--split), still reporting the candidates; forced_by: how the report names where
    `force` came from (default "forced by --split <force>").  Returns {"devices", "rollout", "trainer", "forced",
    "reason", "candidates": [{rollout, trainer, rollout_tokens_per_s, train_tokens_per_s, ceiling, bottleneck}],
    "best", "ceiling", "sync_ceiling", ...}.  Raises ValueError naming the flag."""
    if devices < 2:
        raise ValueError(f"--devices {devices}: async needs at least 2 devices (one rollout, one trainer)")
    if force is not None and not 1 <= force <= devices - 1:
        raise ValueError(f"--split {force} must be in 1..{devices - 1} (rollout devices of --devices {devices}; "
                         "the rest train)")
    if not 0.0 < dp_efficiency <= 1.0:
        raise ValueError(f"--dp-efficiency {dp_efficiency} must be in (0, 1]")
    out: dict[str, Any] = {"devices": devices, "rollout_tokens_per_s_per_device": rollout_tps,
                           "train_tokens_per_s_per_device": train_tps, "dp_efficiency": dp_efficiency,
                           "forced": force is not None, "candidates": [], "best": None, "ceiling": None,
                           "sync_ceiling": None}
    forced_by = forced_by or f"forced by --split {force}"
    if not rollout_tps or not train_tps:
        if force is None:
            raise ValueError("choosing the split needs the measured rollout-only and train-only tokens/s "
                             "(--bench); or pass --split R")
        out.update(rollout=force, trainer=devices - force, reason=f"{forced_by} (no bench: ceilings not predicted)")
        return out

    def ceiling(r: int) -> dict:
        roll, train = r * rollout_tps, train_capacity(devices - r, train_tps, dp_efficiency)
        return {"rollout": r, "trainer": devices - r, "rollout_tokens_per_s": roll, "train_tokens_per_s": train,
                "ceiling": min(roll, train), "steady_tokens_per_s": min(roll, train),
                "bottleneck": "rollout" if roll <= train else "train"}

    valid = list(range(1, devices))
    out["candidates"], best = _best_split(valid, ceiling)
    if force is not None and all(c["rollout"] != force for c in out["candidates"]):
        out["candidates"] = sorted(out["candidates"] + [ceiling(force)], key=lambda c: c["rollout"])
    tied = [c for c in out["candidates"] if c["ceiling"] >= best["ceiling"] * (1 - TIE) and c is not best]
    chosen = best if force is None else next(c for c in out["candidates"] if c["rollout"] == force)
    out.update(rollout=chosen["rollout"], trainer=chosen["trainer"], best=best["rollout"], ceiling=chosen["ceiling"],
               sync_ceiling=sync_ceiling(devices, rollout_tps, train_tps, dp_efficiency))
    why = (f"r={best['rollout']} maximises min(r x R, train capacity(N - r)) = "
           f"{best['ceiling']:.1f} tokens/s over r in 1..{devices - 1}")
    if tied:
        why += f" (tied with r={', '.join(str(c['rollout']) for c in tied)}: fewer rollout devices wins)"
    if force is not None:
        why = f"{forced_by}: predicted {chosen['ceiling']:.1f} tokens/s; the best split: {why}"
    out["reason"] = why
    return out
