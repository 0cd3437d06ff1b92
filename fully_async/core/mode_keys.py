"""Keys that act only in some run modes (layer 0): each named once, in a mode where it does nothing.

Why: a verl key we honour can still do nothing in one of our modes -- sync mode generates exactly
data.train_batch_size prompts per step on the current weights, so the staleness knobs of async mode have nothing to
bound; async mode on dedicated devices has no phase in which an engine sleeps.  Setting such a key there changed
nothing without a word.  MODE_ONLY lists every key of the schema that acts in some modes only (read from the loops
that use them: actors/sync_loop.py, actors/rollouter.py, actors/trainer.py, weight_sync/, placement/residency.py), with
where it acts; `inert_keys` names the ones set away from their default in a mode where they do nothing, and
config_checks warns once per key.  tests/unit/verl/test_mode_keys.py walks verl's documented-honoured keys in every
mode against this table.

Modes: "sync" (mode=sync), "async" (mode=async on its own devices), "pool" (either mode on a shared device pool,
multi_job.pool).  data.train_batch_size and fsdp_config.*_offload are checked by config_checks itself (their
warnings depend on the strategy and the step size), so they are listed with `checked_elsewhere`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SYNC, ASYNC, POOL = "sync", "async", "pool"
NO_BOUND = ("sync mode generates exactly data.train_batch_size prompts per step on the current weights and pushes "
            "after every step: there is no staleness to bound")


@dataclass(frozen=True)
class ModeOnly:
    acts_in: tuple[str, ...]        # the modes where the key acts (a pool job also counts as its own mode)
    why: str                        # what does the job instead in the other modes
    checked_elsewhere: bool = False  # config_checks warns with a message of its own
    on_pool_too: bool = True         # a pool job of a mode in `acts_in` acts on it as well


MODE_ONLY: dict[str, ModeOnly] = {
    "async_training.staleness_threshold": ModeOnly((ASYNC,), NO_BOUND),
    "async_training.trigger_parameter_sync_step": ModeOnly((ASYNC,), NO_BOUND),
    "async_training.require_batches": ModeOnly((ASYNC,), "a sync step is data.train_batch_size prompts"),
    "async_training.partial_rollout": ModeOnly((ASYNC,), "sync mode generates every response to its end on "
                                               "one version's weights: nothing is interrupted"),
    "rollout.nnodes": ModeOnly((ASYNC,), "sync mode runs one engine on every trainer device "
                               "(trainer.nnodes x trainer.n_gpus_per_node)"),
    "rollout.n_gpus_per_node": ModeOnly((ASYNC,), "sync mode runs one engine on every trainer device "
                                        "(trainer.nnodes x trainer.n_gpus_per_node)"),
    "rollout.total_epochs": ModeOnly((ASYNC,), "it bounds the fully-async rollouter's data iterator; sync mode's "
                                     "run length is trainer.total_epochs / rollout.total_rollout_steps"),
    "rollout.test_freq": ModeOnly((ASYNC,), "sync mode validates every trainer.test_freq steps"),
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": ModeOnly(
        (ASYNC,), "sync mode loads each rank's weights into its own engine in process, and a pool job's weights go "
        "through the object store (no broadcast buckets)", on_pool_too=False),
    "actor_rollout_ref.rollout.weight_sync": ModeOnly(
        (ASYNC,), "sync mode loads each rank's own gathered weights into the engine in its process (no transport)"),
    "actor_rollout_ref.rollout.pause_mode": ModeOnly(
        (ASYNC,), "sync mode updates weights between phases, with nothing in flight"),
    "actor_rollout_ref.rollout.free_cache_engine": ModeOnly(
        (SYNC, POOL), "async engines on their own devices never sleep (nothing else needs their memory)"),
    "actor_rollout_ref.rollout.free_cache_engine_force": ModeOnly(
        (SYNC, POOL), "async engines on their own devices never sleep (nothing else needs their memory)"),
    "data.train_batch_size": ModeOnly((SYNC,), "a trainer step is ppo_mini_batch_size x require_batches",
                                      checked_elsewhere=True),
    "actor_rollout_ref.actor.fsdp_config.param_offload": ModeOnly(
        (SYNC, POOL), "nothing offloads between phases", checked_elsewhere=True),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": ModeOnly(
        (SYNC, POOL), "nothing offloads between phases", checked_elsewhere=True),
}


def run_mode(cfg: Any) -> str:
    """sync | async | pool (a job of either mode on a shared device pool)."""
    return POOL if cfg.multi_job.pool is not None else str(cfg.mode)


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _default(key: str) -> Any:
    from fully_async.core.config import FullyAsyncConfig

    return _get(FullyAsyncConfig(), key)


def acts(rule: ModeOnly, mode: str, on_pool: bool) -> bool:
    """Whether a MODE_ONLY key acts in a job of `mode` (sync|async), on a shared pool or not."""
    if on_pool:
        return POOL in rule.acts_in or (rule.on_pool_too and mode in rule.acts_in)
    return mode in rule.acts_in


def inert_keys(cfg: Any) -> list[tuple[str, Any, str]]:
    """(key, value, why) of every MODE_ONLY key (not checked elsewhere) set away from its schema default in a mode
    where it does nothing.  A pool job is also its own mode: keys of its mode that act there too are not named."""
    out = []
    # colocated async runs on a private pool of the trainer's devices (engines and trainer take turns, as on a pool)
    on_pool = cfg.multi_job.pool is not None or (cfg.mode == ASYNC and cfg.async_training.placement == "colocated")
    for key, rule in MODE_ONLY.items():
        if rule.checked_elsewhere or acts(rule, str(cfg.mode), on_pool):
            continue
        value = _get(cfg, key)
        if value != _default(key):
            out.append((key, value, rule.why))
    return out
