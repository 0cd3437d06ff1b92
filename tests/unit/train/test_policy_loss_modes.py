"""Every policy-loss mode through the one PPO update on the tiny model: the mini-batch's loss is the same whole,
cut into micro-batches, or packed (use_remove_padding) into token-budget micro-batches, with decoupled PPO's
behaviour weights on; the covariance modes (which select tokens per micro-batch, as verl's) run and stay finite."""
import math

import pytest
import torch

from test_torch_backend import updated_weights

COMMON = ["async_training.decoupled_ppo=true", "async_training.use_rollout_log_probs=false",
          "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01",
          "algorithm.adv_estimator=rloo"]
PACKED = ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
          "data.max_prompt_length=8", "data.max_response_length=8", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20"]


@pytest.mark.parametrize("mode,agg", [("gspo", "token-mean"), ("sapo", "token-sum"), ("gpg", "seq-mean-token-sum"),
                                      ("geo_mean", "token-mean"), ("cispo", "seq-mean-token-mean")])
def test_micro_batched_and_packed_updates_match_the_whole_mini_batch(random_model_dir, mode, agg):
    common = [*COMMON, f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}",
              f"actor_rollout_ref.actor.loss_agg_mode={agg}"]
    _, m_full = updated_weights(random_model_dir, *common)
    _, m_micro = updated_weights(random_model_dir, *common, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    _, m_packed = updated_weights(random_model_dir, *common, *PACKED)
    assert m_full["actor/behav_imp_weight"] > 0
    # the loss terms and the gradient norm (before clipping) catch a wrong normalisation; the weights after one
    # Adam step would not (its first step is ~lr * sign(grad), whatever the gradient's scale)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert m_micro[key] == pytest.approx(m_full[key], rel=1e-4, abs=1e-6), key
        assert m_packed[key] == pytest.approx(m_full[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_covariance_modes_train_packed(random_model_dir, mode):
    before, _ = updated_weights(random_model_dir, *COMMON, "actor_rollout_ref.actor.ppo_epochs=0")
    after, metrics = updated_weights(random_model_dir, *COMMON, *PACKED,
                                     f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}")
    assert all(math.isfinite(v) for v in metrics.values()) and metrics["actor/bad_steps"] == 0
    assert any(not torch.equal(before[n], after[n]) for n in before)
