"""LoRA on strategy=megatron (train/backends/megatron_lora.py) against the torch LoRA on a real accelerator (skipped
without one), float32, world of one.  Both load one peft adapter whose fused parts share lora_A (q/k/v, gate/up),
so they compute the same model: the same log-probs, the same reference (the base: adapters off), the same merged
weights for the engines; one update's gradients of each fused adapter are the sums (A) and the stacks (B) of the
torch parts'; only the adapters train; offload, a checkpoint whose actor/ is the merged model and whose
actor/lora_adapter/ a torch LoRA run loads to the same log-probs, and a resume."""
import re

import pytest
import torch

from fully_async.train.backends import hf_megatron as hm
from fully_async.train.backends import lora
from fully_async.train.ppo_update import ppo_update
from test_megatron_parity import DEVICE, SHAPE, check, world_of_one  # noqa: F401  (an autouse fixture)

pytestmark = pytest.mark.gpu
TOL, RANK, ALPHA = 1e-3, 8, 16.0
HF_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def shared_a_adapter(seed=0):
    """A peft adapter of every projection, B non-zero (the adapter changes the model), q/k/v and gate/up sharing A."""
    g = torch.Generator().manual_seed(seed)
    h, i = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    hd = h // SHAPE["num_attention_heads"]
    q, kv = SHAPE["num_attention_heads"] * hd, SHAPE["num_key_value_heads"] * hd
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}
    out = {}
    for layer in range(SHAPE["num_hidden_layers"]):
        shared = {"qkv": torch.randn(RANK, h, generator=g) * 0.1, "fc1": torch.randn(RANK, h, generator=g) * 0.1}
        for name, (fan_in, fan_out) in dims.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            group = "qkv" if name in ("q_proj", "k_proj", "v_proj") else "fc1" if name in ("gate_proj", "up_proj") \
                else None
            a = shared[group] if group else torch.randn(RANK, fan_in, generator=g) * 0.1
            key = f"{lora.PEFT_PREFIX}model.layers.{layer}.{part}.{name}"
            out[f"{key}.lora_A.weight"] = a.clone()
            out[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=g) * 0.05
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from fully_async.train.backends.megatron_backend import MegatronBackend
    from fully_async.train.backends.torch_backend import TorchBackend

    path, adapter = str(tmp_path_factory.mktemp("qwen2_lora")), str(tmp_path_factory.mktemp("adapter"))
    check.build_model(path, {**SHAPE, "tie_word_embeddings": False}, torch.float32)
    lora.save_adapter(adapter, shared_a_adapter(), RANK, ALPHA, HF_MODULES, path)
    cfg = check.make_config(path, "float32", DEVICE.name, extra={
        "actor_rollout_ref.model.lora_adapter_path": adapter, "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.kl_loss_coef": 0.1, "actor_rollout_ref.actor.optim.lr": 1e-3})
    hf, mg = TorchBackend(cfg, DEVICE, 10), MegatronBackend(cfg, DEVICE, 10)
    batch = check.make_batch(6, 96, SHAPE["vocab_size"])
    valid = batch.attention_mask.bool().clone()
    valid[:, 0] = False
    yield cfg, hf, mg, batch, valid
    del hf, mg
    DEVICE.empty_cache()


def test_log_probs_and_the_reference_match_the_torch_lora(pair):
    _, hf, mg, batch, valid = pair
    actor_mg, actor_hf = mg.compute_log_probs(batch), hf.compute_log_probs(batch)
    ref_mg, ref_hf = mg.compute_log_probs(batch, "ref"), hf.compute_log_probs(batch, "ref")
    assert check.diff_stats(actor_mg, actor_hf, valid)["max_abs"] < TOL
    assert check.diff_stats(ref_mg, ref_hf, valid)["max_abs"] < TOL
    assert check.diff_stats(actor_mg, ref_mg, valid)["max_abs"] > 20 * TOL     # the adapter changes the model


def test_the_engines_get_the_merged_weights(pair):
    _, hf, mg, _, _ = pair
    merged_mg, merged_hf = mg.named_parameters_for_sync(), hf.named_parameters_for_sync()
    assert sorted(merged_mg) == sorted(merged_hf)
    for name, t in merged_hf.items():
        torch.testing.assert_close(merged_mg[name], t.cpu(), rtol=1e-5, atol=1e-5, msg=name)
    assert [n for n, _ in mg.param_shapes()] == list(merged_hf)


def _lora_grads(backend, megatron):
    out = {}
    for name, p in backend.model.named_parameters():
        m = re.search(r"layers\.(\d+)\.(?:self_attn|self_attention|mlp)\.(\w+)\.(lora_[AB])$", name)
        if m:
            g = p.main_grad if megatron else p.grad
            out[(int(m.group(1)), m.group(2), m.group(3))] = g.detach().float().cpu().clone()
    return out


def test_fused_adapter_gradients_are_the_sums_and_stacks_of_the_parts(pair):
    cfg, hf, mg, batch, _ = pair
    batch.old_log_probs = hf.compute_log_probs(batch)
    batch.ref_log_probs = hf.compute_log_probs(batch, "ref")
    grads, metrics = {}, {}
    for name, backend in (("hf", hf), ("mg", mg)):
        step = backend.optimizer_step

        def capture(finite, which="actor", backend=backend, name=name, step=step):
            grads.setdefault(name, _lora_grads(backend, name == "mg"))
            return step(finite, which)

        backend.optimizer_step = capture
        try:
            metrics[name] = ppo_update(backend, cfg, batch, num_mini_batches=1)
        finally:
            del backend.optimizer_step
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert metrics["mg"][key] == pytest.approx(metrics["hf"][key], rel=1e-3, abs=1e-6), key
    g_hf, g_mg = grads["hf"], grads["mg"]
    ng = SHAPE["num_key_value_heads"]

    def rel(a, b):    # the two float32 forwards differ by ~1e-4 (log-probs): compare whole tensors
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    errors = {}
    for layer in range(SHAPE["num_hidden_layers"]):
        def part(p, which):
            return g_hf[(layer, p, which)]
        expected = {
            ("linear_qkv", "lora_A"): part("q_proj", "lora_A") + part("k_proj", "lora_A") + part("v_proj", "lora_A"),
            ("linear_qkv", "lora_B"): hm.fuse_qkv(part("q_proj", "lora_B"), part("k_proj", "lora_B"),
                                                  part("v_proj", "lora_B"), ng),
            ("linear_proj", "lora_A"): part("o_proj", "lora_A"), ("linear_proj", "lora_B"): part("o_proj", "lora_B"),
            ("linear_fc1", "lora_A"): part("gate_proj", "lora_A") + part("up_proj", "lora_A"),
            ("linear_fc1", "lora_B"): torch.cat([part("gate_proj", "lora_B"), part("up_proj", "lora_B")]),
            ("linear_fc2", "lora_A"): part("down_proj", "lora_A"),
            ("linear_fc2", "lora_B"): part("down_proj", "lora_B")}
        for (kind, which), want in expected.items():
            assert float(want.norm()) > 0, (layer, kind, which)
            errors[f"{layer}.{kind}.{which}"] = rel(g_mg[(layer, kind, which)], want)
        # control: q/k/v's B gradients stacked without megatron's per-group order are not the fused one's
        unfused = torch.cat([part("q_proj", "lora_B"), part("k_proj", "lora_B"), part("v_proj", "lora_B")])
        assert rel(g_mg[(layer, "linear_qkv", "lora_B")], unfused) > 0.05
    norms = {k: [float(t.norm()) for key, t in g.items() if key[0] == 0] for k, g in grads.items()}
    assert max(errors.values()) < 1e-2, (errors, norms, {k: m["actor/grad_norm"] for k, m in metrics.items()})


def test_only_the_adapters_train_and_checkpoints_hold_the_merged_model_and_the_adapter(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    from fully_async.train.backends.torch_backend import TorchBackend

    cfg, _, mg, batch, valid = pair
    adapters = sum(p.numel() for n, p in mg.model.named_parameters() if n.endswith((".lora_A", ".lora_B")))
    trained = sum(p.numel() for o in mg._inner_optimizers(mg.optimizer) for g in o.param_groups for p in g["params"])
    assert trained == adapters
    base = {n: p.detach().clone() for n, p in mg.model.named_parameters() if not n.endswith((".lora_A", ".lora_B"))}
    reference = mg.compute_log_probs(batch)
    mg.offload()
    mg.onload()
    assert torch.equal(mg.compute_log_probs(batch), reference)
    batch.old_log_probs = batch.ref_log_probs = reference
    assert ppo_update(mg, cfg, batch, num_mini_batches=1)["actor/grad_norm"] > 0   # not weight decay alone
    assert all(torch.equal(p, base[n]) for n, p in mg.model.named_parameters() if n in base)
    saved = mg.compute_log_probs(batch)
    assert check.diff_stats(saved, reference, valid)["max_abs"] > 0
    mg.save(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "actor"), dtype=torch.float32)
    model.to(DEVICE.torch_device()).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids.to(DEVICE.torch_device()),
                       attention_mask=batch.attention_mask.to(DEVICE.torch_device())).logits.float()
    from_hf = torch.nn.functional.pad(torch.log_softmax(logits[:, :-1], -1).gather(
        -1, batch.input_ids[:, 1:, None].to(logits.device))[..., 0], (1, 0)).cpu()
    assert check.diff_stats(from_hf, saved, valid)["max_abs"] < TOL
    torch_cfg = check.make_config(cfg.actor_rollout_ref.model.path, "float32", DEVICE.name, extra={
        "actor_rollout_ref.model.lora_adapter_path": str(tmp_path / "actor" / "lora_adapter")})
    assert check.diff_stats(TorchBackend(torch_cfg, DEVICE, 10).compute_log_probs(batch), saved, valid)["max_abs"] < TOL
    ppo_update(mg, cfg, batch, num_mini_batches=1)
    assert not torch.equal(mg.compute_log_probs(batch), saved)
    mg.load(str(tmp_path))
    assert torch.equal(mg.compute_log_probs(batch), saved)
