"""Our advantage estimators and policy-loss modes against verl's own core_algos, on the vectors
scripts/gen_verl_algo_vectors.py wrote by running the functions of a verl release (its version in the fixture):
advantages and returns, the aggregated loss under every loss_agg_mode, its gradient with respect to the current
log-probs, and the metrics verl reports."""
import os
from types import SimpleNamespace

import pytest
import torch

from fully_async.algorithms import (AdvantageInput, compute_advantages, compute_advantages_and_returns,
                                   token_level_rewards)
from fully_async.algorithms.advantages import ESTIMATORS
from fully_async.algorithms.policy_losses import POLICY_LOSSES, PolicyLossInput, policy_loss
from fully_async.core.config import ADV_ESTIMATORS, POLICY_LOSS_MODES

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures",
                       "verl_algo_vectors.pt")
DATA = torch.load(FIXTURE, weights_only=True)
METRICS = {"actor/pg_clipfrac": "clipfrac", "actor/pg_clipfrac_lower": "clipfrac_lower", "actor/ppo_kl": "ppo_kl"}


def test_registries_are_the_configs_valid_values_and_all_are_pinned():
    # gae needs the critic's values (algorithms/gae.py, its own parity test: tests/unit/algorithms/test_gae.py)
    assert DATA["verl_version"] == "0.9.1"
    assert set(ESTIMATORS) == set(ADV_ESTIMATORS) - {"gae"} == ({c["estimator"] for c in DATA["advantages"]}
                                                                | {c["estimator"] for c in DATA["otb"]} | {"gdpo"})
    assert set(POLICY_LOSSES) == set(POLICY_LOSS_MODES) == {c["mode"] for c in DATA["losses"]}


def _adv_id(case):
    return (f"{case['estimator']}-{case['inputs']}-norm{case['norm']}-gamma{case['gamma']}-f{case['f_norm']}-"
            f"kl{case['kl']}")


@pytest.mark.parametrize("case", DATA["advantages"], ids=_adv_id)
def test_advantages_match_verl(case):
    inp = DATA["advantage_inputs"][case["inputs"]]
    rewards = inp["token_rewards_kl"] if case["kl"] else inp["token_rewards"]
    alg = SimpleNamespace(adv_estimator=case["estimator"], norm_adv_by_std_in_grpo=case["norm"], gamma=case["gamma"],
                          gpg_f_norm=case["f_norm"])
    ours, returns = compute_advantages_and_returns(AdvantageInput(
        rewards.sum(-1), rewards, inp["mask"], inp["group_ids"],
        reward_baselines=inp["reward_baselines"]), alg)
    torch.testing.assert_close(ours, case["advantages"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(returns, case["returns"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", DATA["gdpo"], ids=lambda c: f"{c['inputs']}-w{c['weights']}-norm{c['norm']}")
def test_gdpo_matches_verl(case):
    """Each reward component normalised in its group, weighted, summed and whitened (verl's trainer call: the
    components from the reward function's dict)."""
    inp = DATA["advantage_inputs"][case["inputs"]]
    alg = SimpleNamespace(adv_estimator="gdpo", norm_adv_by_std_in_grpo=case["norm"],
                          gdpo_reward_weights=case["weights"])
    ours, returns = compute_advantages_and_returns(AdvantageInput(
        inp["scores"], inp["token_rewards"], inp["mask"], inp["group_ids"], reward_components=inp["components"]), alg)
    torch.testing.assert_close(ours, case["advantages"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(returns, ours)


@pytest.mark.parametrize("case", DATA["otb"],
                         ids=lambda c: f"{c['estimator']}-{c['inputs']}-w{c['weighted']}-tail{c['zero_tail']}")
def test_optimal_token_baselines_match_verl(case):
    """Per-timestep baselines from old log-probs and sum pi^2 (with and without rollout-correction weights; masks
    with holes: the multi-turn variant compacts each response's own tokens)."""
    inp = DATA["otb_inputs"][case["inputs"]]
    rewards = inp["token_rewards_kl"] * inp["mask"]
    alg = SimpleNamespace(adv_estimator=case["estimator"], handle_zero_tail=case["zero_tail"])
    ours, returns = compute_advantages_and_returns(AdvantageInput(
        rewards.sum(-1), rewards, inp["mask"], inp["group_ids"], old_log_probs=inp["old_log_probs"],
        sum_pi_squared=inp["sum_pi_squared"],
        rollout_is_weights=inp["rollout_is_weights"] if case["weighted"] else None), alg)
    torch.testing.assert_close(ours, case["advantages"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(returns, case["returns"], rtol=1e-5, atol=1e-6)


def _loss_id(case):
    return f"{case['mode']}-{case['agg']}-{'weighted' if case['weighted'] else 'plain'}"


@pytest.mark.parametrize("case", DATA["losses"], ids=_loss_id)
def test_policy_losses_match_verl(case):
    d, a = DATA["loss_inputs"], DATA["actor"]
    logp = d["logp"].clone().requires_grad_()
    torch.manual_seed(case["seed"])                                    # clip_cov draws from torch's global RNG
    out = policy_loss(PolicyLossInput(
        logp=logp, old_logp=d["old_logp"], advantages=d["advantages"], mask=d["mask"], clip_low=a["clip_ratio_low"],
        clip_high=a["clip_ratio_high"], clip_c=a["clip_ratio_c"], agg_mode=case["agg"],
        behav_logp=d["behav_logp"] if case["weighted"] else None, behav_cap=DATA["behav_cap"], mode=case["mode"],
        clip_cov_ratio=a["clip_cov_ratio"], clip_cov_lb=a["clip_cov_lb"], clip_cov_ub=a["clip_cov_ub"],
        kl_cov_ratio=a["kl_cov_ratio"], ppo_kl_coef=a["ppo_kl_coef"], tau_pos=a["tau_pos"], tau_neg=a["tau_neg"],
        dro_beta=a["dro_beta"]))
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), case["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp.grad, case["grad"], rtol=1e-5, atol=1e-6)
    for key, value in case["metrics"].items():
        assert getattr(out, METRICS[key]).item() == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert (out.behav_weight_mean is not None) == case["weighted"]


def test_the_covariance_and_trust_region_modes_act_on_the_fixture():
    """The fixture's clip_cov cases detach some tokens, its kl_cov cases penalise some, the DPPO cases leave some
    tokens out, the multi-turn and zero-tail cases differ from their plain forms, and the
    returns differ from the advantages where verl's do (not vacuous)."""
    by = {(c["mode"], c["agg"], c["weighted"]): c for c in DATA["losses"]}
    for mode in ("dppo_tv", "dppo_kl"):
        assert 0 < by[(mode, "token-mean", False)]["metrics"]["actor/pg_clipfrac"] < 1
    otb = {(c["estimator"], c["inputs"], c["weighted"], c["zero_tail"]): c["advantages"] for c in DATA["otb"]}
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        assert not torch.equal(otb[(name, "otb", False, True)], otb[(name, "otb", False, False)])
    rpp = {(c["inputs"], c["gamma"], c["kl"]): c for c in DATA["advantages"] if c["estimator"] == "reinforce_plus_plus"}
    assert not torch.equal(rpp[("groups_holes", 0.9, True)]["returns"], rpp[("groups_holes", 0.9, True)]["advantages"])
    assert by[("clip_cov", "token-mean", False)]["metrics"]["actor/pg_clipfrac"] > 0
    kl_cov = by[("kl_cov", "token-mean", False)]["loss"]
    assert not torch.allclose(kl_cov, by[("vanilla", "token-mean", False)]["loss"])


def test_token_level_rewards_put_the_score_on_the_last_response_token():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    penalty = 0.1 * mask
    out = token_level_rewards(torch.tensor([2.0, 5.0, -1.0]), mask, penalty)
    expected = torch.tensor([[0.0, -0.1, 1.9, 0.0], [0.0, 0.0, 0.0, 0.0], [-0.1, 0.0, -0.1, -1.1]])
    torch.testing.assert_close(out, expected)


def test_reinforce_plus_plus_ignores_the_prompt_in_front_of_the_response():
    """Our rows carry the prompt before the response (mask 0 there): the returns restart at it, so the advantages
    on the response tokens are those of verl's response-only layout."""
    inp = DATA["advantage_inputs"]["groups"]
    alg = SimpleNamespace(adv_estimator="reinforce_plus_plus", norm_adv_by_std_in_grpo=True, gamma=0.9)
    rewards, mask = inp["token_rewards_kl"], inp["mask"]
    alone = compute_advantages(AdvantageInput(rewards.sum(-1), rewards, mask, inp["group_ids"]), alg)
    pad = torch.zeros(mask.shape[0], 3)
    prefixed = compute_advantages(AdvantageInput(rewards.sum(-1), torch.cat([pad, rewards], -1),
                                                 torch.cat([pad, mask], -1), inp["group_ids"]), alg)
    torch.testing.assert_close(prefixed[:, 3:], alone)
    assert not prefixed[:, :3].any()


def test_grpo_passk_refuses_a_group_of_one():
    inp = DATA["advantage_inputs"]["with_singleton"]
    alg = SimpleNamespace(adv_estimator="grpo_passk", norm_adv_by_std_in_grpo=True, gamma=1.0)
    with pytest.raises(ValueError, match="at least 2 responses"):
        compute_advantages(AdvantageInput(inp["scores"], inp["token_rewards"], inp["mask"], inp["group_ids"]), alg)
    with pytest.raises(ValueError, match="adv_estimator 'bogus'"):
        compute_advantages(AdvantageInput(inp["scores"], inp["token_rewards"], inp["mask"], inp["group_ids"]),
                           SimpleNamespace(adv_estimator="bogus"))
    with pytest.raises(ValueError, match="greedy baseline reward"):   # remax without its baselines
        compute_advantages(AdvantageInput(inp["scores"], inp["token_rewards"], inp["mask"], inp["group_ids"]),
                           SimpleNamespace(adv_estimator="remax"))
