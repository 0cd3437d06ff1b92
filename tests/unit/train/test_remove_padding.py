"""use_remove_padding: packed micro-batches give the padded numbers, and bad settings fail early."""
import importlib.util

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fully_async.train.backends.torch_backend import model_overrides, token_log_probs
from fully_async.core.batch import build_batch, split_by_tokens
from fully_async.core.config import ConfigError, asset_path
from fully_async.core.config_checks import validate
from fully_async.device import CPU, CUDA, NPU
from fully_async.run.hydra_setup import load_config
from fully_async.run.prepare import check_attention

from test_torch_backend import make_samples, updated_weights

MODEL = asset_path("tiny_arithmetic/model")


# float64 makes the two layouts agree to rounding; eager's softmax runs in float32 even then
@pytest.mark.parametrize("impl,grad_tol", [("varlen", 1e-10), ("sdpa", 1e-10), ("eager", 1e-5)])
def test_packed_log_probs_and_grads_match_padded(random_model_dir, impl, grad_tol):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, attn_implementation=impl, dtype=torch.float64)
    assert model.config._attn_implementation == impl
    batch = build_batch(make_samples(groups=3, n=3))   # 9 rows of different lengths
    assert len(set(batch.seq_lengths)) > 2
    real = batch.attention_mask.bool()
    real[:, 0] = False                                  # t = 0 has no log-prob in either layout
    results = []
    for packed in (False, True):
        model.zero_grad()
        logp, ent = token_log_probs(model, batch, 0.7, with_entropy=True, packed=packed)
        (logp * batch.response_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((logp, ent, grads))
    (lp0, e0, g0), (lp1, e1, g1) = results
    assert torch.allclose(lp0[real], lp1[real], atol=1e-10)
    assert torch.allclose(e0[real], e1[real], atol=1e-10)
    assert (lp1[~batch.attention_mask.bool()] == 0).all()      # nothing leaks into padding
    for name in g0:
        scale = float(g0[name].abs().max())
        assert float((g0[name] - g1[name]).abs().max()) <= grad_tol * max(scale, 1.0), name


def test_packed_update_matches_padded_update(random_model_dir):
    common = ["actor_rollout_ref.actor.use_kl_loss=true", "async_training.use_rollout_log_probs=false",
              "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    padded, m_padded = updated_weights(random_model_dir, *common)
    packed, m_packed = updated_weights(random_model_dir, *common, "actor_rollout_ref.model.use_remove_padding=true")
    dyn, m_dyn = updated_weights(random_model_dir, *common, "actor_rollout_ref.model.use_remove_padding=true",
                                 "actor_rollout_ref.actor.use_dynamic_bsz=true", "data.max_prompt_length=8",
                                 "data.max_response_length=8", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20")
    for name in padded:
        # Adam divides by sqrt(v): float32 reduction-order rounding in near-zero gradients shows up as up to
        # ~1e-4 on single elements; 2e-4 is 2% of one lr=0.01 step (a wrong normalisation is off by ~1e-2)
        assert torch.allclose(padded[name], packed[name], atol=2e-4), (name, (padded[name] - packed[name]).abs().max())
        assert torch.allclose(padded[name], dyn[name], atol=2e-4), (name, (padded[name] - dyn[name]).abs().max())
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert m_packed[key] == pytest.approx(m_padded[key], rel=1e-4, abs=1e-6), key
        assert m_dyn[key] == pytest.approx(m_padded[key], rel=1e-4, abs=1e-6), key


def test_packed_token_budget_counts_real_tokens():
    lengths = [9, 3, 7, 2, 8, 4]
    groups = split_by_tokens(lengths, 20, packed=True)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(sum(lengths[i] for i in g) <= 20 for g in groups)
    # the padded budget (rows x longest) needs more micro-batches for the same rows
    assert len(groups) == 2 and len(split_by_tokens(lengths, 20)) == 3


def test_attention_kernel_per_device():
    cfg = load_config(["actor_rollout_ref.model.use_remove_padding=true"]).actor_rollout_ref.model
    assert model_overrides(cfg, CPU)["attn_implementation"] == "varlen"
    assert model_overrides(cfg, NPU)["attn_implementation"] == "flash_attention_2"   # torch_npu's varlen kernel
    has_flash_attn = importlib.util.find_spec("flash_attn") is not None
    assert model_overrides(cfg, CUDA)["attn_implementation"] == ("flash_attention_2" if has_flash_attn else "varlen")
    padded = load_config([]).actor_rollout_ref.model
    assert model_overrides(padded, CUDA)["attn_implementation"] == "sdpa"
    cfg = load_config(["+actor_rollout_ref.model.override_config.attn_implementation=eager",
                       "+actor_rollout_ref.model.override_config.attention_dropout=0.0"]).actor_rollout_ref.model
    assert model_overrides(cfg, CUDA) == {"attn_implementation": "eager", "attention_dropout": 0.0}


def check(*overrides):
    cfg = load_config(list(overrides))
    check_attention(cfg, AutoConfig.from_pretrained(MODEL))


def test_bad_attention_settings_name_the_key():
    check("actor_rollout_ref.model.use_remove_padding=true", "trainer.device=cpu")   # fine: sdpa
    with pytest.raises(ConfigError, match="attn_implementation.*flex_attention cannot train on the CPU"):
        check("+actor_rollout_ref.model.override_config.attn_implementation=flex_attention", "trainer.device=cpu")
    with pytest.raises(ConfigError, match="attn_implementation.*varlen attends within packed sequences"):
        validate(load_config(["+actor_rollout_ref.model.override_config.attn_implementation=varlen"]))
    with pytest.raises(ConfigError, match=r"override_config.*\['hidden_sise'\] are not fields of"):
        check("+actor_rollout_ref.model.override_config.hidden_sise=8")
    with pytest.raises(ConfigError, match="attn_implementation.*'flash' is not one of"):
        validate(load_config(["+actor_rollout_ref.model.override_config.attn_implementation=flash"]))
    with pytest.raises(ConfigError, match="use_remove_padding.*strategy=megatron keeps right-padded rows"):
        validate(load_config(["actor_rollout_ref.model.use_remove_padding=true", "trainer.device=cuda"],
                             config_name="fully_async_ppo_megatron_trainer"))
