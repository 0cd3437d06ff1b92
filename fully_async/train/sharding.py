"""How a batch is cut across data-parallel ranks and into micro-batches (layer 5): one rule for every strategy.

Rank r of a data-parallel world of W takes rows r::W, or with trainer.balance_batch (verl's default) a share of
about equal tokens (`balanced_rows`: the same row counts, which differ by at most one).  Every rank waits for the
slowest at each collective, so the update runs at the pace of the rank with the most tokens: with long-tailed
response lengths r::W leaves that rank 2-9% above the mean at 4-8 ranks, balanced shares within 0.01%.  The loss
is normalised over the whole mini-batch, so which rank takes a row changes no number.  Each rank's shard is cut
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


def balanced_rows(lengths: list[int], world: int) -> list[list[int]]:
    """Shares of `world` ranks with the row counts of `shard_rows` and about equal token sums: rows longest first,
    each to the rank with the fewest tokens among those below their count (a greedy, cardinality-capped longest-
    processing-time partition); each share in batch order."""
    counts = [len(r) for r in shard_rows(len(lengths), world)]
    shares: list[list[int]] = [[] for _ in range(world)]
    tokens = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min((r for r in range(world) if len(shares[r]) < counts[r]), key=lambda r: (tokens[r], r))
        shares[rank].append(i)
        tokens[rank] += lengths[i]
    return [sorted(share) for share in shares]


def data_parallel_rows(lengths: list[int], world: int, balance: bool) -> list[list[int]]:
    """Rank r's rows: a `balanced_rows` share with `balance` (trainer.balance_batch), else r::world."""
    return balanced_rows(lengths, world) if balance and world > 1 else shard_rows(len(lengths), world)


def seqlen_balance_metrics(lengths: list[int], plain: list[list[int]], used: list[list[int]]) -> dict[str, float]:
    """verl's global_seqlen/* (log_seqlen_unbalance) of one batch over its data-parallel ranks (rank r: rows
    `plain[r]` without balancing, `used[r]` as trained): min, max and minmax_diff of the ranks' token sums without
    balancing, balanced_min / balanced_max of those as trained, and the mean."""
    before = [sum(lengths[i] for i in rows) for rows in plain]
    after = [sum(lengths[i] for i in rows) for rows in used]
    return {"global_seqlen/min": float(min(before)), "global_seqlen/max": float(max(before)),
            "global_seqlen/minmax_diff": float(max(before) - min(before)),
            "global_seqlen/balanced_min": float(min(after)), "global_seqlen/balanced_max": float(max(after)),
            "global_seqlen/mean": sum(lengths) / len(used)}


def masked(batch: TrainBatch) -> TrainBatch:
    """`batch` with its response mask zeroed: it runs every pass but adds nothing."""
    return dataclasses.replace(batch, response_mask=torch.zeros_like(batch.response_mask))


def shard_batch(batch: TrainBatch, world: int,
                shares: Optional[list[list[int]]] = None) -> tuple[list[list[int]], list[TrainBatch]]:
    """Per-rank shards: `shares` (rank r's rows, `data_parallel_rows`), r::world when None; a rank left without rows
    (a tiny last batch) gets row 0 with its response mask zeroed, so it still runs the collectives but adds nothing
    to losses or gradients."""
    rows = shard_rows(len(batch), world) if shares is None else shares
    if world == 1:
        return rows, [batch]
    return rows, [batch.select(idx) if idx else masked(batch.select([0])) for idx in rows]


def micro_count(shards: list[TrainBatch], micro: Optional[int], dynamic: bool, budget: int, packed: bool) -> int:
    """The micro-batch count every rank runs: the largest any shard needs."""
    return max(len(micro_batches(s, micro, dynamic, budget, packed)) for s in shards)


def cut_mini_batch(mini: TrainBatch, world: int, actor: Any, packed: bool, loss: MicroLoss,
                   model: str = "actor", sp: int = 1, shares: Optional[list[list[int]]] = None) -> MiniBatch:
    """`mini` cut for `world` data-parallel ranks (rank r takes rows `shares[r]`, r::world when None), each shard into
    actor.ppo_micro_batch_size_per_gpu rows (or actor.ppo_max_token_len_per_gpu tokens with actor.use_dynamic_bsz:
    x sp, the sequence-parallel devices that share a shard, as verl), padded with dummies to a common count.
    `actor` is the section of the model the mini-batch updates (`model`: the critic's has the same keys)."""
    _, shards = shard_batch(mini, world, shares)
    splits = [micro_batches(s, actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz,
                            actor.ppo_max_token_len_per_gpu * sp, packed) for s in shards]
    count = max(len(split) for split in splits)
    micro: list[Optional[list[TrainBatch]]] = []
    for shard, split in zip(shards, splits):
        dummies = [masked(shard.select(split[0][:1]))] * (count - len(split))
        micro.append([shard.select(idx) for idx in split] + dummies)
    return MiniBatch(micro=micro, real=[len(split) for split in splits], loss=loss, model=model)
