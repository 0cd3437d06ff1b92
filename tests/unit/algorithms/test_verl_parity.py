"""Our advantage estimators and policy-loss modes against verl's own core_algos, on the vectors
scripts/gen_verl_algo_vectors.py wrote by running verl's functions (pinned commit in the fixture): advantages,
the aggregated loss, its gradient with respect to the current log-probs, and the metrics verl reports."""
import os
from types import SimpleNamespace

import pytest
import torch

from fully_async.algorithms import AdvantageInput, compute_advantages, token_level_rewards
from fully_async.algorithms.advantages import ESTIMATORS
from fully_async.algorithms.policy_losses import POLICY_LOSSES, PolicyLossInput, policy_loss
from fully_async.core.config import ADV_ESTIMATORS, POLICY_LOSS_MODES

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures",
                       "verl_algo_vectors.pt")
DATA = torch.load(FIXTURE, weights_only=True)
METRICS = {"actor/pg_clipfrac": "clipfrac", "actor/pg_clipfrac_lower": "clipfrac_lower", "actor/ppo_kl": "ppo_kl"}


def test_registries_are_the_configs_valid_values_and_all_are_pinned():
    # gae needs the critic's values (algorithms/gae.py, its own parity test: tests/unit/algorithms/test_gae.py)
    assert set(ESTIMATORS) == set(ADV_ESTIMATORS) - {"gae"} == ({c["estimator"] for c in DATA["advantages"]}
                                                                | {c["estimator"] for c in DATA["otb"]})
    assert set(POLICY_LOSSES) == set(POLICY_LOSS_MODES) == {c["mode"] for c in DATA["losses"]}


def _adv_id(case):
    return f"{case['estimator']}-{case['inputs']}-norm{case['norm']}-gamma{case['gamma']}-kl{case['kl']}"


@pytest.mark.parametrize("case", DATA["advantages"], ids=_adv_id)
def test_advantages_match_verl(case):
    inp = DATA["advantage_inputs"][case["inputs"]]
    rewards = inp["token_rewards_kl"] if case["kl"] else inp["token_rewards"]
    alg = SimpleNamespace(adv_estimator=case["estimator"], norm_adv_by_std_in_grpo=case["norm"], gamma=case["gamma"])
    ours = compute_advantages(AdvantageInput(rewards.sum(-1), rewards, inp["mask"], inp["group_ids"],
                                             reward_baselines=inp["reward_baselines"]), alg)
    torch.testing.assert_close(ours, case["advantages"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", DATA["otb"], ids=lambda c: f"{c['estimator']}-{c['inputs']}-w{c['weighted']}")
def test_optimal_token_baselines_match_verl(case):
    """Per-timestep baselines from old log-probs and sum pi^2 (with and without rollout-correction weights; masks
    with holes: the multi-turn variant compacts each response's own tokens)."""
    inp = DATA["otb_inputs"][case["inputs"]]
    rewards = inp["token_rewards_kl"] * inp["mask"]
    alg = SimpleNamespace(adv_estimator=case["estimator"])
    ours = compute_advantages(AdvantageInput(
        rewards.sum(-1), rewards, inp["mask"], inp["group_ids"], old_log_probs=inp["old_log_probs"],
        sum_pi_squared=inp["sum_pi_squared"],
        rollout_is_weights=inp["rollout_is_weights"] if case["weighted"] else None), alg)
    torch.testing.assert_close(ours, case["advantages"], rtol=1e-5, atol=1e-6)


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
        kl_cov_ratio=a["kl_cov_ratio"], ppo_kl_coef=a["ppo_kl_coef"], tau_pos=a["tau_pos"], tau_neg=a["tau_neg"]))
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), case["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp.grad, case["grad"], rtol=1e-5, atol=1e-6)
    for key, value in case["metrics"].items():
        assert getattr(out, METRICS[key]).item() == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert (out.behav_weight_mean is not None) == case["weighted"]


def test_the_covariance_modes_act_on_the_fixture():
    """The fixture's clip_cov cases detach some tokens and its kl_cov cases penalise some (not vacuous)."""
    by = {(c["mode"], c["agg"], c["weighted"]): c for c in DATA["losses"]}
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


def test_the_fixture_is_what_the_script_writes_from_verl(tmp_path):
    """Regenerating from the pinned verl mirror gives the committed vectors (skipped where the mirror is absent)."""
    import subprocess
    import sys

    git_dir = "/work/.mirror/volcengine+verl/repo"
    if not os.path.isdir(git_dir):
        pytest.skip(f"no verl mirror at {git_dir}")
    root = os.path.dirname(os.path.dirname(FIXTURE))
    out = tmp_path / "vectors.pt"
    subprocess.run([sys.executable, os.path.join(os.path.dirname(root), "scripts", "gen_verl_algo_vectors.py"),
                    "--git-dir", git_dir, "--commit", DATA["verl_commit"], "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    fresh = torch.load(out, weights_only=True)
    assert [c["estimator"] for c in fresh["advantages"]] == [c["estimator"] for c in DATA["advantages"]]
    for new, old in zip(fresh["advantages"] + fresh["losses"] + fresh["otb"],
                        DATA["advantages"] + DATA["losses"] + DATA["otb"]):
        for key in ("advantages", "loss", "grad"):
            if key in old:
                assert torch.equal(new[key], old[key]), key
