"""LoRA (actor_rollout_ref.model.lora_rank; train/backends/lora.py): adapters start as the identity, only they train,
the merged weights are the model the adapters compute, checkpoints hold the merged model and a peft-format adapter
that a resume or lora_adapter_path starts from, and two FSDP2 ranks train it as one device."""
import json

import pytest
import torch

from fully_async.core.batch import build_batch
from fully_async.core.config import ConfigError, asset_path
from fully_async.device import CPU
from fully_async.run import prepare
from fully_async.run.hydra_setup import load_config
from fully_async.train.backends import lora
from fully_async.train.backends.torch_backend import TorchBackend
from fully_async.train.ppo_update import ppo_update
from fully_async.train.train_step import prepare_batch
from tests_helpers import tiny_samples

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.optim.lr=0.01", "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "async_training.use_rollout_log_probs=false",
        "actor_rollout_ref.actor.use_kl_loss=true"]


def tiny_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(asset_path("tiny_arithmetic/model"))


def test_adapters_start_as_the_identity_and_merge_into_the_same_model():
    model, base = tiny_model(), tiny_model()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    names = lora.apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    assert len(names) == 3 * 2 and all(n.endswith(("q_proj", "v_proj", "down_proj")) for n in names)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {f"{n}.{x}" for n in names
                                                                           for x in ("lora_A", "lora_B")}
    torch.testing.assert_close(model(ids).logits, base(ids).logits)          # B = 0: the base model
    with torch.no_grad():
        for layer in lora.lora_layers(model).values():
            layer.lora_B.normal_()
    merged = dict(lora.merged_parameters(model, model.named_parameters()))
    assert set(merged) == {n for n, _ in base.named_parameters()}            # the plain model's names
    base.load_state_dict(merged, strict=False)
    torch.testing.assert_close(base(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)
    everything = lora.apply_lora(tiny_model(), rank=2, alpha=2)              # all-linear: all but the output head
    assert len(everything) == 2 * 7 and not any("lm_head" in n for n in everything)
    assert len(lora.apply_lora(tiny_model(), rank=2, alpha=2, exclude_modules=".*mlp.*")) == 2 * 4


def test_a_lora_update_trains_only_the_adapters_and_checkpoints_restore_it(tmp_path):
    cfg = load_config(LORA)
    backend = TorchBackend(cfg, CPU, 10)
    before = {n: t.clone() for n, t in backend.iter_full_parameters()}
    base = {n: p.detach().clone() for n, p in backend.model.named_parameters() if not n.endswith(("_A", "_B"))}
    assert [n for n, _ in backend.param_shapes()] == list(before)
    batch = build_batch(tiny_samples(groups=4, n=3))
    prepare_batch(backend, cfg, batch, {})
    metrics = ppo_update(backend, cfg, batch, num_mini_batches=2)
    assert metrics["actor/grad_norm"] > 0
    for n, p in backend.model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n                                  # the base stays frozen
    after = dict(backend.iter_full_parameters())
    assert any(not torch.equal(after[n], before[n]) for n in before)           # the merged model moved
    assert not any(n.endswith(("_A", "_B")) for n in after)

    backend.save(str(tmp_path))
    adapter = tmp_path / "actor" / "lora_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    from safetensors.torch import load_file
    keys = load_file(str(adapter / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
               for k in keys)
    saved = load_file(str(tmp_path / "actor" / "model.safetensors"))            # the merged model, plain names
    assert set(saved) == set(after) and all(torch.equal(saved[n], after[n]) for n in after)

    again = TorchBackend(cfg, CPU, 10)
    again.load(str(tmp_path))
    for n, t in again.iter_full_parameters():
        torch.testing.assert_close(t, after[n])
    started = TorchBackend(load_config(LORA[2:] + [f"actor_rollout_ref.model.lora_adapter_path={adapter}"]), CPU, 10)
    assert started.lora[:2] == (4, 8.0) and len(started.lora_targets) == len(backend.lora_targets)
    for n, t in started.iter_full_parameters():
        torch.testing.assert_close(t, after[n])                                 # verl's lora_adapter_path


def test_lora_that_cannot_run_is_refused_naming_the_key(tmp_path):
    # strategy=megatron takes an adapter only if its fused layers can hold it (one lora_A for q/k/v, gate/up): a
    # peft adapter trained here has one per projection
    single = load_config(LORA)
    TorchBackend(single, CPU, 10).save(str(tmp_path / "ckpt"))
    adapter = tmp_path / "ckpt" / "actor" / "lora_adapter"
    with pytest.raises(ConfigError, match="have different lora_A; strategy=megatron's fused LoRA") as err:
        prepare.check_lora_adapter(load_config([f"actor_rollout_ref.model.lora_adapter_path={adapter}",
                                                "actor_rollout_ref.actor.strategy=megatron", "trainer.device=cuda"]))
    assert err.value.key == "actor_rollout_ref.model.lora_adapter_path"
    prepare.check_lora_adapter(load_config([f"actor_rollout_ref.model.lora_adapter_path={adapter}"]))   # torch: fine
    cfg = load_config(["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16"])   # megatron's
    assert (cfg.actor_rollout_ref.model.lora_rank, cfg.actor_rollout_ref.model.lora_alpha) == (8, 16)
    with pytest.raises(ConfigError, match="not a peft adapter folder") as err:
        prepare.check_lora_adapter(load_config([f"actor_rollout_ref.model.lora_adapter_path={tmp_path}"]))
    assert err.value.key == "actor_rollout_ref.model.lora_adapter_path"


def test_two_fsdp2_ranks_train_lora_as_one_device(tmp_path):
    import tests_helpers

    samples = tiny_samples(groups=4, n=3)
    single_cfg = load_config(LORA)
    single = TorchBackend(single_cfg, CPU, 10)
    batch = build_batch(samples)
    prepare_batch(single, single_cfg, batch, {})
    ref = ppo_update(single, single_cfg, batch, num_mini_batches=2)
    cfg = load_config(LORA + ["actor_rollout_ref.actor.strategy=fsdp2", "trainer.n_gpus_per_node=2"])
    with tests_helpers.cpu_group(cfg) as group:
        batch2 = build_batch(samples)
        prepare_batch(group, cfg, batch2, {})
        got = ppo_update(group, cfg, batch2, num_mini_batches=2)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
        full = group.named_parameters_for_sync()
        for name, t in single.iter_full_parameters():
            torch.testing.assert_close(full[name], t, atol=1e-4, rtol=1e-4)
        group.save(str(tmp_path))
        assert (tmp_path / "actor" / "lora_adapter" / "adapter_model.safetensors").is_file()


def test_the_memory_model_counts_grads_and_adam_for_the_adapters_only():
    import json as _json

    from fully_async.core.config import typed_config
    from fully_async.planner.hardware import Shape
    from fully_async.planner.memory_model import trainer_memory

    shape = Shape.of(_json.load(open(asset_path("tiny_arithmetic/model/config.json"))))
    full = trainer_memory(typed_config(load_config([])), shape, 1).parts
    adapted = trainer_memory(typed_config(load_config(["actor_rollout_ref.model.lora_rank=4"])), shape, 1).parts
    adapter = 2 * 4 * (7 * 128 + 2 * 128 + 2 * 64 + 3 * 384)        # layers x rank x (in + out) of the 7 linears
    assert adapted["optimizer"] == pytest.approx(8 * adapter) and adapted["optimizer"] < full["optimizer"]
    assert adapted["params"] == full["params"]
