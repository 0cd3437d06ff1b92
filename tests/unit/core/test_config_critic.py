"""The critic section (algorithm.adv_estimator=gae): verl's keys and defaults, and what config_checks refuses."""
import pytest

from fully_async.core.config import ConfigError, typed_config, uses_critic
from fully_async.core.config_checks import validate
from fully_async.run.hydra_setup import load_config

GAE = ["algorithm.adv_estimator=gae"]


def test_gae_is_valid_and_the_critic_follows_the_actors_keys_as_in_verl():
    cfg = load_config([*GAE, "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_epochs=2",
                       "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                       "critic.ppo_max_token_len_per_gpu=999"])
    validate(cfg)
    c = typed_config(cfg).critic
    assert uses_critic(cfg) and c.enable is None and c.optim.lr == 1e-5 and c.cliprange_value == 0.5
    assert (c.ppo_mini_batch_size, c.ppo_epochs, c.loss_agg_mode) == (4, 2, "seq-mean-token-mean")
    assert c.forward_max_token_len_per_gpu == 999   # verl's ${.ppo_max_token_len_per_gpu}


def test_no_critic_without_gae_unless_enabled():
    assert not uses_critic(load_config([]))
    assert uses_critic(load_config(["critic.enable=true"]))


@pytest.mark.parametrize("overrides,key,words", [
    (["algorithm.adv_estimator=bogus"], "algorithm.adv_estimator", "'gae'"),
    (["trainer.critic_warmup=2"], "trainer.critic_warmup", "no critic to warm up"),
    ([*GAE, "critic.enable=false"], "critic.enable", "needs a value model"),
    ([*GAE, "algorithm.gamma=1.5"], "algorithm.gamma", "[0, 1]"),
    ([*GAE, "algorithm.lam=-0.1"], "algorithm.lam", "[0, 1]"),
    ([*GAE, "trainer.critic_warmup=-1"], "trainer.critic_warmup", ">= 0"),
    ([*GAE, "critic.ppo_epochs=0"], "critic.ppo_epochs", ">= 1"),
    ([*GAE, "critic.loss_agg_mode=mean"], "critic.loss_agg_mode", "token-mean"),
    ([*GAE, "critic.optim.lr_scheduler_type=wsd"], "critic.optim.lr_scheduler_type", "cosine"),
    ([*GAE, "critic.cliprange_value=-1"], "critic.cliprange_value", ">= 0"),
    ([*GAE, "critic.ppo_micro_batch_size_per_gpu=0"], "critic.ppo_micro_batch_size_per_gpu", ">= 1"),
    ([*GAE, "critic.strategy=megatron"], "critic.strategy", "both are megatron or neither is"),
    ([*GAE, "actor_rollout_ref.actor.strategy=megatron"], "critic.strategy", "set critic.strategy=megatron"),
    ([*GAE, "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=8"], "critic.ppo_max_token_len_per_gpu",
     "cannot hold one sequence"),
])
def test_bad_critic_values_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        validate(load_config(overrides))
    assert err.value.key == key and words in str(err.value)


def test_verls_gae_spellings_translate():
    """A verl PPO script's critic keys: honoured, mapped, or warned (no effect), none refused at their defaults."""
    cfg = load_config([*GAE, "critic.optim.lr=2e-5", "critic.model.path=null", "critic.optim.clip_grad=0.5",
                       "critic.ppo_micro_batch_size=null", "critic.model.use_remove_padding=true",
                       "critic.model.fsdp_config.param_offload=false", "trainer.critic_warmup=1",
                       "algorithm.gamma=0.99", "algorithm.lam=0.95"])
    validate(cfg)
    assert (cfg.critic.optim.lr, cfg.critic.grad_clip, cfg.trainer.critic_warmup) == (2e-5, 0.5, 1)
    assert (cfg.algorithm.gamma, cfg.algorithm.lam) == (0.99, 0.95)


def test_critic_keys_without_a_critic_are_warned_as_inert():
    from fully_async.core.config_checks import inert_overrides

    overrides = ["critic.optim.lr=1e-4"]
    assert inert_overrides(load_config(overrides), overrides) == [
        "critic.optim.lr has no effect: algorithm.adv_estimator=grpo trains no critic: critic.* is read only with "
        "adv_estimator=gae or critic.enable=true"]
    assert inert_overrides(load_config([*GAE, *overrides]), overrides) == []
