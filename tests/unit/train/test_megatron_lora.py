"""LoRA on strategy=megatron (train/backends/megatron_lora.py, core/lora_targets.py), on CPU: which layers are adapted,
peft adapters round-trip through every tensor/pipeline layout, an adapter a fused layer cannot hold is refused, and
megatron's own parallel linear layers with adapters compute and differentiate what the unsplit math does at tensor
parallel 1 and 2 (gloo ranks).  The whole backend against the torch LoRA runs on a GPU:
tests/gpu/test_megatron_lora_cuda.py.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fully_async.cluster.network import free_port
from fully_async.core.config import ConfigError
from fully_async.core.config_checks import validate
from fully_async.core.lora_targets import is_target, layer_names, megatron_targets
from fully_async.device import CPU
from fully_async.run.hydra_setup import load_config
from fully_async.train.backends import megatron_lora as ml
from fully_async.train.backends.lora import PEFT_PREFIX

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install fully_async[megatron])")
NH, NG, HD, HIDDEN, FFN, LAYERS, R = 4, 2, 8, 32, 48, 4, 3


def selected(targets, excludes=None):
    t, e = megatron_targets(targets, excludes)
    return [n for n in layer_names(2) if is_target(n, t, e)]


def test_targets_take_megatron_names_hugging_face_names_and_patterns():
    every = layer_names(2)
    assert selected("all-linear") == every and selected(None) == every
    assert selected(["linear_qkv", "linear_fc2"]) == [n for n in every if n.endswith(("linear_qkv", "linear_fc2"))]
    hf = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert selected(hf) == every
    assert selected(["*.layers.0.*.linear_qkv", "linear_fc1"]) == [
        "decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mlp.linear_fc1",
        "decoder.layers.1.mlp.linear_fc1"]
    assert selected("all-linear", ["o_proj"]) == [n for n in every if not n.endswith("linear_proj")]
    assert selected(r".*layers\.1\..*") == [n for n in every if ".layers.1." in n]
    with pytest.raises(ValueError, match="q_proj is part of the fused linear_qkv"):
        megatron_targets(["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="'lm_head' is no linear layer"):
        megatron_targets(["lm_head"])


def test_megatron_lora_settings_are_checked_before_the_run():
    base = ["actor_rollout_ref.actor.strategy=megatron", "trainer.device=cuda", "actor_rollout_ref.model.lora_rank=8"]
    validate(load_config(base))
    with pytest.raises(ConfigError, match="fused linear_qkv") as err:
        validate(load_config(base + ["actor_rollout_ref.model.target_modules=[q_proj,v_proj]"]))
    assert err.value.key == "actor_rollout_ref.model.target_modules"
    with pytest.raises(ConfigError, match="is not one of") as err:
        validate(load_config(base + ["actor_rollout_ref.model.lora_A_init_method=orthogonal"]))
    assert err.value.key == "actor_rollout_ref.model.lora_A_init_method"
    # verl's megatron spelling; its alpha default (32) comes with the megatron configs
    cfg = load_config(["actor_rollout_ref.model.lora.rank=8",
                       "actor_rollout_ref.model.lora.target_modules=[linear_qkv]",
                       "actor_rollout_ref.model.lora.lora_A_init_method=kaiming",
                       "actor_rollout_ref.model.lora.exclude_modules=[]"], config_name="ppo_megatron_trainer")
    m = cfg.actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, list(m.target_modules), m.exclude_modules, m.lora_A_init_method) == (
        8, 32, ["linear_qkv"], None, "kaiming")
    with pytest.raises(ConfigError, match="only the fused `lora` type"):
        load_config(["actor_rollout_ref.model.lora.type=dora"])


def hf_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=64, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=NH, num_key_value_heads=NG, head_dim=HD)


def peft_adapter(seed=0, shared=True):
    """A peft adapter of every linear layer; a fused layer's parts share lora_A when `shared`."""
    g = torch.Generator().manual_seed(seed)
    q, kv = NH * HD, NG * HD
    shapes = {"self_attn.q_proj": (HIDDEN, q), "self_attn.k_proj": (HIDDEN, kv), "self_attn.v_proj": (HIDDEN, kv),
              "self_attn.o_proj": (q, HIDDEN), "mlp.gate_proj": (HIDDEN, FFN), "mlp.up_proj": (HIDDEN, FFN),
              "mlp.down_proj": (FFN, HIDDEN)}
    out = {}
    for i in range(LAYERS):
        a_of = {}
        for module, (fan_in, fan_out) in shapes.items():
            group = "qkv" if module.endswith(("q_proj", "k_proj", "v_proj")) else \
                "fc1" if module.endswith(("gate_proj", "up_proj")) else module
            a = a_of.get(group) if shared else None
            a = torch.randn(R, fan_in, generator=g) if a is None else a
            a_of[group] = a
            out[f"{PEFT_PREFIX}model.layers.{i}.{module}.lora_A.weight"] = a.clone()
            out[f"{PEFT_PREFIX}model.layers.{i}.{module}.lora_B.weight"] = torch.randn(fan_out, R, generator=g)
    return out


def local_names(pp):
    return [f"decoder.layers.{i}.{sub}" for i in range(LAYERS // pp) for sub in ml.SUBMODULE.values()]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_peft_adapters_round_trip_through_every_layout(tp, pp):
    cfg, adapter = hf_config(), peft_adapter()
    back = {}
    for stage in range(pp):
        shards = [ml.peft_to_local(adapter, local_names(pp), cfg, rank, tp, stage, pp, "the adapter")
                  for rank in range(tp)]
        qkv_b = shards[0]["decoder.layers.0.self_attention.linear_qkv.lora_B"]
        assert qkv_b.shape == ((NH + 2 * NG) * HD // tp, R)                     # a column shard of fused q/k/v
        assert shards[0]["decoder.layers.0.self_attention.linear_proj.lora_A"].shape == (R, NH * HD // tp)
        back.update(ml.adapter_to_peft(shards, cfg, stage, pp))
    assert sorted(back) == sorted(adapter)
    for key, value in adapter.items():
        assert torch.equal(back[key], value), key


def test_an_adapter_a_fused_layer_cannot_hold_is_refused():
    cfg = hf_config()
    with pytest.raises(RuntimeError, match="different lora_A; strategy=megatron's fused LoRA shares one A"):
        ml.peft_to_local(peft_adapter(shared=False), local_names(1), cfg, 0, 1, 0, 1, "/adapters/torch")
    partial = {k: v for k, v in peft_adapter().items() if "down_proj" not in k}
    with pytest.raises(RuntimeError, match="does not cover the model's LoRA layer decoder.layers.0.mlp.linear_fc2"):
        ml.peft_to_local(partial, local_names(1), cfg, 0, 1, 0, 1, "/adapters/x")
    with pytest.raises(RuntimeError, match="holds layers this model's LoRA does not have"):
        ml.peft_to_local(peft_adapter(), [n for n in local_names(1) if "fc2" not in n], cfg, 0, 1, 0, 1, "/a")


def test_lora_a_starts_the_same_in_every_layout_with_its_init_method():
    a = ml.init_lora_a(8, 512, "xavier", 1, "decoder.layers.3.mlp.linear_fc2")
    assert torch.equal(a, ml.init_lora_a(8, 512, "xavier", 1, "decoder.layers.3.mlp.linear_fc2"))
    assert not torch.equal(a, ml.init_lora_a(8, 512, "xavier", 1, "decoder.layers.2.mlp.linear_fc2"))
    assert float(a.std()) == pytest.approx((2 / (8 + 512)) ** 0.5, rel=0.1)
    assert float(ml.init_lora_a(8, 512, "kaiming", 1, "x").abs().max()) <= 512 ** -0.5
    assert float(ml.init_lora_a(8, 512, "normal", 1, "x").std()) == pytest.approx(0.2, rel=0.1)


def _tp_rank(rank, port, tp, out_dir):
    """A column-parallel layer with bias (as linear_qkv) then a row-parallel one (as linear_proj), both adapted, on
    `tp` gloo ranks, against the unsplit float32 math in this process."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tp, 1)
    try:
        g = torch.Generator().manual_seed(0)
        H, O, r, alpha, S, B = 8, 12, 4, 6.0, 6, 2
        w1, b1, w2 = torch.randn(O, H, generator=g), torch.randn(O, generator=g), torch.randn(H, O, generator=g)
        a1, b1l, a2, b2l = (torch.randn(*s, generator=g) for s in ((r, H), (O, r), (r, O), (H, r)))
        x, gy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
        s = alpha / r
        ref = [t.clone().requires_grad_(True) for t in (x, a1, b1l, a2, b2l)]
        xr, a1r, b1r, a2r, b2r = ref
        h = xr @ w1.T + b1 + s * (xr @ a1r.T) @ b1r.T
        y_ref = h @ w2.T + s * (h @ a2r.T) @ b2r.T
        (y_ref * gy).sum().backward()
        base_ref = (x @ w1.T + b1) @ w2.T

        cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, use_cpu_initialization=True,
                                gradient_accumulation_fusion=False, tensor_model_parallel_size=tp)
        zeros = torch.nn.init.zeros_
        col = ColumnParallelLinear(H, O, config=cfg, init_method=zeros, bias=True, gather_output=False)
        row = RowParallelLinear(O, H, config=cfg, init_method=zeros, bias=False, input_is_parallel=True,
                                skip_bias_add=True)
        with torch.no_grad():
            col.weight.copy_(w1.chunk(tp, 0)[rank])
            col.bias.copy_(b1.chunk(tp, 0)[rank])
            row.weight.copy_(w2.chunk(tp, 1)[rank])
        lc = ml.LoRAParallelLinear(col, "linear_qkv", r, alpha, a1, rank, tp, False)
        lr = ml.LoRAParallelLinear(row, "linear_proj", r, alpha, a2, rank, tp, False)
        with torch.no_grad():
            lc.lora_B.copy_(b1l.chunk(tp, 0)[rank])
            lr.lora_B.copy_(b2l)
        xm = x.clone().requires_grad_(True)
        y, _ = lr(lc(xm)[0])
        (y * gy).sum().backward()
        with ml.adapters_disabled(lc, lr):
            y_base = lr(lc(x)[0])[0]
        torch.save({"y": (y, y_ref), "base": (y_base, base_ref), "dx": (xm.grad, xr.grad),
                    "dA1": (lc.lora_A.grad, a1r.grad), "dB1": (lc.lora_B.grad, b1r.grad.chunk(tp, 0)[rank]),
                    "dA2": (lr.lora_A.grad, a2r.grad.chunk(tp, 1)[rank]), "dB2": (lr.lora_B.grad, b2r.grad),
                    "merged1": (lc.merged_weight(), (w1 + s * b1l @ a1).chunk(tp, 0)[rank]),
                    "merged2": (lr.merged_weight(), (w2 + s * b2l @ a2).chunk(tp, 1)[rank]),
                    "frozen": ([n for n, p in list(lc.named_parameters()) + list(lr.named_parameters())
                                if p.requires_grad], ["lora_A", "lora_B"] * 2)},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [1, 2])   # sequence parallelism's reduce-scatter is not in gloo
def test_parallel_layers_with_adapters_match_the_unsplit_math(tmp_path, tp):
    mp.spawn(_tp_rank, args=(free_port(), tp, str(tmp_path)), nprocs=tp)
    for rank in range(tp):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        names, expected = got.pop("frozen")
        assert names == expected
        for what, (mine, ref) in got.items():
            torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4, msg=f"{what} (rank {rank} of {tp})")


def test_a_peft_adapters_full_names_select_their_own_layers():
    names = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"] + ["model.layers.0.mlp.down_proj"]
    assert selected(names) == ["decoder.layers.0.mlp.linear_fc2", "decoder.layers.1.self_attention.linear_qkv"]
    with pytest.raises(ValueError, match="q_proj of layer 1 is part of the fused linear_qkv"):
        megatron_targets(names[:2])


def test_the_memory_model_counts_the_fused_adapters_and_no_reference_copy():
    import json

    from fully_async.core.config import asset_path, typed_config
    from fully_async.planner.hardware import Shape
    from fully_async.planner.memory_model import trainer_memory

    shape = Shape.of(json.load(open(asset_path("tiny_arithmetic/model/config.json"))))
    base = ["actor_rollout_ref.actor.strategy=megatron", "trainer.device=cuda", "actor_rollout_ref.actor.use_kl_loss=true"]
    full = trainer_memory(typed_config(load_config(base)), shape, 1).parts
    adapted = trainer_memory(typed_config(load_config(base + ["actor_rollout_ref.model.lora_rank=4"])), shape, 1).parts
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    adapter = shape.layers * 4 * (4 * shape.hidden + 2 * q + 2 * kv + 3 * shape.intermediate)   # (in + out) x 4 layers
    assert adapted["optimizer"] == pytest.approx(12 * adapter) and adapted["grads"] == pytest.approx(4 * adapter)
    assert "ref_params" in full and "ref_params" not in adapted          # the reference is the base, adapters off
    assert adapted["params"] == full["params"]


def test_virtual_pipeline_stages_are_checked_before_the_run(tmp_path, caplog):
    """actor.megatron.virtual_pipeline_model_parallel_size (megatron's interleaved schedule, megatron_backend.py);
    with dynamic batch sizes a warning says the token budget no longer bounds a micro-batch (one shape for all)."""
    from fully_async.core.config import asset_path
    from fully_async.run.prepare import check_parallel_layout

    base = ["actor_rollout_ref.actor.strategy=megatron", "trainer.device=cuda", "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"]
    with caplog.at_level("WARNING"):
        validate(load_config(base))
        assert "no longer bounds" not in caplog.text
        validate(load_config(base + ["actor_rollout_ref.actor.use_dynamic_bsz=true"]))
    assert "token budget (ppo_max_token_len_per_gpu, log_prob_max_token_len_per_gpu) no longer bounds" in caplog.text
    with pytest.raises(ConfigError, match="interleaved schedule needs pipeline_model_parallel_size > 1") as err:
        validate(load_config(base[:2] + base[4:]))
    assert err.value.key == "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size"
    with pytest.raises(ConfigError, match="a critic or a reward model on megatron needs null"):
        validate(load_config(base + ["algorithm.adv_estimator=gae", "critic.strategy=megatron"]))
    import json
    from types import SimpleNamespace

    conf = SimpleNamespace(**json.load(open(asset_path("tiny_arithmetic/model/config.json"))))   # 2 layers
    with pytest.raises(ConfigError, match="num_hidden_layers=2 does not split into .* = 4 blocks") as err:
        check_parallel_layout(load_config(base), conf)
    assert err.value.key == "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size"


def test_adapters_behind_a_frozen_embedding_get_gradients_under_reentrant_recompute():
    """Megatron's full activation recompute is reentrant: a checkpointed layer whose input does not require grad
    gives no gradient to the parameters inside it.  With every base weight frozen that is the adapters' case (found
    on a GPU: zero LoRA gradients with enable_gradient_checkpointing); the embedding's hook gives the input a grad."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 8).requires_grad_(False)
    lora_a = torch.nn.Parameter(torch.randn(2, 8))
    lora_b = torch.nn.Parameter(torch.randn(8, 2))

    def layer(x):
        return x + x @ lora_a.T @ lora_b.T

    def grads():
        import warnings

        lora_a.grad = lora_b.grad = None

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = checkpoint(layer, embedding(torch.tensor([[1, 2, 3]])), use_reentrant=True)
        if out.requires_grad:
            out.sum().backward()
        return lora_a.grad, lora_b.grad

    assert grads() == (None, None)                      # what the adapters got before the hook
    handle = embedding.register_forward_hook(ml.input_requires_grad)
    a, b = grads()
    assert a is not None and b is not None and float(a.abs().sum()) > 0
    handle.remove()

    class Stage(torch.nn.Module):                         # apply_lora hooks the first stage's embedding
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(10, 8)
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList()

    stage = Stage()
    ml.apply_lora(stage, (2, 4.0, "all-linear", None), "xavier", 0, 0, 0, 1, False)
    assert stage.embedding(torch.tensor([1])).requires_grad and not stage.embedding.weight.requires_grad


def test_the_interleaved_schedule_gets_one_shape_per_micro_batch_and_unbatched_p2p(monkeypatch):
    """Virtual stages: a step of megatron's interleaved schedule sends to the next and the previous stage at once,
    one peer at pp=2, and megatron exchanges the two shapes (and, batched, the two tensors) over one communicator,
    where NCCL matches them in posting order, swapped: on 2x H200 a pp=2 x vpp=2 run hung in its first step.  So
    with virtual stages every micro-batch goes through the schedule in one (rows, length) shape, p2p unbatched, the
    last stage's logits cut back to the micro-batch's rows before its loss; without them nothing changes."""
    import json
    from types import SimpleNamespace

    from megatron.core import pipeline_parallel

    from fully_async.core.batch import TrainBatch
    from fully_async.core.config import asset_path
    from fully_async.train.backends.megatron_backend import MegatronBackend

    def batch(rows, length, first):
        ids = torch.full((rows, length), first)
        return TrainBatch(ids, torch.ones(rows, length, dtype=torch.long), torch.ones(rows, length),
                          torch.zeros(rows, length), torch.zeros(rows), ["g"] * rows)

    hf_config = SimpleNamespace(**json.load(open(asset_path("tiny_arithmetic/model/config.json"))))
    for vpp in (1, 2):
        backend = object.__new__(MegatronBackend)
        backend.cfg = load_config(["actor_rollout_ref.actor.strategy=megatron", "trainer.device=cuda",
                                   "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"])
        backend.mcfg, backend.hf_config, backend.dtype = backend.cfg.actor_rollout_ref.actor.megatron, hf_config, \
            torch.float32
        backend.vpp, backend.pp, backend.tp = vpp, 2, 1
        backend.device = CPU   # its memory decides an unset enable_gradient_checkpointing (here set by the preset)
        tcfg = backend._transformer_config()
        assert (tcfg.variable_seq_lengths, tcfg.batch_p2p_comm) == ((True, True) if vpp == 1 else (False, False))
        backend.tcfg = tcfg
        seen, inputs = [], []

        def schedule(forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                     forward_only):
            seen.append((num_microbatches, seq_length, micro_batch_size))
            outs = []
            for _ in range(num_microbatches):
                it = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
                out, loss = forward_step_func(it, model[0])
                outs.append(loss(out))
            return outs

        def model(ids, positions, mask):
            inputs.append(tuple(ids.shape))
            return ids.float().unsqueeze(-1)                             # "logits" (B, L, 1)
        monkeypatch.setattr(pipeline_parallel, "get_forward_backward_func", lambda: schedule)
        mbs = [batch(3, 5, 1), batch(1, 2, 2)]
        chunks = [model] * vpp
        outs = backend._schedule(chunks if vpp > 1 else model, mbs, lambda mb, logits: tuple(logits.shape), True)
        assert seen == [(2, 5, 3)]
        if vpp == 1:   # each micro-batch as it is
            assert inputs == [(3, 5), (1, 2)] and outs == [(3, 5, 1), (1, 2, 1)]
        else:          # padded to (3, 5) for the model, the loss sees its own rows (length cut by the loss itself)
            assert inputs == [(3, 5), (3, 5)] and outs == [(3, 5, 1), (1, 5, 1)]
