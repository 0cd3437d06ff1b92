"""How a batch is cut across data-parallel ranks and into micro-batches (layer 4): one rule for every strategy.

Rank r of a data-parallel world of W takes rows r::W (sizes differ by at most one).  Each rank's shard is cut
into micro-batches (a fixed row count, or a token budget with actor.use_dynamic_bsz); ranks that share
collectives (FSDP2's all-gathers, megatron's gradient all-reduce) must run the same number of passes, so a rank
with fewer runs dummies: one of its rows with the response mask zeroed, which adds nothing to losses or
gradients.  The PPO update (ppo_update.py) and the data-parallel group's log-probs (group.py) both cut here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from fully_async.core.batch import TrainBatch, micro_batches
from fully_async.train.backends import MiniBatch, MicroLoss


def shard_rows(n: int, world: int) -> list[list[int]]:
    """Row r::world for rank r (sizes differ by at most one)."""
    return [list(range(r, n, world)) for r in range(world)]


def masked(batch: TrainBatch) -> TrainBatch:
    """`batch` with its response mask zeroed: it runs every pass but adds nothing."""
    return dataclasses.replace(batch, response_mask=torch.zeros_like(batch.response_mask))


def shard_batch(batch: TrainBatch, world: int) -> tuple[list[list[int]], list[TrainBatch]]:
    """Per-rank shards; a rank left without rows (a tiny last batch) gets row 0 with its response mask
    zeroed, so it still runs the collectives but adds nothing to losses or gradients."""
    rows = shard_rows(len(batch), world)
    if world == 1:
        return rows, [batch]
    return rows, [batch.select(idx) if idx else masked(batch.select([0])) for idx in rows]


def micro_count(shards: list[TrainBatch], micro: Optional[int], dynamic: bool, budget: int, packed: bool) -> int:
    """The micro-batch count every rank runs: the largest any shard needs."""
    return max(len(micro_batches(s, micro, dynamic, budget, packed)) for s in shards)


def cut_mini_batch(mini: TrainBatch, world: int, actor: Any, packed: bool, loss: MicroLoss,
                   model: str = "actor", sp: int = 1) -> MiniBatch:
    """`mini` cut for `world` data-parallel ranks, each shard into actor.ppo_micro_batch_size_per_gpu rows (or
    actor.ppo_max_token_len_per_gpu tokens with actor.use_dynamic_bsz: x sp, the sequence-parallel devices that
    share a shard, as verl), padded with dummies to a common count.
    `actor` is the section of the model the mini-batch updates (`model`: the critic's has the same keys)."""
    _, shards = shard_batch(mini, world)
    splits = [micro_batches(s, actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz,
                            actor.ppo_max_token_len_per_gpu * sp, packed) for s in shards]
    count = max(len(split) for split in splits)
    micro: list[Optional[list[TrainBatch]]] = []
    for shard, split in zip(shards, splits):
        dummies = [masked(shard.select(split[0][:1]))] * (count - len(split))
        micro.append([shard.select(idx) for idx in split] + dummies)
    return MiniBatch(micro=micro, real=[len(split) for split in splits], loss=loss, model=model)
