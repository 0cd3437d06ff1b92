"""Async-vs-sync throughput at a device count: every rollout/trainer split simulated, the best one chosen
(layer 1, pure).  The simulation is planner/pipeline_sim.py; this module picks the candidates and scales the
batch.

Candidates.  Rollout devices r come in whole replicas (multiples of rollout.tensor_model_parallel_size),
trainer devices N - r in whole model-parallel groups (megatron tp x pp); up to 16 evenly spaced splits are
simulated, then the interval around the best of them is narrowed (up to 4 more per round) until the best
split's simulated neighbours are adjacent valid splits.  Every simulation draws the same responses (the
lengths are a function of the sample id), so they are computed once.

Batch at another scale (`batch_scaling`).  weak (default): the groups per step grow with the device count
(groups x N / N_config, never below the config's), as users scale a recipe to more devices; fixed: the
config's batch at every N (more devices then mostly idle).

Rate.  Candidates are ranked by their steady rate: tokens/s of the steps after the first `warmup_steps` (the
pipeline fill, when async waits for its first batch's longest response, is left out: it is paid once per run).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fully_async.planner.pipeline_sim import AsyncSetup, StageCosts, Workload, simulate_async, simulate_sync

MAX_COARSE = 16


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

    @classmethod
    def of(cls, cfg: Any) -> "PipelineShape":
        actor, rollout, at = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.async_training
        mp = actor.megatron.tensor_model_parallel_size * actor.megatron.pipeline_model_parallel_size \
            if actor.strategy == "megatron" else 1
        trainer = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
        total = trainer + (cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node if cfg.mode == "async" else 0)
        return cls(n=rollout.n, async_groups=actor.ppo_mini_batch_size * at.require_batches,
                   sync_groups=cfg.data.train_batch_size, max_num_seqs=rollout.max_num_seqs,
                   rollout_tp=rollout.tensor_model_parallel_size, trainer_mp=mp,
                   staleness_threshold=at.staleness_threshold, trigger=at.trigger_parameter_sync_step,
                   partial_rollout=at.partial_rollout, config_devices=total)

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


def plan_devices(devices: int, shape: PipelineShape, costs: StageCosts, length: Callable[[str], int],
                 prompt_len: int, steps: int, scaling: str = "weak", warmup_steps: int = 2) -> dict:
    """Sync on all `devices` and async at every candidate split; the best split and the speedup."""
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
                           "async_groups_per_step": async_groups, "candidates": []}
    if devices % shape.trainer_mp == 0:
        out["sync"] = simulate_sync(devices, sync_groups, shape.max_num_seqs, costs, work).as_dict(warmup_steps)
    else:
        out["sync"] = None
    if not valid:
        out.update(best=None, speedup=None, reason=f"no async split of {devices} devices: rollout devices must be "
                   f"a multiple of {shape.rollout_tp}, trainer devices of {shape.trainer_mp}")
        return out
    results: dict[int, dict] = {}

    def run(r: int) -> None:
        if r in results:
            return
        setup = AsyncSetup(replicas=r // shape.rollout_tp, trainer_devices=devices - r,
                           max_num_seqs=shape.max_num_seqs, required=async_groups,
                           staleness_threshold=shape.staleness_threshold, trigger_parameter_sync_step=shape.trigger,
                           partial_rollout=shape.partial_rollout)
        res = simulate_async(setup, costs, work).as_dict(warmup_steps)
        res.update(rollout_devices=r, trainer_devices=devices - r)
        results[r] = res

    for r in _candidates(valid):
        run(r)
    while True:  # narrow down between the best candidate's simulated neighbours until they are adjacent splits
        done = sorted(results)
        k = done.index(max(done, key=lambda r: results[r]["steady_tokens_per_s"]))
        lo = valid.index(done[k - 1]) if k > 0 else valid.index(done[k])
        hi = valid.index(done[k + 1]) if k + 1 < len(done) else valid.index(done[k])
        todo = [valid[j] for j in range(lo, hi + 1) if valid[j] not in results]
        if not todo:
            break
        for r in todo[::max(1, -(-len(todo) // 4))]:
            run(r)
    out["candidates"] = [results[r] for r in sorted(results)]
    best = max(out["candidates"], key=lambda c: c["steady_tokens_per_s"])
    out["best"] = best
    out["speedup"] = best["steady_tokens_per_s"] / out["sync"]["steady_tokens_per_s"] if out["sync"] else None
    return out
