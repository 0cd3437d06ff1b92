"""HF <-> Megatron-core GPTModel weight conversion: exact round trips and the fused layouts, on CPU."""
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM

from fully_async.train.backends import hf_megatron as hm

NH, NG, HD, HIDDEN, FFN, VOCAB = 4, 2, 16, 64, 96, 128


def tiny_qwen2(tied: bool, seed: int = 0) -> tuple[Qwen2Config, Qwen2ForCausalLM]:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                      num_attention_heads=NH, num_key_value_heads=NG, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():        # biases and norms are constants at init: make every entry distinct
            p.normal_()
    return cfg, model


def hf_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}   # tied lm_head appears once


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_exact(tied, tp, pp):
    cfg, model = tiny_qwen2(tied)
    state = hf_params(model)
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        shards = [hm.hf_to_megatron(state, cfg, rank, tp, stage, pp) for rank in range(tp)]
        part = hm.megatron_to_hf(shards, cfg, stage, pp)
        assert not set(part) & set(back), "a tensor came back from two pipeline stages"
        back.update(part)
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


@pytest.mark.parametrize("tied", [False, True])
def test_shard_shapes_match_megatron_layout(tied):
    cfg, model = tiny_qwen2(tied)
    m = hm.hf_to_megatron(hf_params(model), cfg, tp_rank=1, tp_size=2)
    layer = "decoder.layers.1."
    assert m[layer + "self_attention.linear_qkv.weight"].shape == (NG // 2 * (NH // NG + 2) * HD, HIDDEN)
    assert m[layer + "self_attention.linear_qkv.bias"].shape == (NG // 2 * (NH // NG + 2) * HD,)
    assert m[layer + "self_attention.linear_proj.weight"].shape == (HIDDEN, NH * HD // 2)
    assert m[layer + "mlp.linear_fc1.weight"].shape == (2 * FFN // 2, HIDDEN)
    assert m[layer + "mlp.linear_fc2.weight"].shape == (HIDDEN, FFN // 2)
    assert m[layer + "input_layernorm.weight"].shape == m[layer + "pre_mlp_layernorm.weight"].shape == (HIDDEN,)
    assert m["embedding.word_embeddings.weight"].shape == (VOCAB // 2, HIDDEN)
    assert ("output_layer.weight" in m) == (not tied)
    # pipeline: the last stage renumbers its layers from 0 and keeps its own copy of a tied embedding
    last = hm.hf_to_megatron(hf_params(model), cfg, pp_rank=1, pp_size=2)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in last and "decoder.layers.1.mlp.linear_fc1.weight" not in last
    assert "embedding.word_embeddings.weight" not in last and "output_layer.weight" in last


def test_fused_qkv_reproduces_q_k_v_projections():
    cfg, model = tiny_qwen2(tied=False)
    attn = model.model.layers[0].self_attn
    x = torch.randn(5, HIDDEN)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)           # (5, NH*HD), (5, NG*HD), (5, NG*HD)
    full = hm.hf_to_megatron(hf_params(model), cfg)
    qpg = NH // NG
    with torch.no_grad():
        for tp in (1, 2):
            for rank in range(tp):
                m = full if tp == 1 else hm.hf_to_megatron(hf_params(model), cfg, rank, tp)
                w = m["decoder.layers.0.self_attention.linear_qkv.weight"]
                b = m["decoder.layers.0.self_attention.linear_qkv.bias"]
                y = F.linear(x, w, b).view(5, NG // tp, qpg + 2, HD)       # megatron's per-group view
                groups = slice(rank * NG // tp, (rank + 1) * NG // tp)
                heads = slice(rank * NH // tp, (rank + 1) * NH // tp)
                torch.testing.assert_close(y[:, :, :qpg].reshape(5, -1, HD), q.view(5, NH, HD)[:, heads])
                torch.testing.assert_close(y[:, :, qpg], k.view(5, NG, HD)[:, groups])
                torch.testing.assert_close(y[:, :, qpg + 1], v.view(5, NG, HD)[:, groups])


def test_tensor_parallel_shards_compose_to_the_hf_layer():
    """Column-parallel fc1 (GLU per rank) and row-parallel fc2 / o_proj summed over ranks equal HF."""
    cfg, model = tiny_qwen2(tied=False)
    layer = model.model.layers[1]
    x = torch.randn(3, HIDDEN)
    h = torch.randn(3, NH * HD)
    shards = [hm.hf_to_megatron(hf_params(model), cfg, rank, 2) for rank in range(2)]
    with torch.no_grad():
        mlp = sum(F.linear(F.silu(g) * u, s["decoder.layers.1.mlp.linear_fc2.weight"])
                  for s in shards for g, u in [F.linear(x, s["decoder.layers.1.mlp.linear_fc1.weight"]).chunk(2, -1)])
        proj = sum(F.linear(h.chunk(2, -1)[r], s["decoder.layers.1.self_attention.linear_proj.weight"])
                   for r, s in enumerate(shards))
        # summation order differs from one full matmul: float32 rounding only (a wrong layout is off by O(1))
        torch.testing.assert_close(mlp, layer.mlp(x), rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(proj, layer.self_attn.o_proj(h), rtol=1e-4, atol=1e-3)


def test_transformer_config_kwargs_and_model_kwargs():
    cfg, _ = tiny_qwen2(tied=True)
    kw = hm.transformer_config_kwargs(cfg, torch.bfloat16)
    assert (kw["num_layers"], kw["hidden_size"], kw["ffn_hidden_size"]) == (2, HIDDEN, FFN)
    assert (kw["num_attention_heads"], kw["num_query_groups"], kw["kv_channels"]) == (NH, NG, HD)
    assert kw["add_qkv_bias"] and not kw["add_bias_linear"] and kw["gated_linear_unit"]
    assert kw["normalization"] == "RMSNorm" and kw["layernorm_epsilon"] == cfg.rms_norm_eps
    assert kw["bf16"] and kw["params_dtype"] == torch.bfloat16 and kw["hidden_dropout"] == 0.0
    assert kw["activation_func"] is F.silu
    gm = hm.gpt_model_kwargs(cfg)
    assert gm["share_embeddings_and_output_weights"] and gm["vocab_size"] == VOCAB
    assert gm["position_embedding_type"] == "rope" and gm["rotary_base"] == 10000.0
    llama = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=VOCAB, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    assert not hm.transformer_config_kwargs(llama, torch.float32)["add_qkv_bias"]
    gm = hm.gpt_model_kwargs(llama)
    assert gm["rotary_base"] == 500000.0 and gm["rope_scaling"] and gm["rope_scaling_factor"] == 8.0


def test_unsupported_configs_are_named():
    cfg, _ = tiny_qwen2(tied=True)
    cfg.hidden_act = "gelu"
    with pytest.raises(NotImplementedError, match="hidden_act"):
        hm.transformer_config_kwargs(cfg)
    with pytest.raises(NotImplementedError, match="attention_bias"):
        hm.check_supported(LlamaConfig(attention_bias=True))
    cfg, model = tiny_qwen2(tied=True)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4"):
        hm.hf_to_megatron(hf_params(model), cfg, 0, 4)      # 2 kv heads cannot split 4 ways


def test_safetensors_folder_reads_a_saved_model(tmp_path):
    cfg, model = tiny_qwen2(tied=True)
    model.save_pretrained(tmp_path)
    folder = hm.SafetensorsFolder(str(tmp_path))
    state = hf_params(model)
    assert set(folder) == set(state)
    assert all(torch.equal(folder[k], v) for k, v in state.items())
    back = hm.megatron_to_hf([hm.hf_to_megatron(folder, cfg)], cfg)
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_names_and_shapes_match_a_real_gptmodel(tied, arch):
    """Build megatron-core's GPTModel (local spec; qk_layernorm for Qwen3, as the backend does) on CPU and load the
    converted dict strictly."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if dist.is_initialized():
        pytest.skip("another test left a process group initialised")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(1, 1)
        cfg, model = tiny_qwen2(tied) if arch == "qwen2" else tiny_qwen3(tied)
        tcfg = TransformerConfig(**hm.transformer_config_kwargs(cfg, torch.float32), use_cpu_initialization=True)
        spec = get_gpt_layer_local_spec(qk_layernorm=hm.has_qk_norm(cfg), normalization="RMSNorm")
        gpt = GPTModel(tcfg, spec, **hm.gpt_model_kwargs(cfg))
        expected = {k: v.shape for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
        converted = hm.hf_to_megatron(hf_params(model), cfg)
        assert {k: v.shape for k, v in converted.items()} == expected
        missing, unexpected = gpt.load_state_dict(converted, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing)
        back = hm.megatron_to_hf([gpt.state_dict()], cfg)
        assert all(torch.equal(back[k], v) for k, v in hf_params(model).items())
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------- Qwen3: q/k norms
def tiny_qwen3(tied: bool, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    # head_dim 24 != hidden / heads (64 / 4 = 16), as in Qwen3-4B (2560 / 32 = 80, head_dim 128)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                      num_attention_heads=NH, num_key_value_heads=NG, head_dim=24, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return cfg, model


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_qwen3_round_trip_keeps_the_qk_norms(tied, tp, pp):
    cfg, model = tiny_qwen3(tied)
    state = hf_params(model)
    assert "model.layers.0.self_attn.q_norm.weight" in state
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        shards = [hm.hf_to_megatron(state, cfg, rank, tp, stage, pp) for rank in range(tp)]
        for shard in shards:   # replicated on every TP rank, whole (head_dim,)
            assert shard["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (24,)
            assert shard["decoder.layers.0.self_attention.k_layernorm.weight"].shape == (24,)
            assert "decoder.layers.0.self_attention.linear_qkv.bias" not in shard   # qwen3: no qkv bias
        back.update(hm.megatron_to_hf(shards, cfg, stage, pp))
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_qwen3_megatron_config_asks_for_qk_layernorm_and_head_dim():
    cfg, _ = tiny_qwen3(False)
    kw = hm.transformer_config_kwargs(cfg)
    assert kw["qk_layernorm"] is True and kw["add_qkv_bias"] is False and kw["kv_channels"] == 24
    q2, _ = tiny_qwen2(False)
    assert hm.transformer_config_kwargs(q2)["qk_layernorm"] is False
    m = hm.hf_to_megatron(hf_params(tiny_qwen3(False)[1]), cfg, tp_rank=1, tp_size=2)
    assert m["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (NG // 2 * (NH // NG + 2) * 24, HIDDEN)
    assert m["decoder.layers.0.self_attention.linear_proj.weight"].shape == (HIDDEN, NH * 24 // 2)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_a_critic_trunk_converts_without_an_lm_head_both_ways(tied, tp, pp):
    """The megatron critic (megatron_critic.py) has a value head where the LM head was: its trunk converts without
    output_layer, to megatron and back, and the back conversion gives the HF trunk's weights exactly."""
    from fully_async.train.backends.megatron_critic import token_values, trunk_config

    config, model = tiny_qwen2(tied)
    hf = model.state_dict()
    trunk = trunk_config(config)
    assert trunk.tie_word_embeddings is False and config.tie_word_embeddings is tied   # the actor's config untouched
    back = {}
    for p in range(pp):
        shards = [hm.hf_to_megatron(hf, trunk, t, tp, p, pp, lm_head=False) for t in range(tp)]
        assert not any(k.startswith("output_layer.") for s in shards for k in s)
        back.update(hm.megatron_to_hf(shards, trunk, p, pp, lm_head=False))
    assert "lm_head.weight" not in back
    assert sorted(back) == sorted(k for k in hf if k != "lm_head.weight")
    assert all(torch.equal(back[k], hf[k]) for k in back)
    out = torch.arange(12.0).view(2, 6, 1)          # (B, L, 1) head outputs -> values read at t - 1
    assert token_values(out, 5).tolist() == [[0.0, 0.0, 1.0, 2.0, 3.0], [0.0, 6.0, 7.0, 8.0, 9.0]]
