"""The embedded engine's fused per-layer decode (rollout/engines/fused_decode.py) computes what transformers'
own modules compute: same sampled tokens and behaviour log-probs from the same seed, for each llama-family
shape it claims (Qwen2 with q/k/v bias, Qwen3 with q/k norms and no bias, Llama), over cache growth and
admission mid-run; other models fall back to transformers' modules."""
import pytest
import torch

from fully_async.device import CPU
from fully_async.rollout.engines.base import run_requests
from fully_async.rollout.engines.fused_decode import projection_groups, side_by_side, unsupported_reason
from fully_async.rollout.engines.hf_engine import HFEngine
from fully_async.core.types import GenRequest, SamplingParams

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def build(tmp_path, kind: str) -> str:
    import transformers

    config = {"qwen2": lambda: transformers.Qwen2Config(**SMALL),
              "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32),
              "llama": lambda: transformers.LlamaConfig(**SMALL, attention_bias=True),
              "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4)}[kind]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():   # visible biases and norms: an argument passed in the wrong place changes the output
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = str(tmp_path / kind)
    model.save_pretrained(path)
    return path


def generate(path: str, fused: bool, packed: bool = False) -> dict:
    eng = HFEngine(path, CPU, max_num_seqs=4, eos_token_ids=[], pad_token_id=0, seed=5, max_model_len=8,
                   fused_decode=fused, packed_prefill=packed or None)
    assert (eng._fused is not None) == fused and eng.packed_prefill == packed
    prompts = [[3 + (i * 5 + j) % 50 for j in range(2 + i % 4)] for i in range(7)]   # more prompts than slots
    params = [SamplingParams(1.0, 1.0, -1, 12 + i) if i % 2 else SamplingParams(0.0, max_tokens=10 + i)
              for i in range(7)]                                                     # the cache grows past 8
    return run_requests(eng, [GenRequest(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_fused_decode_equals_transformers_modules(tmp_path, kind):
    """The fused decode, and with it the packed prefill through the same layer functions (the CUDA default; forced
    here), sample what transformers' modules sample."""
    path = build(tmp_path, kind)
    modules = generate(path, False)
    for fused in (generate(path, True), generate(path, True, packed=True)):
        for rid, ref in modules.items():
            assert fused[rid].token_ids == ref.token_ids, rid
            assert fused[rid].log_probs == pytest.approx(ref.log_probs, abs=1e-5), rid


def test_other_models_take_transformers_modules(tmp_path):
    import transformers

    path = build(tmp_path, "gpt2")
    assert "gpt2" in unsupported_reason(transformers.AutoModelForCausalLM.from_pretrained(path))
    eng = HFEngine(path, CPU, max_num_seqs=2, eos_token_ids=[], pad_token_id=0)
    assert eng._fused is None and not eng.compiled


def test_projection_groups_are_laid_out_again_after_weights_moved_one_by_one(tmp_path):
    """A sleep without fixed addresses (NPU, device_memory=none) moves each weight on its own; bind() lays the q/k/v
    and gate/up groups out back to back again, the modules' parameters views of them, and decoding is unchanged."""
    path = build(tmp_path, "qwen2")
    want = generate(path, True)
    eng = HFEngine(path, CPU, max_num_seqs=4, eos_token_ids=[], pad_token_id=0, seed=5, max_model_len=8)
    layers = eng.model.get_decoder().layers
    joined = lambda: all(side_by_side([lin.weight for lin in g]) is not None and   # noqa: E731
                         (g[0].bias is None or side_by_side([lin.bias for lin in g]) is not None)
                         for layer in layers for g in projection_groups(layer))
    assert joined()
    with torch.no_grad():
        for p in eng.model.parameters():   # what a move to the host and back does: each its own storage
            p.data = p.data.clone()
    assert not joined()
    eng._fused.bind()
    assert joined() and eng._fused.layers[0][0][1].data_ptr() == layers[0].self_attn.q_proj.weight.data_ptr()
    prompts = [[3 + (i * 5 + j) % 50 for j in range(2 + i % 4)] for i in range(7)]
    params = [SamplingParams(1.0, 1.0, -1, 12 + i) if i % 2 else SamplingParams(0.0, max_tokens=10 + i)
              for i in range(7)]
    got = run_requests(eng, [GenRequest(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in want.items()}
