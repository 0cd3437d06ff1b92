"""The embedded engine's fp8 rollout (rollout.quantization=fp8): prefill and decode both run the fp8 arithmetic,
and every weight update is quantised again."""
import pytest
import torch

from fully_async.core.fp8 import Fp8Emulation, fake_quant_weight
from fully_async.core.types import GenRequest, SamplingParams
from fully_async.device import CPU
from fully_async.rollout.engines.base import run_requests
from fully_async.rollout.engines.hf_engine import HFEngine

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def generate(engine):
    outs = run_requests(engine, [GenRequest(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)], timeout_s=120.0)
    return [outs[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def hf_model(random_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(random_model_dir).eval()


def teacher_forced(model, prompt, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def test_fp8_engine_samples_from_the_fp8_model_in_prefill_and_decode(random_model_dir, hf_model):
    import copy

    eng = HFEngine(random_model_dir, CPU, max_num_seqs=2, eos_token_ids=[1], pad_token_id=0, quantization="fp8")
    assert eng._fused is None   # decode runs transformers' modules, whose linear layers carry the rounding
    weights = dict(eng.model.named_parameters())
    for name, param in hf_model.named_parameters():
        quantised = name.startswith("model.layers.") and name.endswith("proj.weight")
        assert torch.equal(weights[name], fake_quant_weight(param) if quantised else param), name
    fp8_model = copy.deepcopy(hf_model)
    Fp8Emulation(fp8_model, fp8_model.get_decoder())
    plain = generate(HFEngine(random_model_dir, CPU, max_num_seqs=2, eos_token_ids=[1], pad_token_id=0))
    worst = 0.0
    for prompt, out, ref in zip(PROMPTS, generate(eng), plain):
        # one full-sequence forward (prefill-shaped) of the fp8 model gives the log-probs decode sampled with, up to
        # the summation order of the decode step, which can move an activation across an e4m3 rounding boundary
        assert torch.allclose(teacher_forced(fp8_model, prompt, out.token_ids), torch.tensor(out.log_probs),
                              atol=2e-3)
        n = min(len(out.token_ids), len(ref.token_ids))
        worst = max(worst, (torch.tensor(out.log_probs[:n]) - torch.tensor(ref.log_probs[:n])).abs().max().item())
    assert worst > 2e-2    # fp8 is not the compute dtype: the mismatch rollout correction is for


@pytest.mark.parametrize("as_stream", [False, True])
def test_a_weight_update_is_quantised_again(random_model_dir, hf_model, as_stream):
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=2, eos_token_ids=[1], pad_token_id=0, quantization="fp8")
    new = {n: p.detach() * 1.5 for n, p in hf_model.named_parameters()}
    eng.update_weights(iter(new.items()) if as_stream else new, version=2)
    weights = dict(eng.model.named_parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(weights[q], fake_quant_weight(new[q]))
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.bias"], new["model.layers.0.self_attn.q_proj.bias"])
    assert torch.equal(weights["model.embed_tokens.weight"], new["model.embed_tokens.weight"])
    assert eng.version == 2


def test_an_unknown_quantization_is_refused(random_model_dir):
    with pytest.raises(ValueError, match=r"rollout\.quantization='int4' is not one of \[None, 'fp8'\]"):
        HFEngine(random_model_dir, CPU, quantization="int4")
