"""The rollout-correction cases of the reference vectors (scripts/gen_verl_algo_vectors.py runs them and writes them
into tests/fixtures/verl_algo_vectors.pt under "rollout_corr" and "bypass").

verl's `compute_rollout_correction_and_rejection_mask` (rollout_corr_helper.py) runs each case on fixed inputs (old
and rollout log-probs, response mask, the options): its weights, mask and metrics are what
tests/unit/algorithms/test_rollout_correction.py replays against fully_async/algorithms/rollout_correction.py.
The bypass cases run verl's `compute_policy_loss_bypass_mode` (loss, gradient, rollout_corr/* metrics), replayed
against actor_loss in bypass mode.
"""
from __future__ import annotations

from types import ModuleType

import torch

# (name, rollout_is, rollout_is_threshold, batch_normalize, rollout_rs, rollout_rs_threshold)
CASES = [
    ("token_is", "token", 2.0, False, None, None),
    ("token_is_normalized", "token", 1.5, True, None, None),
    ("sequence_is", "sequence", 3.0, False, None, None),
    ("sequence_is_normalized", "sequence", 5.0, True, None, None),
    ("rs_token_k1", None, 2.0, False, "token_k1", "0.8_1.25"),
    ("rs_token_k1_upper_only", None, 2.0, False, "token_k1", 1.3),
    ("rs_token_k2", None, 2.0, False, "token_k2", 0.02),
    ("rs_token_k3", None, 2.0, False, "token_k3", 0.02),
    ("rs_seq_sum_k1", None, 2.0, False, "seq_sum_k1", "0.5_2.0"),
    ("rs_seq_sum_k2", None, 2.0, False, "seq_sum_k2", 0.1),
    ("rs_seq_sum_k3", None, 2.0, False, "seq_sum_k3", 0.1),
    ("rs_seq_mean_k1", None, 2.0, False, "seq_mean_k1", "0.9_1.1"),
    ("rs_seq_mean_k2", None, 2.0, False, "seq_mean_k2", 0.01),
    ("rs_seq_mean_k3", None, 2.0, False, "seq_mean_k3", 0.01),
    ("rs_seq_max_k2", None, 2.0, False, "seq_max_k2", 0.05),
    ("rs_seq_max_k3", None, 2.0, False, "seq_max_k3", 0.05),
    ("rs_two_options", None, 2.0, False, "token_k1,seq_mean_k3", "0.7_1.4,0.02"),
    ("is_and_rs", "token", 2.0, False, "seq_max_k2,token_k3", "0.05"),
]


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old, rollout, mask) (6, 9) float64: ragged responses, log-ratios mostly small, some large."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    shift = torch.randn(6, 9, generator=g, dtype=torch.float64) * 0.15
    shift[1, 2], shift[4, 0] = 1.2, -1.5          # outliers
    lengths = [9, 7, 4, 9, 1, 6]
    mask = torch.zeros(6, 9, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return rollout + shift, rollout, mask


ICEPOP_CASES = [
    ("icepop_token", "token", "0.8_1.25", False, None, None),
    ("icepop_sequence_normalized", "sequence", "0.3_3.0", True, None, None),
    ("icepop_and_rs", "token", "0.5_1.5", True, "seq_mean_k3", 0.01),
    ("sequence_is_with_rs", "sequence", 2.0, False, "token_k1", "0.7_1.4"),
]

# (name, loss_type, rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold, loss_agg_mode)
BYPASS_CASES = [
    ("ppo_clip_token_is_rs", "ppo_clip", "token", 2.0, "token_k1", "0.8_1.25", "token-mean"),
    ("ppo_clip_rs_only", "ppo_clip", None, 2.0, "seq_mean_k3", 0.01, "seq-mean-token-mean"),
    ("reinforce_sequence_is", "reinforce", "sequence", 3.0, None, None, "seq-mean-token-sum"),
    ("reinforce_icepop_rs", "reinforce", "token", "0.8_1.25", "seq_max_k2", 0.05, "token-mean"),
]


def generate(helper: ModuleType, core: ModuleType, actor: dict) -> tuple[list, list]:
    """(rollout-correction cases, bypass-mode loss cases) of verl's own functions."""
    cases = []
    for i, (name, level, thr, norm, rs, rs_thr) in enumerate(CASES + ICEPOP_CASES):
        old, rollout, mask = inputs(seed=i)
        weights, new_mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, rollout_is=level,
            rollout_is_threshold=thr, rollout_is_batch_normalize=norm, rollout_rs=rs, rollout_rs_threshold=rs_thr)
        cases.append({"name": name, "rollout_is": level, "rollout_is_threshold": thr,
                      "rollout_is_batch_normalize": norm, "rollout_rs": rs, "rollout_rs_threshold": rs_thr,
                      "old": old, "rollout": rollout, "mask": mask,
                      "weights": weights.batch["rollout_is_weights"] if weights is not None else None,
                      "new_mask": new_mask, "metrics": {k: float(v) for k, v in metrics.items()}})
    from verl.trainer.config import AlgoConfig
    from verl.workers.config import ActorConfig
    bypass = []
    for i, (name, loss_type, level, thr, rs, rs_thr, agg) in enumerate(BYPASS_CASES):
        current, rollout, mask = (t.float() for t in inputs(seed=100 + i))
        advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(i))
        rc = dict(loss_type=loss_type, rollout_is=level, rollout_is_threshold=thr, rollout_is_batch_normalize=False,
                  rollout_rs=rs, rollout_rs_threshold=rs_thr)
        config = ActorConfig(global_batch_info={}, policy_loss=AlgoConfig(rollout_correction=rc),
                             **{k: actor[k] for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high",
                                                      "clip_ratio_c")})
        logp = current.clone().requires_grad_()
        loss, metrics = core.compute_policy_loss_bypass_mode(old_log_prob=rollout, log_prob=logp,
                                                             advantages=advantages, response_mask=mask,
                                                             loss_agg_mode=agg, config=config)
        loss.backward()
        bypass.append(dict(rc, name=name, agg=agg, logp=current, rollout=rollout, mask=mask, advantages=advantages,
                           loss=loss.detach(), grad=logp.grad.detach(),
                           metrics={k: float(v) for k, v in metrics.items()}))
    return cases, bypass
