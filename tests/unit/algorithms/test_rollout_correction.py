"""Rollout correction against verl's own helper (the "rollout_corr" and "bypass" cases of
tests/fixtures/verl_algo_vectors.pt, written by scripts/gen_verl_algo_vectors.py from the release's
rollout_corr_helper.py and core_algos.py), and its place in the loss."""
import os
from types import SimpleNamespace

import pytest
import torch

from fully_async.algorithms.actor_loss import BYPASS_RS_METRIC, actor_loss, actor_metric_names
from fully_async.algorithms.rollout_correction import correct_batch, rejection_mask
from fully_async.core.config import ConfigError, PolicyLossConfig
from fully_async.core.rollout_correction_spec import is_threshold, rs_options, rs_thresholds

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "verl_algo_vectors.pt")
DATA = torch.load(FIXTURE, weights_only=True)
CASES, BYPASS = DATA["rollout_corr"], DATA["bypass"]


def rc(**kw):
    base = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs=None,
                rollout_rs_threshold=None, bypass_mode=False, loss_type="ppo_clip")
    return SimpleNamespace(**dict(base, **kw))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_weights_mask_and_metrics_match_verl(case):
    t = {k: case[k] for k in ("old", "rollout", "mask")}
    cfg = rc(**{k: case[k] for k in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize",
                                     "rollout_rs", "rollout_rs_threshold")})
    weights, mask, metrics = correct_batch(t["old"], t["rollout"], t["mask"], cfg)
    if case["weights"] is None:
        assert weights is None
    else:
        torch.testing.assert_close(weights, case["weights"], rtol=1e-12, atol=1e-12)
    assert mask.tolist() == case["new_mask"].tolist()
    assert sorted(metrics) == sorted(case["metrics"])
    for key, want in case["metrics"].items():
        assert metrics[key] == pytest.approx(want, rel=1e-9, abs=1e-12), key


def test_the_fixture_exercises_truncation_and_rejection():
    """A parity test over cases where nothing happens could not fail: the vectors truncate and reject."""
    by_name = {c["name"]: c for c in CASES}
    w = by_name["token_is"]["weights"]
    assert float(w.max()) == 2.0                                        # truncated at rollout_is_threshold
    for name in ("rs_token_k1", "rs_seq_max_k2", "rs_two_options", "icepop_and_rs"):
        c = by_name[name]
        assert 0 < c["new_mask"].sum() < c["mask"].sum(), name
    icepop = by_name["icepop_token"]                                     # IcePop zeroes some weights on the mask
    assert ((icepop["weights"] == 0) & (icepop["mask"] > 0)).any() and icepop["metrics"][
        "rollout_corr/rollout_is_oob_ratio"] > 0
    assert sum(c["metrics"].get(f"rollout_corr/{k}", 0) > 0 for c in BYPASS
               for k in ("rollout_rs_masked_fraction", "rollout_is_ratio_fraction_high")) >= 3


def test_icepop_thresholds_parse_as_verl_and_refuse_lower_above_upper():
    assert is_threshold(2) == (2.0, None) and is_threshold("0.5_5.0") == (5.0, 0.5) and is_threshold("3") == (3.0,
                                                                                                             None)
    with pytest.raises(ValueError, match=r"rollout_is_threshold='5_0.5': the lower bound 5.0 is above the upper"):
        is_threshold("5_0.5")
    for bad in ("0_2", "a_b", True, "-1"):
        with pytest.raises(ValueError, match="rollout_is_threshold"):
            is_threshold(bad)


@pytest.mark.parametrize("case", BYPASS, ids=[c["name"] for c in BYPASS])
def test_bypass_mode_loss_gradient_and_rollout_corr_metrics_match_verl(case):
    """verl's compute_policy_loss_bypass_mode: rejection, importance weights (applied by reinforce, reported by
    ppo_clip) and the rollout_corr/* metrics of the current policy against the behaviour one, in the loss."""
    a = DATA["actor"]
    actor = SimpleNamespace(**dict(vars(ACTOR), loss_agg_mode=case["agg"], clip_ratio_low=a["clip_ratio_low"],
                                   clip_ratio_high=a["clip_ratio_high"], clip_ratio_c=a["clip_ratio_c"]))
    cfg = rc(bypass_mode=True, **{k: case[k] for k in ("loss_type", "rollout_is", "rollout_is_threshold",
                                                      "rollout_rs", "rollout_rs_threshold")})
    logp = case["logp"].clone().requires_grad_(True)
    out = actor_loss(logp, None, old_logp=case["rollout"], advantages=case["advantages"], mask=case["mask"],
                     denom=None, rows_total=len(logp), actor=actor, async_training=AT, rollout_logp=case["rollout"],
                     rollout_correction=cfg)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), case["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp.grad, case["grad"], rtol=1e-5, atol=1e-6)
    assert list(out.metrics) == actor_metric_names(actor, AT, with_entropy=False, rollout_correction=cfg)
    ours = out.metric_floats()
    corr = {k: v for k, v in case["metrics"].items() if k.startswith("rollout_corr/")}
    assert sorted(k for k in ours if k.startswith("rollout_corr/")) == sorted(corr)
    for key, want in case["metrics"].items():
        assert ours[key] == pytest.approx(want, rel=1e-4, abs=1e-6), key


def test_invalid_options_and_thresholds_name_the_key():
    with pytest.raises(ValueError, match="rollout_rs: 'seq_max_k1'"):
        rs_options("token_k1,seq_max_k1")
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        rs_thresholds(["token_k2"], "0.5_2")          # k2 takes one upper bound
    with pytest.raises(ValueError, match="one threshold for all 2"):
        rs_thresholds(["token_k1", "token_k2"], "1.5,2,3")
    assert rs_thresholds(["token_k1", "seq_sum_k3"], 2) == {"token_k1": (0.5, 2.0), "seq_sum_k3": (None, 2.0)}
    assert issubclass(ConfigError, ValueError)


def loss_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 5, generator=g)
    return dict(old_logp=logp - 0.05 * torch.randn(3, 5, generator=g), advantages=torch.randn(3, 5, generator=g),
                mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)), logp


ACTOR = SimpleNamespace(entropy_coeff=0.0, use_kl_loss=False, clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                        clip_ratio_c=3.0, loss_agg_mode="token-mean", kl_loss_type="low_var_kl", kl_loss_coef=0.0,
                        policy_loss=PolicyLossConfig(), tau_pos=1.0, tau_neg=1.05)
AT = SimpleNamespace(decoupled_ppo=False, behav_imp_weight_cap=5.0)


def test_importance_weights_multiply_the_surrogate_per_token():
    d, logp = loss_inputs()
    plain = actor_loss(logp, None, denom=None, rows_total=3, actor=ACTOR, async_training=AT, **d)
    weights = torch.full((3, 5), 0.5)
    weighted = actor_loss(logp, None, denom=None, rows_total=3, actor=ACTOR, async_training=AT, is_weights=weights,
                          **d)
    torch.testing.assert_close(weighted.loss, 0.5 * plain.loss)


def test_rollout_is_weights_replace_decoupled_ppos_own_as_verls_compute_prox_log_prob():
    d, logp = loss_inputs(seed=2)
    rollout = d["old_logp"] - 0.3                      # behaviour != proximal: decoupled PPO would weight by e^0.3
    decoupled = SimpleNamespace(decoupled_ppo=True, behav_imp_weight_cap=5.0)
    cfg = rc(rollout_is="token", rollout_is_threshold=2.0)
    weights = torch.full((3, 5), 0.7)                  # rollout correction's (computed once per step)
    out = actor_loss(logp, None, denom=None, rows_total=3, actor=ACTOR, async_training=decoupled,
                     rollout_logp=rollout, is_weights=weights, rollout_correction=cfg, **d)
    want = actor_loss(logp, None, denom=None, rows_total=3, actor=ACTOR, async_training=AT, is_weights=weights, **d)
    torch.testing.assert_close(out.loss, want.loss)    # weighted once, by rollout correction
    assert list(out.metrics) == actor_metric_names(ACTOR, decoupled, with_entropy=False, rollout_correction=cfg)
    assert "actor/behav_imp_weight" not in out.metrics
    alone = actor_loss(logp, None, denom=None, rows_total=3, actor=ACTOR, async_training=decoupled,
                       rollout_logp=rollout, rollout_correction=rc(), **d)   # without rollout_is: its own weights
    assert "actor/behav_imp_weight" in alone.metrics and not torch.allclose(alone.loss, want.loss)


@pytest.mark.parametrize("level", [None, "token", "sequence"])
def test_bypass_reinforce_is_verls_importance_weighted_policy_gradient(level):
    from fully_async.algorithms.rollout_correction import is_weights

    d, logp = loss_inputs(seed=3)
    logp = logp.clone().requires_grad_(True)
    rollout = d["old_logp"]                           # bypass: the behaviour log-probs are the old policy
    cfg = rc(bypass_mode=True, loss_type="reinforce", rollout_is=level, rollout_is_threshold=1.5)
    out = actor_loss(logp, None, denom=None, rows_total=3, actor=ACTOR, async_training=AT, rollout_logp=rollout,
                     rollout_correction=cfg, **d)
    # verl core_algos.compute_policy_loss_reinforce: -A * log_prob * w, agg_loss; w from
    # compute_rollout_correction_and_rejection_mask(old=current (detached), rollout) in the loss
    w = is_weights(logp.detach() - rollout, d["mask"], level, 1.5)[0] if level else torch.ones_like(logp)
    want = (-d["advantages"] * logp * w * d["mask"]).sum() / d["mask"].sum()      # token-mean
    torch.testing.assert_close(out.loss, want)
    kl = ((rollout - logp.detach()) * d["mask"]).sum() / d["mask"].sum()
    assert out.metric_floats()["actor/ppo_kl"] == pytest.approx(float(kl), rel=1e-5)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, -d["advantages"] * w * d["mask"] / d["mask"].sum())   # no clipping


def test_bypass_rejection_drops_tokens_against_the_current_policy_in_the_loss():
    d, logp = loss_inputs(seed=1)
    rollout = logp.clone()
    rollout[0, 1] -= 2.0                     # one token far off: exp(2) > upper 1.5
    cfg = rc(bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold=1.5)
    out = actor_loss(logp, None, denom=float(d["mask"].sum()), rows_total=3, actor=ACTOR, async_training=AT,
                     rollout_logp=rollout, rollout_correction=cfg, **d)
    kept, _ = rejection_mask(logp - rollout, d["mask"], "token_k1", 1.5)
    assert kept[0, 1] == 0 and kept.sum() == d["mask"].sum() - 1
    want = actor_loss(logp, None, denom=float(d["mask"].sum()), rows_total=3, actor=ACTOR, async_training=AT,
                      **dict(d, mask=kept))
    torch.testing.assert_close(out.loss, want.loss)
    names = actor_metric_names(ACTOR, AT, with_entropy=False, rollout_correction=cfg)
    assert list(out.metrics) == names and BYPASS_RS_METRIC in names
    assert out.metric_floats()[BYPASS_RS_METRIC] == pytest.approx(1 / float(d["mask"].sum()))
