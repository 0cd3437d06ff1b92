"""PPO's critic on strategy=megatron (train/backends/megatron_critic.py) against the torch critic on a real
accelerator (skipped without one), float32, world of one: the same values from the same weights, the same critic
update (loss, grad norm, new values), offload/onload, and a checkpoint whose critic/ folder is a Hugging Face
ForTokenClassification model giving the same values.  Also the reward model against torch's, and float16 training
with loss scaling."""
import pytest
import torch

from fully_async.train.ppo_update import critic_update
# the device, the skips, the model builders and the world-of-one process group of the megatron parity tests
from test_megatron_parity import DEVICE, SHAPE, check, world_of_one  # noqa: F401  (an autouse fixture)

pytestmark = pytest.mark.gpu
TOL = 1e-3


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def pair(request, tmp_path_factory):
    from fully_async.train.backends.megatron_backend import MegatronBackend
    from fully_async.train.backends.torch_backend import TorchBackend

    path = str(tmp_path_factory.mktemp("qwen2_critic"))
    check.build_model(path, {**SHAPE, "tie_word_embeddings": request.param}, torch.float32)
    cfg = check.make_config(path, "float32", DEVICE.name, extra={
        "algorithm.adv_estimator": "gae", "critic.optim.lr": 1e-3, "critic.optim.lr_warmup_steps": 0,
        "critic.ppo_micro_batch_size_per_gpu": 2, "critic.forward_micro_batch_size_per_gpu": 4,
        "critic.ppo_mini_batch_size": 3, "critic.cliprange_value": 0.5})
    hf, mg = TorchBackend(cfg, DEVICE, 10), MegatronBackend(cfg, DEVICE, 10)
    head = mg.critic.model.module.output_layer.linear
    with torch.no_grad():                         # the same (newly initialised) value head on both
        hf.critic.model.score.weight.copy_(head.weight)
        if hf.critic.model.score.bias is not None:
            hf.critic.model.score.bias.copy_(head.bias)
        else:
            head.bias.zero_()
    batch = check.make_batch(6, 96, SHAPE["vocab_size"])
    yield cfg, hf, mg, batch
    del hf, mg
    DEVICE.empty_cache()


def max_diff(a, b, mask):
    return float((a - b).abs()[mask.bool()].max())


def test_values_match_the_torch_critic(pair):
    _, hf, mg, batch = pair
    v_mg, v_hf = mg.compute_values(batch), hf.compute_values(batch)
    assert (v_mg[batch.response_mask == 0] == 0).all()
    assert float(v_hf[batch.response_mask.bool()].std()) > 20 * TOL, "values too flat to compare"
    assert max_diff(v_mg, v_hf, batch.response_mask) < TOL


def test_critic_update_matches_the_torch_critic(pair):
    cfg, hf, mg, batch = pair
    batch.values = hf.compute_values(batch)
    g = torch.Generator().manual_seed(3)
    batch.returns = (batch.values + torch.randn(batch.values.shape, generator=g)) * batch.response_mask
    for _ in range(2):
        m_hf = critic_update(hf, cfg, batch, num_mini_batches=2)
        m_mg = critic_update(mg, cfg, batch, num_mini_batches=2)
        for key in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean"):
            assert m_mg[key] == pytest.approx(m_hf[key], rel=2e-3, abs=1e-5), (key, m_hf, m_mg)
        assert m_mg["critic/lr"] == pytest.approx(m_hf["critic/lr"])
    assert max_diff(mg.compute_values(batch), hf.compute_values(batch), batch.response_mask) < 10 * TOL
    assert max_diff(mg.compute_values(batch), batch.values, batch.response_mask) > 10 * TOL   # it moved


def test_offload_checkpoint_and_a_hugging_face_critic_folder(pair, tmp_path):
    from transformers import AutoModelForTokenClassification

    cfg, _, mg, batch = pair
    reference = mg.compute_values(batch)
    mg.offload()
    mg.onload()
    assert torch.equal(mg.compute_values(batch), reference)
    batch.values = reference
    batch.returns = reference + batch.response_mask
    critic_update(mg, cfg, batch, num_mini_batches=1)          # optimizer state exists before saving
    saved = mg.compute_values(batch)
    mg.save(str(tmp_path))
    critic_update(mg, cfg, batch, num_mini_batches=1)
    assert not torch.equal(mg.compute_values(batch), saved)
    mg.load(str(tmp_path))
    assert torch.equal(mg.compute_values(batch), saved)
    model = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"), dtype=torch.float32)
    model.to(DEVICE.torch_device()).eval()
    with torch.no_grad():
        out = model(input_ids=batch.input_ids.to(DEVICE.torch_device()),
                    attention_mask=batch.attention_mask.to(DEVICE.torch_device())).logits[..., 0].float().cpu()
    from_hf = torch.nn.functional.pad(out[:, :-1], (1, 0)) * batch.response_mask
    assert max_diff(from_hf, saved, batch.response_mask) < TOL


def test_a_reward_model_scores_as_the_torch_reward_model(tmp_path):
    """reward_model.enable on strategy=megatron (MegatronRewardModel): the folder's trunk and score head, frozen; a
    response's score is the output at its last token, as the torch reward model's."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from fully_async.train.backends.megatron_backend import MegatronBackend
    from fully_async.train.backends.torch_backend import TorchBackend

    policy, rm = str(tmp_path / "policy"), tmp_path / "rm"
    check.build_model(policy, {**SHAPE, "tie_word_embeddings": False}, torch.float32)
    torch.manual_seed(1)
    model = Qwen2ForSequenceClassification(Qwen2Config(**SHAPE, num_labels=1, initializer_range=0.1))
    model.save_pretrained(str(rm))
    cfg = check.make_config(policy, "float32", DEVICE.name, extra={
        "reward_model.enable": True, "reward_model.model.path": str(rm), "reward_model.micro_batch_size_per_gpu": 4})
    hf, mg = TorchBackend(cfg, DEVICE, 10), MegatronBackend(cfg, DEVICE, 10)
    batch = check.make_batch(6, 96, SHAPE["vocab_size"], seed=2)
    s_hf, s_mg = hf.compute_rm_scores(batch), mg.compute_rm_scores(batch)
    assert float(s_hf.std()) > 20 * TOL, s_hf
    assert float((s_hf - s_mg).abs().max()) < TOL, (s_hf, s_mg)
    mg.offload()
    mg.onload()
    assert torch.equal(mg.compute_rm_scores(batch), s_mg)
    del hf, mg
    DEVICE.empty_cache()


def test_float16_trains_with_loss_scaling(tmp_path):
    """actor.dtype=float16 on megatron: dynamic loss scaling (the schedule scales each loss, the optimizer unscales,
    checks for overflow and steps); the update follows the float32 one's direction and the critic trains too."""
    from fully_async.train.backends.megatron_backend import MegatronBackend
    from fully_async.train.ppo_update import ppo_update

    check.build_model(str(tmp_path), {**SHAPE, "tie_word_embeddings": False}, torch.float16, init_std=0.02)
    extra = {"algorithm.adv_estimator": "gae", "critic.optim.lr_warmup_steps": 0,
             "actor_rollout_ref.actor.optim.lr": 1e-4}
    cfg = check.make_config(str(tmp_path), "float16", DEVICE.name, extra=extra)
    mg = MegatronBackend(cfg, DEVICE, 10)
    assert mg.optimizer.get_loss_scale().item() == 2.0 ** 16
    batch = check.make_batch(6, 96, SHAPE["vocab_size"])
    batch.old_log_probs = mg.compute_log_probs(batch)
    before = mg.named_parameters_for_sync()
    for _ in range(3):
        metrics = ppo_update(mg, cfg, batch, num_mini_batches=2)
        assert metrics["actor/bad_steps"] == 0.0, metrics
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    after = mg.named_parameters_for_sync()
    assert all(torch.isfinite(t).all() for t in after.values())
    assert max(float((after[k].float() - before[k].float()).abs().max()) for k in before) > 0
    batch.values = mg.compute_values(batch)
    batch.returns = batch.values + batch.response_mask
    from fully_async.train.ppo_update import critic_update

    m = critic_update(mg, cfg, batch, num_mini_batches=1)
    assert m["critic/bad_steps"] == 0.0 and torch.isfinite(torch.tensor(m["critic/vf_loss"])), m
    del mg
    DEVICE.empty_cache()
