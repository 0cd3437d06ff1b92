"""Data-parallel trainer group (layer 5): one process per trainer device, rank 0 drives.

Rank 0 is the Trainer (or SyncWorker) actor itself; ranks 1..W-1 are `actors/train_worker.TrainWorker` actors
(the thin Ray shell, passed in as `worker`: this layer cannot import the actors).  All ranks join one
torch.distributed world on the device's comm backend (gloo / nccl / hccl).  `GroupBackend` gives rank 0 the same
`TrainBackend` contract as a single device, so the one PPO update (ppo_update.py) drives a group exactly as it
drives one backend: it sends each rank its own data-parallel shard of every mini-batch (FSDP2: each rank's
`TorchBackend` runs its shard), calls every rank's optimizer step, and sums the additive metrics in rank order.
`ReplicatedGroupBackend` (megatron) sends every rank the whole call: tensor/pipeline peers need the same rows, and
each megatron rank picks its own data-parallel shard.
"""
from __future__ import annotations

import logging
import random
from typing import Any, Callable, Optional

import torch

from fully_async.cluster.ray_utils import ray_get
from fully_async.core.batch import TrainBatch
from fully_async.core.config import FullyAsyncConfig, typed_config, actor_strategy, sequence_parallel_size
from fully_async.core.plan import RunPlan
from fully_async.train.backends import MiniBatch, StepResult, TrainBackend
from fully_async.train.sharding import data_parallel_rows, micro_count, shard_batch

logger = logging.getLogger(__name__)

# backend calls rank 0 answers alone (its own parameters' names and shapes; its own engine's weights in sync mode)
RANK0_ONLY = ("param_shapes", "iter_full_parameters")


def total_optimizer_steps(cfg: FullyAsyncConfig, total_steps: int, mini_batches_per_step: int) -> int:
    return total_steps * mini_batches_per_step * cfg.actor_rollout_ref.actor.ppo_epochs


def shards(cfg: FullyAsyncConfig) -> bool:
    """The strategy runs a process group over the trainer ranks (verl's `fsdp` resolves by world size)."""
    return actor_strategy(cfg) in ("fsdp2", "megatron")


def build_local_backend(cfg: FullyAsyncConfig, device: Any, optimizer_steps: int, rank: int, world: int,
                        master: Optional[tuple[str, int]], store: Optional[Any] = None, *,
                        engine_beside: bool) -> TrainBackend:
    """This process's backend; joins the trainer's process group first when the strategy shards (rank 0 with
    its own rendezvous `store`, fsdp.master_store).  A process without an engine beside the trainer (async's
    trainer ranks but elastic's) first sets its allocator to expandable segments (Device.prefer_expandable_segments:
    the engine's graphs and arenas are left to torch's defaults)."""
    from fully_async.train.backends import build_backend
    from fully_async.train.backends.fsdp import init_process_group, join_lone_rank

    if not engine_beside:
        said = device.prefer_expandable_segments()
        if said and rank == 0:
            logger.info(said)

    if shards(cfg):
        if master is None:   # a lone rank (world 1) of a sharding strategy: a private store
            join_lone_rank(device)
        else:
            init_process_group(device, rank, world, *master, store=store)
    return build_backend(cfg, device, optimizer_steps)


def load_trainer_weights(backend: Any, engine: Any, version: int) -> None:
    """Sync mode, every rank at once: the engine beside a trainer rank loads that rank's full parameters
    (FSDP2 all-gathers each one on every rank, so each engine reads its own copy as it is gathered)."""
    from fully_async.weight_sync.guard import finite_stream

    engine.update_weights(finite_stream(backend.iter_full_parameters(), version), version)


class GroupBackend:
    """`TrainBackend` over rank 0's local backend and the workers of ranks 1..W-1 (strategy fsdp2).

    With Ulysses (sp > 1) the sp consecutive ranks of a sequence-parallel group get the same data-parallel shard
    (rank r: shard r // sp) and the group's first rank's results stand for it (backends/ulysses.py)."""

    def __init__(self, local: Any, workers: list[Any], cfg: FullyAsyncConfig):
        self.local = local
        self.workers = workers
        self.world = len(workers) + 1
        self.cfg = cfg
        self.sp = sequence_parallel_size(cfg)

    @property
    def data_parallel_size(self) -> int:
        return self.world // self.sp

    @property
    def rng(self) -> random.Random:
        """Rank 0's shuffle RNG (saved in its checkpoint): rank 0 cuts every mini-batch for all ranks."""
        return self.local.rng

    @property
    def num_bad_steps(self) -> int:
        return self.local.num_bad_steps

    @num_bad_steps.setter
    def num_bad_steps(self, value: int) -> None:
        self.local.num_bad_steps = value

    @property
    def consecutive_bad_steps(self) -> int:
        """Identical on every rank (the skip decision is rank 0's, from summed metrics and the global grad norm)."""
        return self.local.consecutive_bad_steps

    @consecutive_bad_steps.setter
    def consecutive_bad_steps(self, value: int) -> None:
        self.local.consecutive_bad_steps = value

    def _with_workers(self, refs: list, local: Callable[[], Any]) -> list[Any]:
        """Rank 0 runs `local()` while the workers run the calls already sent (`refs`, ranks 1..W-1, in
        order); the results in rank order.  Sending first matters: collectives need every rank inside."""
        mine = local()
        return [mine] + ray_get(refs)

    def _per_shard(self, method: str, batch: TrainBatch, micro: Optional[int], dynamic: bool, budget: int,
                   *args: Any) -> tuple[list[list[int]], list[torch.Tensor]]:
        """(rows, parts) of `method` run by every rank on its data-parallel shard of `batch` (a sequence-parallel
        group: the same one) with the pass count all ranks agreed on (`micro` rows, or `budget` tokens per device
        with `dynamic`); one part per shard, its group's first rank's."""
        dp = self.data_parallel_size
        rows, shards = shard_batch(batch, dp, data_parallel_rows(batch.seq_lengths, dp, self.cfg.trainer.balance_batch))
        k = micro_count(shards, micro, dynamic, budget * self.sp, self.cfg.actor_rollout_ref.model.use_remove_padding)
        parts = self._with_workers([getattr(w, method).remote(shards[r // self.sp], *args, k)
                                    for r, w in enumerate(self.workers, start=1)],
                                   lambda: getattr(self.local, method)(shards[0], *args, num_micro=k))
        return rows, parts[::self.sp]

    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> torch.Tensor:
        sub = self.cfg.actor_rollout_ref.rollout if which == "actor" else self.cfg.actor_rollout_ref.ref
        rows, parts = self._per_shard("compute_log_probs", batch, sub.log_prob_micro_batch_size_per_gpu,
                                      sub.log_prob_use_dynamic_bsz, sub.log_prob_max_token_len_per_gpu, which)
        return self._gather_rows(batch, rows, parts)

    def compute_sum_pi_squared(self, batch: TrainBatch) -> torch.Tensor:
        """The actor's sum_v pi_v^2 per position, each data-parallel shard its own rows (the old-policy pass's
        micro-batches)."""
        sub = self.cfg.actor_rollout_ref.rollout
        rows, parts = self._per_shard("compute_sum_pi_squared", batch, sub.log_prob_micro_batch_size_per_gpu,
                                      sub.log_prob_use_dynamic_bsz, sub.log_prob_max_token_len_per_gpu)
        return self._gather_rows(batch, rows, parts)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's values, each data-parallel shard its own rows."""
        c = self.cfg.critic
        rows, parts = self._per_shard("compute_values", batch, c.forward_micro_batch_size_per_gpu, c.use_dynamic_bsz,
                                      c.forward_max_token_len_per_gpu)
        return self._gather_rows(batch, rows, parts)

    def compute_rm_scores(self, batch: TrainBatch) -> torch.Tensor:
        """(B,) reward-model scores, each data-parallel shard its own rows."""
        rm = self.cfg.reward_model
        rows, parts = self._per_shard("compute_rm_scores", batch, rm.micro_batch_size_per_gpu, rm.use_dynamic_bsz,
                                      rm.forward_max_token_len_per_gpu)
        out = torch.zeros(len(batch), dtype=torch.float32)
        for idx, part in zip(rows, parts):
            if idx:
                out[idx] = part
        return out

    @staticmethod
    def _gather_rows(batch: TrainBatch, rows: list[list[int]], parts: list[torch.Tensor]) -> torch.Tensor:
        """(B, L) of `batch` from each shard's rows (`rows[s]`) and its part (`parts[s]`, trimmed to its longest)."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for idx, part in zip(rows, parts):
            if idx:
                out[idx, :part.shape[1]] = part
        return out

    def forward_backward(self, mini: MiniBatch) -> dict[str, float]:
        """Each rank gets only its own shard (a sequence-parallel group, the same one); the additive metrics summed
        over ranks, in rank order (a group's other ranks report none)."""
        results = self._with_workers([w.forward_backward.remote(mini.for_rank(r // self.sp))
                                      for r, w in enumerate(self.workers, start=1)],
                                     lambda: self.local.forward_backward(mini.for_rank(0)))
        return {key: sum(r.get(key, 0.0) for r in results) for key in results[0]}

    def optimizer_step(self, finite: bool, which: str = "actor") -> StepResult:
        """Every rank steps (or skips) together: the norm is global; rank 0's report."""
        return self._with_workers([w.optimizer_step.remote(finite, which) for w in self.workers],
                                  lambda: self.local.optimizer_step(finite, which))[0]

    def named_parameters_for_sync(self) -> dict[str, torch.Tensor]:
        return self._with_workers([w.named_parameters_for_sync.remote() for w in self.workers],
                                  self.local.named_parameters_for_sync)[0]

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.local.param_shapes()

    def pack_shared_weights(self, packer: Any) -> list[Any]:
        """Device-IPC weight sync (weight_sync/device_ipc.py) on every rank at once: each packs the full parameters
        it gathers into a buffer on its own device (rank 0 into `packer`, ranks >= 1 into their own); the handles in
        rank order."""
        return self._with_workers([w.pack_shared_weights.remote(packer.dtype) for w in self.workers],
                                  lambda: packer.pack(self.local.iter_full_parameters()))

    def stream_full_parameters(self, consumer: Optional[Callable[[Any], Any]]) -> Any:
        return self._with_workers([w.stream_full_parameters.remote(None) for w in self.workers],
                                  lambda: self.local.stream_full_parameters(consumer))[0]

    def save(self, path: str) -> None:
        self._with_workers([w.save.remote(path) for w in self.workers], lambda: self.local.save(path))

    def load(self, path: str) -> None:
        self._with_workers([w.load.remote(path) for w in self.workers], lambda: self.local.load(path))

    def memory_parts(self) -> dict[str, int]:
        """Rank 0's (device_memory/tenant.py): the ranks of a data-parallel group hold alike."""
        return self.local.memory_parts()

    def offload(self) -> None:
        self._with_workers([w.offload.remote() for w in self.workers], self.local.offload)

    def onload(self) -> None:
        self._with_workers([w.onload.remote() for w in self.workers], self.local.onload)


class ReplicatedGroupBackend(GroupBackend):
    """strategy=megatron: every rank gets the same call and the whole batch or mini-batch (tensor/pipeline ranks
    must see the same rows; each megatron rank takes its own data-parallel rows or shard)."""

    @property
    def data_parallel_size(self) -> int:
        return self.local.data_parallel_size

    def compute_log_probs(self, batch: TrainBatch, which: str = "actor") -> torch.Tensor:
        return self._with_workers([w.compute_log_probs.remote(batch, which) for w in self.workers],
                                  lambda: self.local.compute_log_probs(batch, which))[0]

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's values: every rank the whole batch (its dp rows summed over ranks inside): rank 0's."""
        return self._with_workers([w.compute_values.remote(batch) for w in self.workers],
                                  lambda: self.local.compute_values(batch))[0]

    def compute_rm_scores(self, batch: TrainBatch) -> torch.Tensor:
        """The reward model's scores, as compute_values."""
        return self._with_workers([w.compute_rm_scores.remote(batch) for w in self.workers],
                                  lambda: self.local.compute_rm_scores(batch))[0]

    def forward_backward(self, mini: MiniBatch) -> dict[str, float]:
        """Already summed over dp shards and pipeline stages on every rank: rank 0's."""
        return self._with_workers([w.forward_backward.remote(mini) for w in self.workers],
                                  lambda: self.local.forward_backward(mini))[0]


def await_ranks(store: Any, workers: list[Any], timeout_s: Optional[float] = None, poll_s: float = 0.5) -> None:
    """Rank 0, before it joins the process group: wait until ranks 1..W-1 have reached the rendezvous (each sets
    its fsdp.arrived_key in the store), failing at once, naming the rank and its error, when one died on the way
    (its actor's constructor raised, its process was killed).  init_process_group alone would wait for the dead
    rank until the store's timeout (15 minutes)."""
    import time

    import ray

    from fully_async.cluster.ray_utils import RunFailed, describe
    from fully_async.train.backends.fsdp import STORE_TIMEOUT, arrived_key

    limit = timeout_s if timeout_s is not None else STORE_TIMEOUT.total_seconds()
    deadline = time.monotonic() + limit
    ranks = {w.ready.remote(): r for r, w in enumerate(workers, start=1)}  # resolves only once the rank has joined
    while True:
        missing = [r for r in ranks.values() if not store.check([arrived_key(r)])]
        if not missing:
            return
        done, _ = ray.wait(list(ranks), num_returns=len(ranks), timeout=poll_s)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - a rank that cannot join: name it
                raise RunFailed(f"trainer rank {ranks[ref]} died before joining the trainer's process group: "
                                f"{describe(exc)}") from None
        if time.monotonic() > deadline:
            raise RunFailed(f"trainer rank(s) {missing} did not reach the process group's rendezvous within "
                            f"{limit:.0f}s; their actors are alive (still loading? check their logs)")


def connect_trainer_group(cfg: FullyAsyncConfig, device: Any, optimizer_steps: int, master: tuple[str, int],
                          worker_options: dict, placement: Optional[Any] = None,
                          engine_args: Optional[tuple[list[int], int, int]] = None,
                          rank_options: Optional[Callable[[int], dict]] = None, *, worker: type) -> TrainBackend:
    """Rank 0's backend: spawns W-1 `worker`s (the TrainWorker class; rank r in bundle r of `placement`), joins the
    process group with them, wraps them.  `engine_args` (eos ids, pad id, the engine replica index of rank 0: seeds
    differ per replica): each worker also hosts an engine.
    `rank_options(r)`: rank r's Ray options instead of `worker_options` (a shared device pool pins each rank
    to its own pool device)."""
    import ray

    from fully_async.placement.groups import in_bundle

    world = RunPlan.of(cfg).trainer_devices
    if world == 1:
        return build_local_backend(cfg, device, optimizer_steps, 0, 1, None, engine_beside=engine_args is not None)
    store = None
    if shards(cfg):  # bind the rendezvous port now (the OS picks it), before any rank is told it
        from fully_async.train.backends.fsdp import master_store

        store = master_store(master[0], world)
        master = (master[0], store.port)
    workers = [ray.remote(worker).options(**(rank_options(r) if rank_options else worker_options),
                                          **in_bundle(placement, r)).remote(
        typed_config(cfg), r, world, master, optimizer_steps, engine_args)   # resolved here: resolvers are the driver's
        for r in range(1, world)]
    if store is not None:
        await_ranks(store, workers)
    local = build_local_backend(cfg, device, optimizer_steps, 0, world, master, store,   # rendezvous with the workers
                                engine_beside=engine_args is not None)
    ray.get([w.ready.remote() for w in workers])
    cls = ReplicatedGroupBackend if cfg.actor_rollout_ref.actor.strategy == "megatron" else GroupBackend
    return cls(local, workers, cfg)
