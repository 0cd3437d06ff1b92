"""The one PPO update: epochs x mini-batches x micro-batches through a backend's two primitives.

A recording fake backend checks the loop (how many optimizer steps, which rows each sees, the shuffle, the
skip accounting, the metric means); the tiny random model checks the loss normalisation and the dummies on a
real TorchBackend, before any optimizer step (so Adam cannot blur a wrong factor)."""
import math
import random

import pytest
import torch

from fully_async.algorithms.actor_loss import mini_batch_denominator
from fully_async.core.batch import TrainBatch, build_batch
from fully_async.run.hydra_setup import load_config
from fully_async.train.backends import MiniBatch, StepResult
from fully_async.train.ppo_update import MicroBatchLoss, ppo_update
from fully_async.train.sharding import cut_mini_batch
from fully_async.train.train_step import prepare_batch
from test_torch_backend import backend_for, make_samples


def row_batch(n: int) -> TrainBatch:
    """n rows whose input_ids[:, 0] is the row's index (so a fake backend can tell which rows it got)."""
    ids = torch.stack([torch.tensor([i, 5, 6]) for i in range(n)])
    mask = torch.ones(n, 3)
    resp = torch.tensor([[0.0, 1.0, 1.0]] * n)
    return TrainBatch(ids, mask.long(), resp, torch.zeros(n, 3), torch.zeros(n), [f"g{i}" for i in range(n)],
                      old_log_probs=torch.zeros(n, 3), advantages=torch.ones(n, 3))


class FakeBackend:
    """Records each mini-batch's rows; returns scripted metrics and grad norms (None: the step is skipped)."""

    def __init__(self, stats=None, norms=None, dp=1, seed=0):
        self.data_parallel_size = dp
        self.rng = random.Random(seed)
        self.num_bad_steps = 0
        self.consecutive_bad_steps = 0
        self.minis: list[MiniBatch] = []
        self.finite_flags: list[bool] = []
        self.stats = stats or (lambda i: {"actor/pg_loss": float(i), "actor/entropy": 2.0})
        self.norms = norms or (lambda i: 1.0 + i)

    def forward_backward(self, mini):
        self.minis.append(mini)
        return self.stats(len(self.minis) - 1)

    def optimizer_step(self, finite):
        self.finite_flags.append(finite)
        i = len(self.finite_flags) - 1
        norm = self.norms(i) if finite else None
        return StepResult(norm, 0.1 * (i + 1))

    def rows(self, k: int) -> list[int]:
        """Row ids of mini-batch k, every rank's real micro-batches in order."""
        mini = self.minis[k]
        return [int(r) for micro, real in zip(mini.micro, mini.real) for mb in micro[:real] for r in mb.input_ids[:, 0]]


def config(*overrides):
    return load_config(["actor_rollout_ref.rollout.n=2", *overrides])


@pytest.mark.parametrize("epochs,rows,minis,steps_per_epoch", [(1, 8, 2, 2), (2, 10, 3, 3), (3, 5, 5, 5), (1, 4, 1, 1)])
def test_epochs_times_mini_batches_optimizer_steps_each_row_once_per_epoch(epochs, rows, minis, steps_per_epoch):
    cfg = config(f"actor_rollout_ref.actor.ppo_epochs={epochs}")
    backend = FakeBackend()
    ppo_update(backend, cfg, row_batch(rows), minis)
    assert len(backend.finite_flags) == len(backend.minis) == epochs * steps_per_epoch
    size = math.ceil(rows / minis)
    for e in range(epochs):
        seen = [backend.rows(e * steps_per_epoch + k) for k in range(steps_per_epoch)]
        assert sorted(r for mini in seen for r in mini) == list(range(rows))
        assert all(len(mini) == size for mini in seen[:-1])


def test_the_shuffle_is_the_backends_rng_one_permutation_per_epoch():
    """Same RNG use as before the update moved: one random.Random(trainer.seed).shuffle of range(B) per epoch."""
    cfg = config("actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.shuffle=true", "trainer.seed=7")
    backend = FakeBackend(seed=7)
    ppo_update(backend, cfg, row_batch(6), 2)
    rng = random.Random(7)
    expected = []
    for _ in range(2):
        order = list(range(6))
        rng.shuffle(order)
        expected += [order[:3], order[3:]]
    assert [backend.rows(k) for k in range(4)] == expected
    assert backend.rng.getstate() == rng.getstate()        # the checkpointed RNG advanced exactly as much

    unshuffled = FakeBackend(seed=7)
    ppo_update(unshuffled, config("actor_rollout_ref.actor.shuffle=false"), row_batch(6), 2)
    assert [unshuffled.rows(k) for k in range(2)] == [[0, 1, 2], [3, 4, 5]]


def test_a_non_finite_metric_skips_the_step_and_counts_bad_steps():
    nan_on = {1, 2}
    backend = FakeBackend(stats=lambda i: {"actor/pg_loss": math.nan if i in nan_on else 1.0})
    metrics = ppo_update(backend, config("actor_rollout_ref.actor.ppo_epochs=2"), row_batch(4), 2)
    assert backend.finite_flags == [True, False, False, True]
    assert metrics["actor/bad_steps"] == 2.0
    assert metrics["actor/grad_norm"] == (1.0 + 4.0) / 2            # steps 0 and 3 only (norm 1 + i)
    assert backend.num_bad_steps == 2 and backend.consecutive_bad_steps == 0   # the last step was good again
    assert metrics["actor/lr"] == pytest.approx(0.4)                 # reported by the last step

    bad_last = FakeBackend(norms=lambda i: None if i == 1 else 1.0)  # the backend found a non-finite grad norm
    metrics = ppo_update(bad_last, config(), row_batch(4), 2)
    assert bad_last.finite_flags == [True, True]                     # the metrics were finite: the backend decided
    assert metrics["actor/bad_steps"] == 1.0 and bad_last.consecutive_bad_steps == 1
    assert metrics["actor/grad_norm"] == 1.0


def test_metrics_are_means_over_optimizer_steps():
    backend = FakeBackend(stats=lambda i: {"actor/pg_loss": float(i), "actor/ppo_kl": 0.5 * i})
    metrics = ppo_update(backend, config("actor_rollout_ref.actor.ppo_epochs=2"), row_batch(6), 3)
    assert metrics["actor/pg_loss"] == pytest.approx(sum(range(6)) / 6)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.5 * sum(range(6)) / 6)
    assert metrics["actor/grad_norm"] == pytest.approx(sum(1.0 + i for i in range(6)) / 6)
    assert metrics["actor/bad_steps"] == 0.0


def test_each_mini_batch_carries_its_own_loss_normalisation():
    """denom is the mini-batch's response-token count (token-mean), rows_total its row count."""
    backend = FakeBackend()
    batch = row_batch(5)
    batch.response_mask[0, 1] = 0.0                                   # row 0 has one response token, others two
    ppo_update(backend, config("actor_rollout_ref.actor.shuffle=false"), batch, 2)
    losses = [m.loss for m in backend.minis]
    assert [(loss.denom, loss.rows_total) for loss in losses] == [(5.0, 3), (4.0, 2)]
    assert all(isinstance(loss, MicroBatchLoss) for loss in losses)


def test_data_parallel_ranks_get_rows_r_mod_world_with_dummies_to_a_common_count():
    cfg = config("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.shuffle=false")
    backend = FakeBackend(dp=2)
    ppo_update(backend, cfg, row_batch(3), 1)
    mini = backend.minis[0]
    assert mini.real == [2, 1] and [len(m) for m in mini.micro] == [2, 2]       # rank 1 runs one dummy
    assert [[int(mb.input_ids[0, 0]) for mb in m] for m in mini.micro] == [[0, 2], [1, 1]]
    assert mini.micro[1][1].response_mask.sum() == 0 and mini.micro[1][0].response_mask.sum() > 0
    sent = mini.for_rank(1)
    assert sent.micro[0] is None and sent.shard(1) == (mini.micro[1], 1)
    with pytest.raises(ValueError, match="rank 0's micro-batches were not sent"):
        sent.shard(0)


# --------------------------------------------------------------------------- the tiny model, one backend
def grads_after_forward_backward(backend, mini):
    metrics = backend.forward_backward(mini)
    return metrics, {n: p.grad.detach().clone() for n, p in backend.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_one_micro_batch_or_many_give_the_same_gradients_and_metrics(random_model_dir, mode):
    cfg, backend = backend_for(random_model_dir, f"actor_rollout_ref.actor.loss_agg_mode={mode}",
                               "async_training.use_rollout_log_probs=false", "actor_rollout_ref.actor.entropy_coeff=0.01",
                               "actor_rollout_ref.actor.use_kl_loss=true")
    batch = build_batch(make_samples())
    prepare_batch(backend, cfg, batch, {})
    batch.old_log_probs = batch.old_log_probs - 0.05 * torch.arange(len(batch)).unsqueeze(1)   # ratios != 1
    actor = cfg.actor_rollout_ref.actor
    loss = MicroBatchLoss(mini_batch_denominator(batch.response_mask, actor), len(batch), actor, cfg.async_training)
    one = cut_mini_batch(batch, 1, actor, False, loss)
    many = MiniBatch(micro=[[batch.select([i]) for i in range(len(batch))]], real=[len(batch)], loss=loss)
    m_one, g_one = grads_after_forward_backward(backend, one)
    m_many, g_many = grads_after_forward_backward(backend, many)
    assert len(one.micro[0]) == 1 and len(many.micro[0]) == 6
    assert set(m_one) == set(m_many) >= {"actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac"}
    # the loss terms are normalised to the mini-batch (the per-token means such as pg_clipfrac are weighted by
    # row share, as verl does, so they are only approximately micro-batch invariant)
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
        assert m_many[key] == pytest.approx(m_one[key], rel=1e-5, abs=1e-7), key
    for name in g_one:    # a micro-batch normalised by itself instead of its mini-batch would be off by ~6x
        err = float((g_many[name] - g_one[name]).norm() / g_one[name].norm().clamp(min=1e-12))
        assert err < 1e-5, (name, err)                               # float32 rounding: ~1e-6


def test_dummy_micro_batches_add_nothing(random_model_dir):
    cfg, backend = backend_for(random_model_dir, "async_training.use_rollout_log_probs=false")
    batch = build_batch(make_samples())
    prepare_batch(backend, cfg, batch, {})
    actor = cfg.actor_rollout_ref.actor
    loss = MicroBatchLoss(mini_batch_denominator(batch.response_mask, actor), len(batch), actor, cfg.async_training)
    plain = cut_mini_batch(batch, 1, actor, False, loss)
    padded = cut_mini_batch(batch, 1, actor, False, loss)
    dummy = plain.micro[0][0].select([0])
    dummy.response_mask = torch.zeros_like(dummy.response_mask)
    padded.micro[0] = padded.micro[0] + [dummy, dummy]
    m_plain, g_plain = grads_after_forward_backward(backend, plain)
    m_padded, g_padded = grads_after_forward_backward(backend, padded)
    assert m_padded == m_plain
    assert all(torch.equal(g_padded[n], g_plain[n]) for n in g_plain)


def test_a_nan_loss_leaves_the_weights_and_counts_on_the_real_backend(random_model_dir):
    cfg, backend = backend_for(random_model_dir, "actor_rollout_ref.actor.ppo_epochs=2")
    batch = build_batch(make_samples())
    prepare_batch(backend, cfg, batch, {})
    batch.advantages[0, int(batch.response_mask[0].nonzero()[0])] = math.nan    # one response token of row 0
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    lr_before = backend.scheduler.get_last_lr()[0]
    metrics = ppo_update(backend, cfg, batch, 1)
    assert metrics["actor/bad_steps"] == 2.0 and "actor/grad_norm" not in metrics
    assert backend.num_bad_steps == backend.consecutive_bad_steps == 2
    assert all(torch.equal(before[n], p) for n, p in backend.model.named_parameters())
    assert backend.scheduler.last_epoch == 0 and metrics["actor/lr"] == lr_before   # the schedule did not advance
    assert all(p.grad is None for p in backend.model.parameters())                  # the gradients were dropped
