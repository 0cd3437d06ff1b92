"""Data-parallel trainer group (layer 4): one process per trainer device, rank 0 drives.

Rank 0 is the Trainer (or SyncWorker) actor itself; ranks 1..W-1 are `TrainWorker` actors.  All
ranks join one torch.distributed world on the device's comm backend (gloo / nccl / hccl) and hold
an FSDP2-sharded `TorchBackend`.  `GroupBackend` gives rank 0 the same `TrainBackend` interface as
a single device: it cuts every batch (and every mini-batch) into per-rank shards, runs its own
shard while the workers run theirs, and sums the additive metrics.  Every rank is told how many
micro-batches to run so that FSDP's collectives line up (a rank with fewer rows runs dummies).
"""
from __future__ import annotations

import dataclasses
import inspect
import random
from typing import Any, Callable, Optional, TypeVar

import torch

from fully_async.core.plan import RunPlan
from fully_async.core.config import FullyAsyncConfig, actor_strategy, typed_config
from fully_async.train.backends import ShardedTrainBackend
from fully_async.core.batch import TrainBatch, micro_batches
from fully_async.rollout.engines.replica import EngineHost
from fully_async.cluster.ray_utils import ray_get

F = TypeVar("F", bound=Callable[..., Any])

# backend calls rank 0 answers alone (its own parameters' names and shapes; its own engine's weights in sync mode)
RANK0_ONLY = ("param_shapes", "iter_full_parameters")


def forwards_to_backend(fn: F) -> F:
    """Marks a TrainWorker method that runs the backend method of the same name.  Checked when the class is
    defined: the method must be declared by the backend Protocol, with the Protocol's parameters, so the
    Protocol stays the one list of what crosses into a backend."""
    declared = getattr(ShardedTrainBackend, fn.__name__, None)
    if declared is None or not callable(declared):
        raise TypeError(f"TrainWorker.{fn.__name__} forwards a method the TrainBackend Protocol does not declare "
                        "(fully_async/train/backends/__init__.py)")
    ours, theirs = list(inspect.signature(fn).parameters), list(inspect.signature(declared).parameters)
    if ours != theirs:
        raise TypeError(f"TrainWorker.{fn.__name__}{ours} does not match the Protocol's {theirs}")
    fn.forwards_to_backend = True  # type: ignore[attr-defined]
    return fn


def forwarded_methods(cls: type) -> list[str]:
    """Names of the methods of `cls` marked with @forwards_to_backend."""
    return sorted(name for name, fn in inspect.getmembers(cls, inspect.isfunction)
                  if getattr(fn, "forwards_to_backend", False))


def total_optimizer_steps(cfg: FullyAsyncConfig, total_steps: int, mini_batches_per_step: int) -> int:
    return total_steps * mini_batches_per_step * cfg.actor_rollout_ref.actor.ppo_epochs


def shards(cfg: FullyAsyncConfig) -> bool:
    """The strategy runs a process group over the trainer ranks (verl's `fsdp` resolves by world size)."""
    return actor_strategy(cfg) in ("fsdp2", "megatron")



def build_local_backend(cfg: FullyAsyncConfig, device: Any, optimizer_steps: int, rank: int, world: int,
                        master: Optional[tuple[str, int]], store: Optional[Any] = None) -> Any:
    """This process's backend; joins the trainer's process group first when the strategy shards (rank 0 with
    its own rendezvous `store`, fsdp.master_store)."""
    from fully_async.train.backends import build_backend
    from fully_async.train.backends.fsdp import init_process_group, master_store

    if shards(cfg):
        if master is None:   # a lone rank (world 1) of a sharding strategy: a private store
            store = master_store("127.0.0.1", world)
            master = ("127.0.0.1", store.port)
        init_process_group(device, rank, world, *master, store=store)
    return build_backend(cfg, device, optimizer_steps)


class TrainWorker(EngineHost):
    """Ray actor for data-parallel ranks >= 1: a backend that rank 0 calls method by method (one remote
    method per backend method the group forwards, each checked against the Protocol).

    In sync mode it also hosts this rank's rollout engine (EngineHost: submit / poll / engine_call), so
    sync mode generates on every trainer device; the engine loads this rank's own gathered parameters
    (`load_trainer_weights`), so no weight crosses processes."""

    def __init__(self, cfg: FullyAsyncConfig, rank: int, world: int, master: tuple[str, int], optimizer_steps: int,
                 engine_args: Optional[tuple[list[int], int]] = None):
        from fully_async.actors.actor_setup import actor_init

        self.cfg, self.device = actor_init(cfg, f"trainer-rank{rank}")
        self.backend = build_local_backend(self.cfg, self.device, optimizer_steps, rank, world, master)
        if engine_args is not None:
            from fully_async.rollout.engines import build_engine

            engine = build_engine(self.cfg, self.device, *engine_args, replica=rank)
            self._host_engine(engine, self.device, f"engine{rank}",
                              extra={"load_trainer_weights": lambda version: load_trainer_weights(
                                  self.backend, engine, version)})

    def ready(self) -> bool:
        return True

    # ------------------------------------------------------------------ the backend, as rank 0 drives it
    @forwards_to_backend
    def compute_log_probs(self, batch: TrainBatch, which: str = "actor",
                          num_micro: Optional[int] = None) -> torch.Tensor:
        if num_micro is None:  # a replicated (megatron) rank runs the whole batch its own way
            return self.backend.compute_log_probs(batch, which)
        return self.backend.compute_log_probs(batch, which, num_micro=num_micro)

    @forwards_to_backend
    def train_mini_batch(self, mini: TrainBatch, denom: float, loss_scale: float = 1.0,
                         num_micro: Optional[int] = None, rows_total: Optional[int] = None) -> dict[str, float]:
        return self.backend.train_mini_batch(mini, denom, loss_scale=loss_scale, num_micro=num_micro,
                                             rows_total=rows_total)

    @forwards_to_backend
    def train_step(self, batch: TrainBatch, num_mini_batches: int) -> dict[str, float]:
        return self.backend.train_step(batch, num_mini_batches)

    @forwards_to_backend
    def named_parameters_for_sync(self) -> dict[str, torch.Tensor]:
        return self.backend.named_parameters_for_sync()

    @forwards_to_backend
    def stream_full_parameters(self, consumer: Optional[Callable[[Any], Any]]) -> Any:
        return self.backend.stream_full_parameters(consumer)

    @forwards_to_backend
    def save(self, path: str) -> None:
        self.backend.save(path)

    @forwards_to_backend
    def load(self, path: str) -> None:
        self.backend.load(path)

    @forwards_to_backend
    def offload(self) -> None:
        self.backend.offload()

    @forwards_to_backend
    def onload(self) -> None:
        self.backend.onload()


def load_trainer_weights(backend: Any, engine: Any, version: int) -> None:
    """Sync mode, every rank at once: the engine beside a trainer rank loads that rank's full parameters
    (FSDP2 all-gathers each one on every rank, so each engine reads its own copy as it is gathered)."""
    engine.update_weights(backend.iter_full_parameters(), version)


def shard_rows(n: int, world: int) -> list[list[int]]:
    """Row r::world for rank r (sizes differ by at most one)."""
    return [list(range(r, n, world)) for r in range(world)]


def shard_batch(batch: TrainBatch, world: int) -> tuple[list[list[int]], list[TrainBatch]]:
    """Per-rank shards; a rank left without rows (a tiny last batch) gets row 0 with its response mask
    zeroed, so it still runs the collectives but adds nothing to losses or gradients."""
    rows = shard_rows(len(batch), world)
    shards = []
    for idx in rows:
        if idx:
            shards.append(batch.select(idx))
        else:
            dummy = batch.select([0])
            shards.append(dataclasses.replace(dummy, response_mask=torch.zeros_like(dummy.response_mask)))
    return rows, shards


class GroupBackend:
    """`TrainBackend` over rank 0's local backend and the workers of ranks 1..W-1."""

    def __init__(self, local: Any, workers: list[Any], cfg: FullyAsyncConfig):
        self.local = local
        self.workers = workers
        self.world = len(workers) + 1
        self.cfg = cfg
        self.actor_cfg = cfg.actor_rollout_ref.actor
        self.rng = random.Random(cfg.trainer.seed)

    @property
    def consecutive_bad_steps(self) -> int:
        """Identical on every rank (the skip decision uses the global grad norm); rank 0's count."""
        return self.local.consecutive_bad_steps

    def _with_workers(self, refs: list, local: Callable[[], Any]) -> list[Any]:
        """Rank 0 runs `local()` while the workers run the calls already sent (`refs`, ranks 1..W-1, in
        order); the results in rank order.  Sending first matters: collectives need every rank inside."""
        mine = local()
        return [mine] + ray_get(refs)

    def _micro_count(self, shards: list[TrainBatch], micro: Optional[int], dynamic: bool, budget: int) -> int:
        packed = self.cfg.actor_rollout_ref.model.use_remove_padding
        return max(len(micro_batches(s, micro, dynamic, budget, packed)) for s in shards)

    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> torch.Tensor:
        sub = self.cfg.actor_rollout_ref.rollout if which == "actor" else self.cfg.actor_rollout_ref.ref
        rows, shards = shard_batch(batch, self.world)
        k = self._micro_count(shards, sub.log_prob_micro_batch_size_per_gpu, sub.log_prob_use_dynamic_bsz,
                              sub.log_prob_max_token_len_per_gpu)
        parts = self._with_workers([w.compute_log_probs.remote(s, which, k) for w, s in zip(self.workers, shards[1:])],
                                   lambda: self.local.compute_log_probs(shards[0], which, num_micro=k))
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for idx, part in zip(rows, parts):
            if idx:
                out[idx, :part.shape[1]] = part
        return out

    def train_step(self, batch: TrainBatch, num_mini_batches: int) -> dict[str, float]:
        from fully_async.train.backends.torch_backend import ppo_update

        a = self.actor_cfg

        def run_mini(mini: TrainBatch, denom: float) -> dict:
            _, shards = shard_batch(mini, self.world)
            k = self._micro_count(shards, a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz,
                                  a.ppo_max_token_len_per_gpu)
            kwargs = dict(loss_scale=float(self.world), num_micro=k, rows_total=len(mini))
            results = self._with_workers([w.train_mini_batch.remote(s, denom, **kwargs)
                                          for w, s in zip(self.workers, shards[1:])],
                                         lambda: self.local.train_mini_batch(shards[0], denom, **kwargs))
            merged = {key: sum(r.get(key, 0.0) for r in results) for key in results[0] if key.startswith("actor/")}
            merged["bad"] = results[0]["bad"]                    # identical on every rank (global norm)
            if "grad_norm" in results[0]:
                merged["grad_norm"] = results[0]["grad_norm"]
            return merged

        return ppo_update(batch, num_mini_batches, a, self.rng, run_mini, self.local.scheduler)

    def named_parameters_for_sync(self) -> dict[str, torch.Tensor]:
        return self._with_workers([w.named_parameters_for_sync.remote() for w in self.workers],
                                  self.local.named_parameters_for_sync)[0]

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.local.param_shapes()

    def stream_full_parameters(self, consumer: Optional[Callable[[Any], Any]]) -> Any:
        return self._with_workers([w.stream_full_parameters.remote(None) for w in self.workers],
                                  lambda: self.local.stream_full_parameters(consumer))[0]

    def save(self, path: str) -> None:
        self._with_workers([w.save.remote(path) for w in self.workers], lambda: self.local.save(path))

    def load(self, path: str) -> None:
        self._with_workers([w.load.remote(path) for w in self.workers], lambda: self.local.load(path))

    def offload(self) -> None:
        self._with_workers([w.offload.remote() for w in self.workers], self.local.offload)

    def onload(self) -> None:
        self._with_workers([w.onload.remote() for w in self.workers], self.local.onload)


class ReplicatedGroupBackend(GroupBackend):
    """strategy=megatron: every rank gets the same call and the full batch (tensor/pipeline ranks must
    see the same rows; the megatron backend takes its own data-parallel rows)."""

    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> torch.Tensor:
        return self._with_workers([w.compute_log_probs.remote(batch, which) for w in self.workers],
                                  lambda: self.local.compute_log_probs(batch, which))[0]

    def train_step(self, batch: TrainBatch, num_mini_batches: int) -> dict[str, float]:
        return self._with_workers([w.train_step.remote(batch, num_mini_batches) for w in self.workers],
                                  lambda: self.local.train_step(batch, num_mini_batches))[0]


def connect_trainer_group(cfg: FullyAsyncConfig, device: Any, optimizer_steps: int, master: tuple[str, int],
                          worker_options: dict, placement: Optional[Any] = None,
                          engine_args: Optional[tuple[list[int], int]] = None,
                          rank_options: Optional[Callable[[int], dict]] = None) -> Any:
    """Rank 0's backend: spawns W-1 TrainWorkers (rank r in bundle r of `placement`), joins the process
    group with them, wraps them.  `engine_args` (eos ids, pad id): each worker also hosts an engine.
    `rank_options(r)`: rank r's Ray options instead of `worker_options` (a shared device pool pins each rank
    to its own pool device)."""
    import ray

    from fully_async.cluster.placement import in_bundle

    world = RunPlan.of(cfg).trainer_devices
    if world == 1:
        return build_local_backend(cfg, device, optimizer_steps, 0, 1, None)
    store = None
    if shards(cfg):  # bind the rendezvous port now (the OS picks it), before any rank is told it
        from fully_async.train.backends.fsdp import master_store

        store = master_store(master[0], world)
        master = (master[0], store.port)
    typed = typed_config(cfg)
    workers = [ray.remote(TrainWorker).options(**(rank_options(r) if rank_options else worker_options),
                                               **in_bundle(placement, r)).remote(
        typed, r, world, master, optimizer_steps, engine_args) for r in range(1, world)]
    local = build_local_backend(cfg, device, optimizer_steps, 0, world, master, store)  # rendezvous with the workers
    ray.get([w.ready.remote() for w in workers])
    cls = ReplicatedGroupBackend if cfg.actor_rollout_ref.actor.strategy == "megatron" else GroupBackend
    return cls(local, workers, cfg)
