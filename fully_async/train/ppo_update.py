"""The one PPO update (layer 5): epochs x mini-batches x micro-batches, for every strategy and the data-parallel group.

Each of `actor.ppo_epochs` passes shuffles the batch (the backend's RNG, checkpointed with it) and cuts it into
`num_mini_batches` mini-batches, one optimizer step each.  A mini-batch is cut into data-parallel shards and
micro-batches (sharding.py), and every micro-batch's loss (`algorithms/actor_loss.py`) is divided by the
token (or sequence) count of its whole mini-batch, so micro-batching and data parallelism never change the
numbers: gradients accumulate over the micro-batches and the optimizer steps once.  A non-finite loss, metric or
gradient norm skips that step (the gradients are dropped) and is counted in `actor/bad_steps` and on the backend
(`train_step.check_bad_steps` fails after trainer.max_bad_steps in a row).

The critic (algorithm.adv_estimator=gae) is updated by the same loop (`critic_update`): critic.ppo_epochs passes of
critic.ppo_mini_batch_size groups, its micro-batch keys, the clipped value loss (`algorithms/gae.value_loss`) and
its own optimizer step (`optimizer_step(finite, "critic")`); its metrics are critic/*.

The backend only does what depends on the strategy (TrainBackend: `forward_backward`, `optimizer_step`); this
loop, the loss and the metrics are written once, so torch, FSDP2, megatron and the data-parallel group agree.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from fully_async.algorithms.actor_loss import (ActorLossOutput, actor_loss, mini_batch_denominator,
                                               mini_batch_policy_denominator)
from fully_async.algorithms.gae import value_loss, value_loss_denominator
from fully_async.core.batch import TrainBatch
from fully_async.core.config import FullyAsyncConfig, sequence_parallel_size
from fully_async.train.backends import StepResult, TrainBackend
from fully_async.train.sharding import cut_mini_batch, data_parallel_rows, seqlen_balance_metrics, shard_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MicroBatchLoss:
    """The PPO actor loss of one micro-batch, normalised to its mini-batch: `denom` is the mini-batch's token or
    sequence count (actor.loss_agg_mode), `pg_denom` the policy loss mode's own (gspo/sapo: sequences, geo_mean:
    rows), `rows_total` its row count (the share of per-token mean metrics).
    Sent with each mini-batch to every rank, so it holds only the two config sections it reads."""

    denom: float
    rows_total: int
    actor: Any              # actor_rollout_ref.actor
    async_training: Any     # async_training (decoupled PPO)
    pg_denom: Optional[float] = None  # the policy loss mode's own mini-batch denominator (None: as actor_loss says)
    rollout_correction: Any = None  # algorithm.rollout_correction (bypass-mode rejection in the loss)

    def __call__(self, mb: TrainBatch, logp: torch.Tensor, entropy: Optional[torch.Tensor]) -> ActorLossOutput:
        # logp, entropy: (B, L) under the current policy, on the micro-batch's device
        return actor_loss(logp, entropy, old_logp=mb.old_log_probs, advantages=mb.advantages, mask=mb.response_mask,
                          denom=self.denom, rows_total=self.rows_total, actor=self.actor,
                          async_training=self.async_training, ref_logp=mb.ref_log_probs,
                          rollout_logp=mb.rollout_log_probs, pg_denom=self.pg_denom,
                          is_weights=mb.rollout_is_weights, rollout_correction=self.rollout_correction)


@dataclass(frozen=True)
class MicroBatchValueLoss:
    """The critic's clipped value loss of one micro-batch, normalised to its mini-batch (as MicroBatchLoss):
    `denom` from critic.loss_agg_mode, `rows_total` the mini-batch's rows."""

    denom: float
    rows_total: int
    critic: Any             # the critic section (cliprange_value, loss_agg_mode)

    def __call__(self, mb: TrainBatch, values: torch.Tensor, _: Optional[torch.Tensor]) -> ActorLossOutput:
        # values: (B, L) under the critic being trained, on the micro-batch's device
        return value_loss(values, old_values=mb.values, returns=mb.returns, mask=mb.response_mask,
                          cliprange_value=self.critic.cliprange_value, loss_agg_mode=self.critic.loss_agg_mode,
                          denom=self.denom, share=values.shape[0] / self.rows_total)


class UpdateMetrics:
    """<prefix>/* means over the optimizer steps (each metric is already summed over its mini-batch), the grad
    norm mean over the steps taken, the number skipped, and the learning rate after the last step."""

    def __init__(self, prefix: str = "actor") -> None:
        self.prefix = prefix
        self.sums: dict[str, float] = {}
        self.norms: list[float] = []
        self.steps = 0
        self.bad = 0
        self.overflows = 0   # float16 loss-scale overflows (skipped steps that are not bad ones)
        self.lr = float("nan")

    def add(self, stats: dict[str, float], step: StepResult) -> None:
        self.steps += 1
        for key, value in stats.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        if step.overflow:
            self.overflows += 1
        elif step.skipped:
            self.bad += 1
        else:
            self.norms.append(step.grad_norm)
        self.lr = step.lr

    def result(self) -> dict[str, float]:
        metrics = {key: value / self.steps for key, value in self.sums.items()}
        if self.norms:
            metrics[f"{self.prefix}/grad_norm"] = sum(self.norms) / len(self.norms)
        metrics[f"{self.prefix}/bad_steps"] = float(self.bad)
        if self.overflows:
            metrics[f"{self.prefix}/loss_scale_overflows"] = float(self.overflows)
        metrics[f"{self.prefix}/lr"] = self.lr
        return metrics


def record_step(backend: TrainBackend, step: StepResult) -> None:
    """The backend's bad-step counters: a skipped step adds one to both, a taken one resets the run.  A float16
    loss-scale overflow (the scaler lowered its scale and skipped the step, as it is meant to) counts in neither."""
    if step.overflow:
        logger.info("float16 loss scale overflowed: optimizer step skipped and the loss scale lowered")
        return
    if step.skipped:
        backend.num_bad_steps += 1
        backend.consecutive_bad_steps += 1
        logger.warning("non-finite loss or grad norm: optimizer step skipped (%d so far)", backend.num_bad_steps)
    else:
        backend.consecutive_bad_steps = 0


def ppo_update(backend: TrainBackend, cfg: FullyAsyncConfig, batch: TrainBatch,
               num_mini_batches: int) -> dict[str, float]:
    """`actor.ppo_epochs` passes over `batch` in `num_mini_batches` optimizer steps each; returns the actor/*
    metrics.  `batch` carries old log-probs and advantages (and reference log-probs for the KL loss)."""
    actor = cfg.actor_rollout_ref.actor

    def loss(mini: TrainBatch) -> MicroBatchLoss:
        return MicroBatchLoss(mini_batch_denominator(mini.response_mask, actor), len(mini), actor, cfg.async_training,
                              mini_batch_policy_denominator(mini.response_mask, actor),
                              cfg.algorithm.rollout_correction)

    return update_loop(backend, cfg, batch, num_mini_batches, actor, loss, "actor")


def critic_update(backend: TrainBackend, cfg: FullyAsyncConfig, batch: TrainBatch,
                  num_mini_batches: int) -> dict[str, float]:
    """`critic.ppo_epochs` passes over `batch` (carrying the critic's old values and the GAE returns) in
    `num_mini_batches` critic optimizer steps each; returns the critic/* metrics."""
    critic = cfg.critic

    def loss(mini: TrainBatch) -> MicroBatchValueLoss:
        denom = value_loss_denominator(mini.response_mask, critic, cfg.data.max_response_length)
        return MicroBatchValueLoss(denom, len(mini), critic)

    return update_loop(backend, cfg, batch, num_mini_batches, critic, loss, "critic")


def update_loop(backend: TrainBackend, cfg: FullyAsyncConfig, batch: TrainBatch, num_mini_batches: int,
                section: Any, make_loss: Callable[[TrainBatch], Any], which: str) -> dict[str, float]:
    """`section.ppo_epochs` passes over `batch`, each shuffled when `section.shuffle` and cut into
    `num_mini_batches` mini-batches of `which` (actor | critic), one optimizer step each.  `section` (the actor's
    or the critic's config) also gives the micro-batch keys; `make_loss(mini)` the loss of a mini-batch."""
    packed = bool(cfg.actor_rollout_ref.model.use_remove_padding)
    sp = sequence_parallel_size(cfg)   # Ulysses: a micro-batch's token budget is per device, sp devices share it
    dp, balance = backend.data_parallel_size, bool(cfg.trainer.balance_batch)
    mini_size = math.ceil(len(batch) / num_mini_batches)
    metrics = UpdateMetrics(which)
    plain: list[list[int]] = [[] for _ in range(dp)]   # the first epoch's rows of `batch` per rank: r::dp ...
    used: list[list[int]] = [[] for _ in range(dp)]    # ... and as trained (token-balanced with balance_batch)
    for epoch in range(section.ppo_epochs):
        order = list(range(len(batch)))
        if section.shuffle:
            backend.rng.shuffle(order)
        for start in range(0, len(batch), mini_size):
            rows = order[start:start + mini_size]
            mini = batch.select(rows)
            shares = data_parallel_rows(mini.seq_lengths, dp, balance)
            if epoch == 0:
                for r, (strided, share) in enumerate(zip(shard_rows(len(rows), dp), shares)):
                    plain[r] += [rows[i] for i in strided]
                    used[r] += [rows[i] for i in share]
            cut = cut_mini_batch(mini, dp, section, packed, make_loss(mini), which, sp, shares)
            stats = backend.forward_backward(cut)
            finite = all(math.isfinite(v) for v in stats.values())
            # the actor's step keeps the one-argument call every backend (and test double) has served
            step = backend.optimizer_step(finite) if which == "actor" else backend.optimizer_step(finite, which)
            record_step(backend, step)
            metrics.add(stats, step)
    result = metrics.result()
    if balance and which == "actor":
        result.update(seqlen_balance_metrics(batch.seq_lengths, plain, used))
    return result
