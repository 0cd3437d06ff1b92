"""PPO with a critic (algorithm.adv_estimator=gae) on the torch backend: values, the critic's update, warm-up,
micro-batching, checkpoint and resume of the critic with the actor."""
import pytest
import torch

from fully_async.core.batch import build_batch
from fully_async.train.ppo_update import critic_update
from fully_async.train.train_step import prepare_batch, train_step
from test_torch_backend import backend_for, make_samples
from test_train_step import as_groups

GAE = ["algorithm.adv_estimator=gae", "critic.optim.lr=0.01", "critic.ppo_mini_batch_size=2"]


def critic_weights(backend):
    return {k: v.detach().clone() for k, v in backend.critic.model.named_parameters()}


def test_values_live_on_response_tokens_and_read_the_state_before_each_token(random_model_dir):
    """The value of response token t is the head's output at t - 1 (verl's values[:, -R-1:-1]), 0 elsewhere."""
    cfg, backend = backend_for(random_model_dir, *GAE)
    samples = make_samples()
    batch = build_batch(samples)
    values = backend.compute_values(batch)
    assert values.shape == batch.input_ids.shape
    assert (values[batch.response_mask == 0] == 0).all()
    s = samples[0]
    with torch.no_grad():
        head = backend.critic.model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, :, 0]
    first = len(s.prompt_ids)
    assert values[0, first:first + len(s.response_ids)] == pytest.approx(
        head[first - 1:first - 1 + len(s.response_ids)].tolist(), abs=1e-5)


def test_the_critic_update_lowers_the_value_loss_on_a_fixed_batch(random_model_dir):
    cfg, backend = backend_for(random_model_dir, *GAE, "critic.cliprange_value=100")
    batch = build_batch(make_samples())
    prepare_batch(backend, cfg, batch, {})
    before = critic_weights(backend)
    losses = []
    for _ in range(8):
        batch.values = backend.compute_values(batch)  # the old values move with the critic; the returns stay
        metrics = critic_update(backend, cfg, batch, num_mini_batches=1)
        losses.append(metrics["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0], losses
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm",
            "critic/lr"} <= set(metrics)
    assert metrics["critic/lr"] == pytest.approx(0.01)
    assert any((before[k] != v).any() for k, v in critic_weights(backend).items())


def test_micro_batches_give_the_whole_mini_batchs_critic_update(random_model_dir):
    def run(*extra):
        cfg, backend = backend_for(random_model_dir, *GAE, *extra)
        batch = build_batch(make_samples())
        prepare_batch(backend, cfg, batch, {})
        return critic_update(backend, cfg, batch, num_mini_batches=1), critic_weights(backend)

    m_full, w_full = run()
    m_micro, w_micro = run("critic.ppo_micro_batch_size_per_gpu=2")
    assert m_full["critic/vf_loss"] == pytest.approx(m_micro["critic/vf_loss"], rel=1e-5)
    assert all(torch.allclose(w_full[k], w_micro[k], atol=1e-4) for k in w_full)


def test_a_gae_step_trains_both_and_reports_verls_metrics(random_model_dir, tmp_path):
    cfg, backend = backend_for(random_model_dir, *GAE, f"trainer.default_local_dir={tmp_path}")
    actor_before = {k: v.detach().clone() for k, v in backend.model.named_parameters()}
    metrics, _ = train_step(backend, cfg, as_groups(make_samples()), 0, step=1, version=0)
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/values/mean", "critic/returns/mean",
                "critic/vf_explained_var", "critic/advantages/mean", "actor/pg_loss", "timing_s/values",
                "timing_s/update_critic"):
        assert key in metrics, key
    assert any((actor_before[k] != v).any() for k, v in backend.model.named_parameters())


def test_critic_warmup_holds_the_actor_back_until_its_step(random_model_dir, tmp_path):
    """verl: the actor is updated when trainer.critic_warmup <= the step (steps count from 1)."""
    cfg, backend = backend_for(random_model_dir, *GAE, "trainer.critic_warmup=2",
                               f"trainer.default_local_dir={tmp_path}")
    actor_before = {k: v.detach().clone() for k, v in backend.model.named_parameters()}
    critic_before = critic_weights(backend)
    metrics, _ = train_step(backend, cfg, as_groups(make_samples()), 0, step=1, version=0)
    assert "actor/pg_loss" not in metrics and "critic/vf_loss" in metrics
    assert all((actor_before[k] == v).all() for k, v in backend.model.named_parameters())
    assert any((critic_before[k] != v).any() for k, v in critic_weights(backend).items())
    metrics, _ = train_step(backend, cfg, as_groups(make_samples(seed=1)), 0, step=2, version=0)
    assert "actor/pg_loss" in metrics
    assert any((actor_before[k] != v).any() for k, v in backend.model.named_parameters())


def test_the_critic_is_saved_and_restored_with_the_actor(random_model_dir, tmp_path):
    """Weights, AdamW state and LR schedule of the critic come back; the next step is the same as without the
    save/load round trip."""
    groups = as_groups(make_samples())
    common = [*GAE, f"trainer.default_local_dir={tmp_path}", "critic.optim.lr_warmup_steps=3"]
    cfg, backend = backend_for(random_model_dir, *common)
    train_step(backend, cfg, groups, 0, step=1, version=0)
    backend.save(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "critic").is_dir() and (tmp_path / "ckpt" / "critic_optim.pt").is_file()
    expected, _ = train_step(backend, cfg, as_groups(make_samples(seed=1)), 0, step=2, version=0)

    cfg2, resumed = backend_for(random_model_dir, *common)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.critic.scheduler.state_dict()["last_epoch"] == backend.critic.scheduler.state_dict()[
        "last_epoch"] - 1   # one step behind: `backend` has taken step 2 since the save
    got, _ = train_step(resumed, cfg2, as_groups(make_samples(seed=1)), 0, step=2, version=0)
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/lr", "critic/values/mean", "actor/pg_loss"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5), key
    assert all(torch.allclose(v, critic_weights(backend)[k]) for k, v in critic_weights(resumed).items())


def test_a_checkpoint_without_a_critic_is_named_when_a_critic_resumes_from_it(random_model_dir, tmp_path):
    _, plain = backend_for(random_model_dir)
    plain.save(str(tmp_path / "ckpt"))
    _, with_critic = backend_for(random_model_dir, *GAE)
    with pytest.raises(FileNotFoundError, match="has no critic"):
        with_critic.load(str(tmp_path / "ckpt"))
