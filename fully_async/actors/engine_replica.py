"""Engine replica actors (layer 6): async mode's K rollout engines, each a Ray actor on its own device(s).

The engine side (EngineHost: driver thread, submit/poll/engine_call) lives in rollout/engines/replica.py;
this is the thin actor around it, and the function that builds async mode's pool from them."""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from fully_async.core.config import FullyAsyncConfig, num_seqs
from fully_async.rollout.engines.replica import EngineHost

logger = logging.getLogger(__name__)


class EngineReplica(EngineHost):
    """Ray actor: one rollout engine on its own device(s) (async mode, more than one replica)."""

    def __init__(self, cfg: FullyAsyncConfig, index: int, eos_token_ids: list[int], pad_token_id: int):
        from fully_async.actors.actor_setup import actor_init
        from fully_async.rollout.engines import build_engine

        cfg, device = actor_init(cfg, f"engine{index}")
        self._host_engine(build_engine(cfg, device, eos_token_ids, pad_token_id, replica=index), device,
                          f"engine{index}")

    def ready(self) -> bool:
        return True


def build_async_pool(cfg: FullyAsyncConfig, device: Any, eos_token_ids: list[int], pad_token_id: int,
                     placement: Optional[Any] = None, replica_options: Optional[Callable[[int], dict]] = None) -> Any:
    """Async mode's rollout: one inline engine, or K EngineReplica actors in the rollout placement group
    (`replica_options(i)`: replica i's Ray options instead: a shared device pool pins each to its devices)."""
    from fully_async.rollout.engines import build_engine
    from fully_async.rollout.engines.pool import EnginePool
    from fully_async.rollout.engines.replica import InlineReplica, RemoteReplica
    from fully_async.placement import placement_of
    from fully_async.placement.groups import in_bundle

    k, tp = placement_of(cfg).engine_layout()
    r = cfg.actor_rollout_ref.rollout
    if k == 1:
        replicas: list[Any] = [InlineReplica(build_engine(cfg, device, eos_token_ids, pad_token_id), device)]
    else:
        import ray

        from fully_async.cluster.ray_utils import wait_ready

        actors = {f"engine{i}": ray.remote(EngineReplica).options(
            **(replica_options(i) if replica_options is not None
               else dict(device.ray_actor_options(tp), **in_bundle(placement, i)))).remote(
                cfg, i, eos_token_ids, pad_token_id)
            for i in range(k)}
        wait_ready(actors)
        replicas = [RemoteReplica(actor, name) for name, actor in actors.items()]
        logger.info("rollout: %d engine replicas x %d device(s) each", k, tp)
    return EnginePool(replicas, num_seqs(r), timeline=cfg.trainer.timeline)


def host_trainer_engines(host: Any, cfg: FullyAsyncConfig, device: Any, backend: Any,
                         engine_args: tuple[list[int], int, int]) -> tuple[Any, list[tuple[str, Any, bool]]]:
    """async_training.placement=elastic: rank 0 (`host`, the Trainer actor, an EngineHost) hosts an engine beside its
    trainer rank as ranks 1.. do in their TrainWorkers.  Returns the pool over them that the trainer commands (weight
    loads of each rank's own parameters in its own process, sleep, wake-up) and what it lends the rollouter: (name,
    actor, threaded) per engine (rank 0's actor runs calls on several threads: see RemoteReplica)."""
    import ray

    from fully_async.rollout.engines import build_engine
    from fully_async.rollout.engines.pool import EnginePool
    from fully_async.rollout.engines.replica import HostedReplica, RemoteReplica
    from fully_async.train.group import load_trainer_weights

    eos_token_ids, pad_token_id, first_replica = engine_args
    local = getattr(backend, "local", backend)   # rank 0's own backend inside a GroupBackend
    engine = build_engine(cfg, device, eos_token_ids, pad_token_id, replica=first_replica)
    host._host_engine(engine, device, "trainer_engine0",
                      extra={"load_trainer_weights": lambda version: load_trainer_weights(local, engine, version)})
    lendable = [("trainer_engine0", ray.get_runtime_context().current_actor, True)]
    lendable += [(f"trainer_engine{r}", w, False) for r, w in enumerate(getattr(backend, "workers", []), start=1)]
    replicas = [HostedReplica(host, "trainer_engine0")]
    replicas += [RemoteReplica(actor, name) for name, actor, _ in lendable[1:]]
    pool = EnginePool(replicas, num_seqs(cfg.actor_rollout_ref.rollout), timeline=False)
    pool.sleep(1)   # asleep until first lent: the trainer works on these devices
    return pool, lendable
