"""The estimator and policy-loss keys: bad values are ConfigErrors naming the key and the valid values (before any
work), parameters of another loss mode are warned as inert, and the PPO update hands each micro-batch the
denominator of the loss mode's own aggregation."""
import pytest
import torch

from fully_async.core.config import ADV_ESTIMATORS, POLICY_LOSS_MODES, ConfigError
from fully_async.core.config_checks import inert_overrides, validate
from fully_async.run.hydra_setup import load_config


def check(*overrides):
    validate(load_config(list(overrides)))


@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
def test_every_estimator_validates(estimator):
    from fully_async.core.config import OTB_ESTIMATORS
    # the optimal-token-baseline estimators read the actor's sum_pi_squared, asked for as verl asks for it
    extra = ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"] if estimator in OTB_ESTIMATORS else []
    extra += ["algorithm.gdpo_reward_keys=[score,acc]"] * (estimator == "gdpo")   # gdpo: the components it reads
    check(f"algorithm.adv_estimator={estimator}", *extra)


@pytest.mark.parametrize("mode", POLICY_LOSS_MODES)
def test_every_loss_mode_validates(mode):
    extra = ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"] * (mode == "dro")
    check(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", *extra)


@pytest.mark.parametrize("overrides,key,says", [
    (["algorithm.adv_estimator=bogus"], "algorithm.adv_estimator", "rloo_vectorized"),
    (["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.strategy=megatron"], "critic.strategy",
     "critic.strategy=megatron"),
    (["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n", "n >= 2"),
    (["algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n",
     "reinforce_plus_plus"),
    (["algorithm.gamma=0.9"], "algorithm.gamma", "reinforce_plus_plus"),
    (["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=1.5"], "algorithm.gamma", "[0, 1]"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=ppo"], "actor_rollout_ref.actor.policy_loss.loss_mode",
     "clip_cov"),
    (["actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0"], "actor_rollout_ref.actor.policy_loss.clip_cov_ratio",
     "(0, 1]"),
    (["actor_rollout_ref.actor.policy_loss.clip_cov_lb=6"], "actor_rollout_ref.actor.policy_loss.clip_cov_lb",
     "clip_cov_ub"),
    (["actor_rollout_ref.actor.policy_loss.kl_cov_ratio=2"], "actor_rollout_ref.actor.policy_loss.kl_cov_ratio",
     "(0, 1]"),
    (["actor_rollout_ref.actor.tau_neg=0"], "actor_rollout_ref.actor.tau_neg", "> 0"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=dro"], "actor_rollout_ref.actor.policy_loss.dro_beta",
     "positive"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=dro", "actor_rollout_ref.actor.policy_loss.dro_beta=-1"],
     "actor_rollout_ref.actor.policy_loss.dro_beta", "dro_beta=0.1"),
    (["algorithm.adv_estimator=gdpo"], "algorithm.gdpo_reward_keys", "required"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[score,acc]", "algorithm.gdpo_reward_weights=[1]"],
     "algorithm.gdpo_reward_weights", "one weight per key"),
    (["algorithm.adv_estimator=gpg", "algorithm.gpg_f_norm=0"], "algorithm.gpg_f_norm", "non-zero"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold='5_0.5'"],
     "algorithm.rollout_correction.rollout_is_threshold", "lower bound 5.0 is above the upper bound 0.5"),
])
def test_bad_values_name_the_key_and_what_is_valid(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        check(*overrides)
    assert err.value.key == key and says in str(err.value)


def test_one_response_per_prompt_is_fine_for_reinforce_plus_plus_only():
    check("algorithm.adv_estimator=reinforce_plus_plus", "actor_rollout_ref.rollout.n=1", "algorithm.gamma=0.99")


def test_another_modes_parameters_are_warned_as_inert():
    overrides = ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                 "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.001", "actor_rollout_ref.actor.tau_pos=2",
                 "actor_rollout_ref.actor.clip_ratio_c=4", "actor_rollout_ref.actor.clip_ratio_high=0.3"]
    found = inert_overrides(load_config(overrides), overrides)
    assert [f.split(" ")[0] for f in found] == ["actor_rollout_ref.actor.policy_loss.clip_cov_ratio",
                                                "actor_rollout_ref.actor.tau_pos",
                                                "actor_rollout_ref.actor.clip_ratio_c"]
    sapo = ["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_pos=2"]
    assert inert_overrides(load_config(sapo), sapo) == []
    dppo = ["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_kl", "actor_rollout_ref.actor.clip_ratio_c=20",
            "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"]   # DPPO's ratio truncation is clip_ratio_c
    assert [f.split(" ")[0] for f in inert_overrides(load_config(dppo), dppo)] == [
        "actor_rollout_ref.actor.policy_loss.dro_beta"]


@pytest.mark.parametrize("mode,agg,expected", [
    ("vanilla", "token-mean", 7.0), ("gspo", "token-mean", 7.0), ("gspo", "seq-mean-token-mean", 3.0),
    ("sapo", "token-sum", 3.0), ("dro", "token-sum", 1.0),
    ("geo_mean", "token-mean", 4.0), ("cispo", "seq-mean-token-sum", 3.0)])
def test_the_policy_denominator_follows_the_modes_own_aggregation(mode, agg, expected):
    from types import SimpleNamespace

    from fully_async.algorithms.actor_loss import mini_batch_policy_denominator
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    actor = SimpleNamespace(policy_loss=SimpleNamespace(loss_mode=mode), loss_agg_mode=agg, loss_scale_factor=None)
    assert mini_batch_policy_denominator(mask, actor) == expected
