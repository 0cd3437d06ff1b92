"""The one training step both modes run (layer 5): the async Trainer and the sync loop call `train_step`.

Per step: build the padded batch of the groups' samples, compute the PPO "old" policy (the behaviour
log-probs, or recomputed), reference log-probs when a KL term needs them, the advantages of
algorithm.adv_estimator, then the one
PPO update (ppo_update.py: epochs x mini-batches x micro-batches through the backend's primitives), the
bad-step check and the batch metrics.

Advantages: GRPO's, or with algorithm.adv_estimator=gae the critic's: it computes the values of the batch (the
old values, before its update), GAE (algorithm.gamma / lam) gives advantages and returns, then the critic is
updated and, from step trainer.critic_warmup on, the actor (verl's order and rule).  In async mode the values
are computed here, by the trainer, on the staleness-bounded batch as it is trained (as verl's fully-async
trainer computes its old values): the critic that judges a sample is the one of the step that trains on it,
whatever param version generated it.  One function, so the built-in sync-vs-async comparison compares the
same step, and one place decides how many mini-batches a step has.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
from typing import Any, Optional, Sequence

from fully_async.core import safe_write
from fully_async.core.plan import RunPlan
from fully_async.core.config import PROFILER_TOOLS, FullyAsyncConfig, uses_critic
from fully_async.algorithms import AdvantageInput, compute_advantages_and_returns, kl_penalty, token_level_rewards
from fully_async.algorithms.gae import gae_advantages, value_metrics
from fully_async.algorithms.kl_control import build_kl_controller
from fully_async.core.batch import TrainBatch, build_batch, reward_components
from fully_async.core.flops import estimate_flops, match_device, mfu, peak_tflops, unsupported_reason
from fully_async.telemetry.metrics import batch_metrics
from fully_async.core.types import Sample, SampleGroup
from fully_async.train.backends import TrainBackend
from fully_async.train.ppo_update import critic_update, ppo_update
from fully_async.train.step_counters import StepCounters

logger = logging.getLogger(__name__)


def num_mini_batches(num_groups: int, ppo_mini_batch_size: int) -> int:
    """Optimizer steps per ppo epoch: ppo_mini_batch_size groups each, a smaller last one counts too."""
    return max(1, math.ceil(num_groups / ppo_mini_batch_size))


def train_step(backend: TrainBackend, cfg: FullyAsyncConfig, groups: Sequence[SampleGroup], pad_token_id: int,
               step: int, version: int, timeline: Optional[Any] = None) -> tuple[dict[str, float], list[Sample]]:
    """Train on `groups` (step number `step`, generated for param `version`); returns (metrics, samples).  A device
    running out of memory fails the run with what to change (device_memory/policy.py out_of_memory_advice): what
    the engine kept beside the trainer, then the update's own size."""
    counters = _step_counters(cfg.trainer.device)
    counters.start()
    try:
        with profiled(cfg, step):
            metrics, samples = _train_step(backend, cfg, groups, pad_token_id, step, version, timeline)
        metrics.update(counters.metrics())
        return metrics, samples
    except Exception as exc:
        from fully_async.placement.residency import out_of_memory

        if not out_of_memory(exc):
            raise
        from fully_async.cluster.ray_utils import RunFailed
        from fully_async.device_memory.policy import out_of_memory_advice

        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RunFailed(f"the device ran out of memory in the trainer's update of step {step}: "
                        f"{out_of_memory_advice(cfg)} ({type(exc).__name__}: {first})") from exc


@contextlib.contextmanager
def profiled(cfg: FullyAsyncConfig, step: int) -> Any:
    """verl's global_profiler for the trainer: a step listed in global_profiler.steps runs whole (old log-probs,
    reference, advantages, updates) under the device's profiler in this process, the trainer's rank 0 (the other
    ranks run the same kernels on their shards).  Its trace and ops.txt, the operators that took longest on the
    device (on the host where there is none), go to <global_profiler.save_path>/step_<N>/."""
    gp = cfg.global_profiler
    if gp.tool not in PROFILER_TOOLS or step not in (gp.steps or ()):
        yield
        return
    device = _resolve_device(cfg.trainer.device)
    folder = os.path.join(gp.save_path, f"step_{step}")
    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    with device.profiler(folder, gp.contents or ()) as prof:
        yield
        device.synchronize()
        wall = time.perf_counter() - t0   # the step's, not the trace's writing as the profiler stops
    if hasattr(prof, "key_averages"):   # torch_npu's profiler writes its own summaries
        sort = "self_device_time_total" if device.name == "cuda" else "self_cpu_time_total"
        summary = profile_summary(prof, wall, step)
        safe_write.write_text(os.path.join(folder, "summary.json"), json.dumps(summary, indent=1) + "\n")
        head = f"step {step}: wall {wall:.3f} s (profiled)"
        if summary["device_kernels"]:
            head += f", device kernels {summary['device_kernels_s']:.3f} s ({summary['device_busy']:.1%} busy)"
        safe_write.write_text(os.path.join(folder, "ops.txt"),
                              head + "\n" + prof.key_averages().table(sort_by=sort, row_limit=40))
    logger.info("profile of the trainer's step %d (%s profiler): %s", step, device.name, folder)


def profile_summary(prof: Any, wall: float, step: int) -> dict:
    """A profiled step's wall time against its device kernels' (their sum, and the busy share of the wall: the rest
    is the device waiting for the host) and the longest stretches with no kernel running, where a step loses time
    between its kernels: the gaps over 1 ms, and the ten largest with the kernels on either side (ms)."""
    kernels = sorted((e for e in prof.events() if e.device_type.name in ("CUDA", "PrivateUse1")
                      and not getattr(e, "is_user_annotation", False)), key=lambda e: e.time_range.start)
    busy = sum(e.device_time for e in kernels) / 1e6
    gaps, end, last = [], None, None
    for e in kernels:
        if end is not None and e.time_range.start - end > 1000:
            gaps.append({"ms": (e.time_range.start - end) / 1e3, "after": last.name[:80], "before": e.name[:80]})
        if end is None or e.time_range.end > end:
            end, last = e.time_range.end, e
    return {"step": step, "wall_s": round(wall, 4), "device_kernels": len(kernels), "device_kernels_s": round(busy, 4),
            "device_busy": round(busy / wall, 4) if wall > 0 else 0.0, "gaps_over_1ms": len(gaps),
            "gaps_over_1ms_s": round(sum(g["ms"] for g in gaps) / 1e3, 4),
            "largest_gaps": sorted(gaps, key=lambda g: -g["ms"])[:10]}


def _train_step(backend: TrainBackend, cfg: FullyAsyncConfig, groups: Sequence[SampleGroup], pad_token_id: int,
                step: int, version: int, timeline: Optional[Any] = None) -> tuple[dict[str, float], list[Sample]]:
    span = timeline.span if timeline is not None else (lambda name: contextlib.nullcontext())
    samples = [s for g in groups for s in g.samples]
    timing: dict[str, float] = {}
    batch = build_batch(samples, pad_token_id)
    if cfg.algorithm.adv_estimator == "gdpo":
        batch.reward_components = reward_components(samples, cfg.algorithm.gdpo_reward_keys)
    metrics = prepare_batch(backend, cfg, batch, timing, timeline)
    batch = pf_ppo_resample(cfg, batch, step, metrics)
    if uses_critic(cfg):
        t = time.perf_counter()
        with span("update_critic"):
            metrics.update(critic_update(backend, cfg, batch, num_mini_batches(len(groups),
                                                                               cfg.critic.ppo_mini_batch_size)))
        timing["timing_s/update_critic"] = time.perf_counter() - t
    if cfg.trainer.critic_warmup <= step:   # verl: the actor waits while the critic warms up
        t = time.perf_counter()
        with span("update_actor"):
            metrics.update(ppo_update(backend, cfg, batch, num_mini_batches(
                len(groups), cfg.actor_rollout_ref.actor.ppo_mini_batch_size)))
        timing["timing_s/update_actor"] = time.perf_counter() - t
        metrics.update(actor_perf_metrics(cfg, batch.seq_lengths, timing["timing_s/update_actor"]))
    metrics.update(trainer_memory_metrics(backend, cfg))
    check_bad_steps(backend, cfg, step, samples)
    metrics.update(timing)
    metrics.update(batch_metrics(samples, version, cfg.data.max_response_length, cfg.data.max_prompt_length))
    metrics["fully_async/count/current_param_version"] = version
    metrics["training/global_step"] = step
    metrics["training/epoch"] = max(g.epoch for g in groups)
    return metrics, samples


def pf_ppo_resample(cfg: FullyAsyncConfig, batch: TrainBatch, step: int, metrics: dict) -> TrainBatch:
    """algorithm.use_pf_ppo with gae (verl applies it there only): the batch resampled by reward (algorithms/pf_ppo.py);
    the samples themselves stay counted once.  Otherwise `batch`."""
    alg = cfg.algorithm
    if not (alg.use_pf_ppo and alg.adv_estimator == "gae"):
        return batch
    from fully_async.algorithms.pf_ppo import pf_ppo_rows

    rows = pf_ppo_rows(batch.scores, alg.pf_ppo.reweight_method, alg.pf_ppo.weight_pow, cfg.trainer.seed, step)
    metrics["pf_ppo/unique_rows_fraction"] = len(set(rows)) / max(1, len(rows))
    return batch.select(rows)


def prepare_batch(backend: TrainBackend, cfg: FullyAsyncConfig, batch: TrainBatch, timing: dict,
                  timeline: Optional[Any] = None) -> dict[str, float]:
    """Fill old/ref log-probs and advantages in place; returns metrics of this preparation."""
    at, actor, alg = cfg.async_training, cfg.actor_rollout_ref.actor, cfg.algorithm
    span = timeline.span if timeline is not None else (lambda name: contextlib.nullcontext())
    metrics: dict[str, float] = {}
    t = time.perf_counter()
    if at.use_rollout_log_probs and not recomputes_old_policy(cfg):
        batch.old_log_probs = batch.rollout_log_probs
    else:
        with span("old_log_prob"):
            batch.old_log_probs = backend.compute_log_probs(batch, "actor")
        diff = (batch.old_log_probs - batch.rollout_log_probs).abs() * batch.response_mask
        metrics["training/rollout_probs_diff_mean"] = float(diff.sum() / batch.response_mask.sum().clamp(min=1))
    if actor.calculate_sum_pi_squared:   # the optimal-token-baseline estimators (config checks: torch / fsdp2)
        with span("sum_pi_squared"):
            batch.sum_pi_squared = backend.compute_sum_pi_squared(batch)
    timing["timing_s/old_log_prob"] = time.perf_counter() - t
    metrics.update(apply_rollout_correction(alg.rollout_correction, batch))
    scores, penalty = batch.scores, None
    if actor.use_kl_loss or alg.use_kl_in_reward:
        t = time.perf_counter()
        with span("ref"):
            batch.ref_log_probs = backend.compute_log_probs(batch, "ref")
        timing["timing_s/ref"] = time.perf_counter() - t
        if alg.use_kl_in_reward:
            kl = kl_penalty(batch.old_log_probs, batch.ref_log_probs, alg.kl_penalty) * batch.response_mask
            ctrl = kl_controller(backend, alg)
            beta = ctrl.value  # this step's coefficient; the controller then moves it (verl's apply_kl_penalty)
            scores = scores - beta * kl.sum(-1)
            penalty = beta * kl                    # the per-token in-reward penalty (token-level rewards)
            per_response = kl.sum(-1) / batch.response_mask.sum(-1).clamp(min=1)  # (B,)
            current_kl = float(per_response.mean())
            ctrl.update(current_kl, n_steps=int(kl.shape[0]))
            metrics["actor/reward_kl_penalty"] = current_kl
            metrics["actor/reward_kl_penalty_coeff"] = beta
    critic = uses_critic(cfg)
    if critic:
        t = time.perf_counter()
        with span("values"):
            batch.values = backend.compute_values(batch)
        timing["timing_s/values"] = time.perf_counter() - t
    t = time.perf_counter()
    with span("adv"):
        rewards = token_level_rewards(batch.scores, batch.response_mask, penalty)
        scores = fill_advantages(batch, alg, scores, rewards, critic)
    timing["timing_s/adv"] = time.perf_counter() - t
    metrics.update(reward_advantage_metrics(scores, batch.advantages, batch.response_mask))
    if critic:
        metrics.update(value_metrics(batch.values, batch.returns, batch.response_mask))
    return metrics


def recomputes_old_policy(cfg: FullyAsyncConfig) -> bool:
    """Whether the trainer recomputes the old policy: decoupled PPO, or verl's rollout correction in its decoupled
    mode (bypass_mode=false: weights and rejection compare the trainer's old policy with the behaviour one)."""
    from fully_async.algorithms.rollout_correction import active

    rc = cfg.algorithm.rollout_correction
    return bool(cfg.async_training.decoupled_ppo) or (active(rc) and not rc.bypass_mode)


def apply_rollout_correction(rc: Any, batch: TrainBatch) -> dict[str, float]:
    """algorithm.rollout_correction in its decoupled mode, once per step and before the advantages (as verl):
    the truncated importance weights go into the batch and rejected tokens leave its response mask."""
    from fully_async.algorithms.rollout_correction import active, correct_batch

    if not active(rc) or rc.bypass_mode:
        return {}
    weights, batch.response_mask, metrics = correct_batch(batch.old_log_probs, batch.rollout_log_probs,
                                                          batch.response_mask, rc)
    batch.rollout_is_weights = weights
    return metrics


def fill_advantages(batch: TrainBatch, alg: Any, scores: Any, rewards: Any, critic: bool) -> Any:
    """batch.advantages (and with a critic batch.returns) by algorithm.adv_estimator, from the (B,) `scores` (minus
    the in-reward KL) or the (B, T) token-level `rewards`; returns the (B,) rewards the metrics report.

    gae: the token-level rewards and the critic's batch.values (returns: the critic's targets).  The critic-free
    estimators (algorithms/advantages.py): a critic trained beside them (critic.enable=true) gets their returns
    (verl 0.9.1: the reward-to-go for reinforce_plus_plus, remax and the optimal-token-baseline estimators, the
    advantages for the others)."""
    if alg.adv_estimator == "gae":
        batch.advantages, batch.returns = gae_advantages(rewards, batch.values, batch.response_mask, alg.gamma,
                                                         alg.lam)
        return rewards.sum(-1)
    batch.advantages, returns = compute_advantages_and_returns(AdvantageInput(
        scores, rewards, batch.response_mask, batch.group_ids, old_log_probs=batch.old_log_probs,
        sum_pi_squared=batch.sum_pi_squared, rollout_is_weights=batch.rollout_is_weights,
        reward_baselines=batch.reward_baselines, reward_components=batch.reward_components), alg)
    if critic:
        batch.returns = returns
    return scores


def kl_controller(backend: TrainBackend, alg: Any) -> Any:
    """The in-reward KL controller of this trainer; it lives on the backend, which persists across steps
    (the adaptive coefficient starts again from algorithm.kl_ctrl.kl_coef when a run resumes)."""
    ctrl = getattr(backend, "kl_ctrl", None)
    if ctrl is None:
        ctrl = build_kl_controller(alg.kl_ctrl)
        backend.kl_ctrl = ctrl
    return ctrl


def reward_advantage_metrics(rewards: Any, advantages: Any, mask: Any) -> dict[str, float]:
    """verl's `critic/rewards/*` (the scores the advantages are computed from: minus the in-reward KL penalty
    when algorithm.use_kl_in_reward) and `critic/advantages/*` (over response tokens)."""
    valid = advantages[mask.bool()]
    out = {"critic/rewards/mean": float(rewards.mean()), "critic/rewards/max": float(rewards.max()),
           "critic/rewards/min": float(rewards.min())}
    if valid.numel():
        out.update({"critic/advantages/mean": float(valid.mean()), "critic/advantages/max": float(valid.max()),
                    "critic/advantages/min": float(valid.min())})
    return out


def trainer_memory_metrics(backend: Any, cfg: FullyAsyncConfig) -> dict[str, float]:
    """`memory/<job>/trainer/{weights,grads,optimizer}_gib`: what rank 0's trainer holds on its device after the
    update, tagged like the engines' arenas (`memory/<job>/rollout<i>/...`); backends without the count report
    nothing."""
    parts = getattr(backend, "memory_parts", None)
    if parts is None:
        return {}
    job = cfg.multi_job.job_name or cfg.trainer.experiment_name
    return {f"memory/{job}/trainer/{name}_gib": held / 2**30 for name, held in parts().items()}


def actor_perf_metrics(cfg: FullyAsyncConfig, seq_lens: Sequence[int], update_s: float) -> dict[str, float]:
    """`perf/mfu/actor`, `perf/max_memory_allocated_gb` and `perf/max_memory_reserved_gb`, as verl's update_actor
    reports them.

    MFU: the model FLOPs of ppo_epochs forward + backward passes over the step's sequences (prompt + response
    tokens each, flops.py) per second of update_actor, over the peak of the trainer's devices
    (trainer.nnodes x trainer.n_gpus_per_node, each trainer.device_peak_tflops or its table entry).  Not
    reported when the device's peak or the architecture's FLOPs are unknown.  Memory: rank 0's peak
    allocation and peak reservation by its allocator so far (GiB; the second is what the device lends the trainer,
    cached blocks included), accelerators only."""
    t = cfg.trainer
    out: dict[str, float] = {}
    device = _resolve_device(t.device)
    if device.is_accelerator:
        stats = device.memory_stats()
        out["perf/max_memory_allocated_gb"] = stats["max_allocated_gib"]
        out["perf/max_memory_reserved_gb"] = stats["max_reserved_gib"]
    model = cfg.actor_rollout_ref.model
    model_config, peak = _mfu_inputs(model.path, bool(model.trust_remote_code), t.device, t.device_peak_tflops)
    if model_config is None or peak is None or update_s <= 0 or not seq_lens:
        return out
    flops = estimate_flops(model_config, seq_lens, count_embedding=True)   # as verl counts: comparable curves
    if flops:
        passes = cfg.actor_rollout_ref.actor.ppo_epochs
        out["perf/mfu/actor"] = mfu(flops * passes, update_s, RunPlan.of(cfg).trainer_devices, peak)
    return out


@functools.lru_cache(maxsize=None)
def _step_counters(device: str) -> StepCounters:
    return StepCounters(_resolve_device(device))


@functools.lru_cache(maxsize=None)
def _resolve_device(name: str) -> Any:
    from fully_async.device import get_device
    return get_device(name)


@functools.lru_cache(maxsize=None)
def _mfu_inputs(model_path: str, trust_remote_code: bool, device: str,
                override: Optional[float]) -> tuple[Optional[Any], Optional[float]]:
    """(HF config of the actor, peak TFLOP/s per device), each None when MFU cannot be computed; logged once."""
    name = _resolve_device(device).device_name()
    peak = peak_tflops(name, override)
    if peak is None:
        logger.info("perf/mfu/actor not reported: no bf16 peak known for device %r; set trainer.device_peak_tflops "
                    "(TFLOP/s per device) to report it", name or "cpu")
        return None, None
    try:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - the metric is optional, training is not
        logger.warning("perf/mfu/actor not reported: cannot read the model config of %s (%s)", model_path, exc)
        return None, peak
    reason = unsupported_reason(config)
    if reason is not None:
        logger.warning("perf/mfu/actor not reported: %s", reason)
        return None, peak
    source = "trainer.device_peak_tflops" if override is not None else f"{match_device(name)} ({name})"
    logger.info("perf/mfu/actor: %s, peak %.1f TFLOP/s per device from %s",
                getattr(config, "model_type", "?"), peak, source)
    return config, peak


class BadStepsError(RuntimeError):
    pass


def check_bad_steps(backend: TrainBackend, cfg: FullyAsyncConfig, step: int, samples: list) -> None:
    """Log the batch of a skipped update; fail after trainer.max_bad_steps in a row."""
    if backend.consecutive_bad_steps == 0:
        return
    folder = os.path.join(cfg.trainer.default_local_dir, "bad_batches")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{step}.json")
    safe_write.write_json(path, [{"sample_id": s.sample_id, "reward": s.reward, "response_len": len(s.response_ids),
                                  "versions": [s.param_version_start, s.param_version_end]} for s in samples])
    logger.warning("step %d: non-finite loss or gradient, update skipped; batch logged to %s", step, path)
    if backend.consecutive_bad_steps >= cfg.trainer.max_bad_steps:
        raise BadStepsError(f"{backend.consecutive_bad_steps} consecutive optimizer steps had a NaN/inf loss or "
                            f"gradient (trainer.max_bad_steps={cfg.trainer.max_bad_steps}); last batch: {path}")


