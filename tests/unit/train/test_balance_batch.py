"""trainer.balance_batch (verl's default): data-parallel ranks take shares of about equal tokens, with the row counts
of r::dp; the update reports verl's global_seqlen/* metrics; with it off the ranks take rows r::dp."""
import random

import pytest
import torch

from fully_async.core.batch import TrainBatch
from fully_async.run.hydra_setup import load_config
from fully_async.train.ppo_update import ppo_update
from fully_async.train.sharding import balanced_rows, data_parallel_rows, seqlen_balance_metrics, shard_rows
from test_ppo_update import FakeBackend


def long_tailed(n: int, seed: int = 0) -> list[int]:
    """Lengths like the seed-003 shape's: lognormal, median 768, capped at 3072, plus a 16-token prompt."""
    rng = random.Random(seed)
    return [min(3072, round(rng.lognormvariate(6.64, 0.75))) + 16 for _ in range(n)]


@pytest.mark.parametrize("n,world", [(2048, 4), (2048, 8), (13, 4), (3, 4), (5, 1)])
def test_balanced_shares_keep_the_row_counts_and_cover_every_row_once(n, world):
    lengths = long_tailed(n)
    shares = balanced_rows(lengths, world)
    assert [len(s) for s in shares] == [len(s) for s in shard_rows(n, world)]
    assert sorted(i for s in shares for i in s) == list(range(n))
    assert all(s == sorted(s) for s in shares)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_balanced_shares_even_out_the_tokens_that_strided_rows_leave_uneven(world):
    lengths = long_tailed(2048, seed=1)
    mean = sum(lengths) / world

    def worst(shares):
        return max(sum(lengths[i] for i in s) for s in shares) / mean

    assert worst(shard_rows(2048, world)) > 1.005          # r::dp: the busiest rank 0.5-6% above the mean
    assert worst(balanced_rows(lengths, world)) < 1.0005   # balanced: within 0.05%
    assert data_parallel_rows(lengths, world, False) == shard_rows(2048, world)


def test_global_seqlen_metrics_are_verls():
    lengths = [10, 1, 10, 1]
    m = seqlen_balance_metrics(lengths, shard_rows(4, 2), balanced_rows(lengths, 2))
    assert m == {"global_seqlen/min": 2.0, "global_seqlen/max": 20.0, "global_seqlen/minmax_diff": 18.0,
                 "global_seqlen/balanced_min": 11.0, "global_seqlen/balanced_max": 11.0, "global_seqlen/mean": 11.0}


def batch_of(lengths: list[int]) -> TrainBatch:
    """Row r holds r in its first token; its attention mask covers lengths[r] tokens (the last 2 the response)."""
    n, width = len(lengths), max(lengths)
    ids = torch.arange(n).unsqueeze(1).repeat(1, width)
    mask = torch.zeros(n, width, dtype=torch.long)
    resp = torch.zeros(n, width)
    for r, length in enumerate(lengths):
        mask[r, :length] = 1
        resp[r, length - 2:length] = 1.0
    return TrainBatch(ids, mask, resp, torch.zeros(n, width), torch.zeros(n), [f"g{r // 2}" for r in range(n)],
                      old_log_probs=torch.zeros(n, width), advantages=torch.ones(n, width))


@pytest.mark.parametrize("balance", [True, False])
def test_the_update_hands_each_rank_its_share_and_reports_the_balance(balance):
    lengths = [40, 3, 40, 3, 40, 3, 40, 3]      # r::2: rank 0 takes every long row (160 tokens), rank 1 12
    cfg = load_config(["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.shuffle=false",
                       f"trainer.balance_batch={str(balance).lower()}"])
    backend = FakeBackend(dp=2)
    metrics = ppo_update(backend, cfg, batch_of(lengths), 1)
    (mini,) = backend.minis
    tokens = [sum(lengths[int(mb.input_ids[i, 0])] for mb in micro[:real] for i in range(len(mb)))
              for micro, real in zip(mini.micro, mini.real)]
    if balance:
        assert tokens == [86, 86]
        assert metrics["global_seqlen/balanced_max"] == metrics["global_seqlen/balanced_min"] == 86.0
    else:
        assert tokens == [160, 12]
        assert "global_seqlen/balanced_max" not in metrics
