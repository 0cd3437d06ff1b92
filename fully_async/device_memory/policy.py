"""What `free_cache_engine` means at each turn switch (layer 0): free the engine's memory, or keep what fits.

verl's `actor_rollout_ref.rollout.free_cache_engine=true` (the default) frees the engine's KV cache and weights for
the trainer at every switch, which memory-bound runs need.  Where the trainer fits beside the resident engine, the
freeing only costs time (the parked responses re-prefilled or swapped, the weights moved).  So the engine's memory
mode is one of:
    keep  free_cache_engine=false: the engine stays resident, its responses wait through the trainer's turn
    free  every switch frees: free_cache_engine_force=true, a device pool shared with other jobs (they need the
          memory; with co-tenancy, placement/leases.py, a job whose memory fits beside theirs has no switch at
          all), a trainer that offloads between turns (its memory comes back at its onload, where a measurement
          taken while it is away cannot see it), or an engine without the measurement (vLLM: its own sleep mode)
    auto  free_cache_engine=true otherwise: keep the engine resident at a switch when the device's free memory,
          measured with the engine resident and the trainer holding what its allocator kept of its largest step,
          leaves `margin` for the trainer to grow (10% of the device, at least 2 GiB); free again as soon as it does
          not.  Before the trainer's first turn its peak is not measured yet: the first switch keeps the engine
          only where the memory model's estimate of that peak (planner/memory_model.py trainer_estimate_bytes,
          20% over, its context added) fits in what is free beside the margin, and frees where there is no
          estimate or it does not fit.  Said once in the log, with the numbers, and at every change.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)

PRIVATE_POOL_MARK = "-colocated-"   # the name of colocated async's own two-holder pool (run/shared_pool.py)
GIB = float(1 << 30)


def engine_memory_mode(cfg: Any) -> tuple[str, str]:
    """(keep | free | auto, why) for the run's engines (module docstring)."""
    r = cfg.actor_rollout_ref.rollout
    if not r.free_cache_engine:
        return "keep", "actor_rollout_ref.rollout.free_cache_engine=false"
    if r.free_cache_engine_force:
        return "free", "actor_rollout_ref.rollout.free_cache_engine_force=true"
    pool = cfg.multi_job.pool
    if pool is not None and PRIVATE_POOL_MARK not in pool:
        also = (" (with multi_job.co_tenancy a lease granted on the job's declared need switches nothing: the engine "
                "stays on while the jobs' memory fits together)" if cfg.multi_job.co_tenancy else "")
        return "free", f"multi_job.pool={pool}: other jobs lease these devices" + also
    off = cfg.actor_rollout_ref.actor.fsdp_config
    if off.param_offload or off.optimizer_offload:
        return "free", "the trainer offloads between turns (actor.fsdp_config.param_offload / optimizer_offload)"
    if r.name != "hf":
        return "free", f"actor_rollout_ref.rollout.name={r.name}: the engine's own sleep mode frees at every switch"
    return "auto", "actor_rollout_ref.rollout.free_cache_engine=true: what fits stays resident"


class KeepWhenFits:
    """The `auto` decision of one engine, switch by switch."""

    def __init__(self, mode: str, margin_fraction: float = 0.1, margin_min_bytes: float = 2 * GIB,
                 label: str = "embedded engine", estimate_bytes: Optional[float] = None):
        if mode not in ("keep", "free", "auto"):
            raise ValueError(f"engine memory mode {mode!r} is not one of ['keep', 'free', 'auto']")
        self.mode, self.label = mode, label
        self.estimate_bytes = estimate_bytes   # the memory model's peak of the other tenant, for its first turn
        self.margin_fraction, self.margin_min_bytes = margin_fraction, margin_min_bytes
        self.measured = False        # the other tenant has had a turn: its allocator holds its peak
        self.last: bool = mode == "keep"
        self.said = False
        self.decisions = {"kept": 0, "freed": 0}

    def other_turn_seen(self) -> None:
        self.measured = True

    def margin(self, total: int) -> float:
        return max(self.margin_min_bytes, self.margin_fraction * total)

    def would_keep(self, free: int, total: int) -> bool:
        """The decision for these numbers, without taking it: resident where the other tenant's need (its measured
        peak, which it already holds; before its first turn the memory model's estimate) leaves the margin free."""
        if self.mode != "auto":
            return self.mode == "keep"
        need = 0.0 if self.measured else self.estimate_bytes
        return need is not None and total > 0 and free >= need + self.margin(total)

    def decide(self, free: int, total: int, engine_bytes: int) -> bool:
        """Keep the engine resident through the other tenant's next turn?  free/total: the device's memory now (the
        engine resident); engine_bytes: what it would give back."""
        keep = self.would_keep(free, total)
        if self.mode == "auto" and (keep != self.last or not self.said):
            self._say(keep, free, total, engine_bytes)
        self.last = keep
        self.decisions["kept" if keep else "freed"] += 1
        return keep

    def _say(self, keep: bool, free: int, total: int, engine_bytes: int) -> None:
        numbers = (f"{engine_bytes / GIB:.2f} GiB of engine memory; the device has {free / GIB:.1f} of "
                   f"{total / GIB:.1f} GiB free beside both tenants, margin {self.margin(total) / GIB:.1f} GiB")
        if keep:
            basis = ("" if self.measured else f" (its first turn: the memory model's estimate of its peak, "
                     f"{self.estimate_bytes / GIB:.1f} GiB, fits in what is free beside the margin)")
            logger.info("%s: free_cache_engine=true, but the trainer fits beside the resident engine%s: it keeps its "
                        "%s (actor_rollout_ref.rollout.free_cache_engine_force=true frees it anyway)", self.label,
                        basis, numbers)
            self.said = True
        elif self.measured:
            logger.info("%s: free_cache_engine=true: the engine frees its memory at each switch (%s)", self.label,
                        numbers)
            self.said = True
        elif self.estimate_bytes is not None:
            logger.info("%s: free_cache_engine=true: the memory model's estimate of the trainer's peak (%.1f GiB) "
                        "does not fit beside the resident engine (%s): the first switch frees, and the trainer's "
                        "measured peak decides the next ones", self.label, self.estimate_bytes / GIB, numbers)
        # (without an estimate nothing is said before the first measurement: the first switch frees)


def out_of_memory_advice(cfg: Any) -> str:
    """What to change when the trainer runs out of device memory in its update: first what the engine's memory mode
    kept beside it on the same devices (sync, colocated and elastic async), then the trainer's own levers."""
    actor = cfg.actor_rollout_ref.actor
    shares = cfg.mode == "sync" or cfg.async_training.placement in ("colocated", "elastic")
    lead = ""
    if shares:
        mode, _ = engine_memory_mode(cfg)
        if mode == "keep":
            lead = ("the engine kept its weights and KV cache on the devices through the trainer's turn "
                    "(actor_rollout_ref.rollout.free_cache_engine=false): set it to true to free them; ")
        elif mode == "auto":
            lead = ("with actor_rollout_ref.rollout.free_cache_engine=true the engine stays resident where the trainer "
                    "fits beside it (the memory model's estimate of the trainer's peak at the first switch, the "
                    "measured peak after, 10% of the device kept free): set "
                    "actor_rollout_ref.rollout.free_cache_engine_force=true to free it at every turn; ")
    tokens = ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu" if actor.use_dynamic_bsz else
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    return (lead + f"or make the update smaller: a lower {tokens}, "
            "actor_rollout_ref.model.enable_gradient_checkpointing=true, or the optimizer/parameters offloaded "
            "(actor_rollout_ref.actor.fsdp_config.optimizer_offload / param_offload); `python -m fully_async.plan` "
            "estimates each role's memory for a config")
