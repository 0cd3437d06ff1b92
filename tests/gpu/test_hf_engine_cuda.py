"""The embedded engine on CUDA (skipped elsewhere), 0.5B-shaped Qwen2 in bf16, with decode graphs and eager:
greedy tokens equal a plain forward token by token (allowing bf16 near-ties), sampled log-probs equal a
recomputed forward, an update mid-generation keeps per-token versions and continues exactly."""
import pytest
import torch

from fully_async.device import get_device

pytestmark = pytest.mark.gpu
DEVICE = get_device("auto")
if DEVICE.name != "cuda":
    pytest.skip("needs CUDA: the 0.5B-shaped bf16 engine check", allow_module_level=True)

from fully_async.rollout.engines.base import run_requests  # noqa: E402
from fully_async.rollout.engines.hf_engine import HFEngine  # noqa: E402
from fully_async.core.types import GenRequest, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def shaped(shaped_dir):
    from transformers import AutoModelForCausalLM
    return shaped_dir, AutoModelForCausalLM.from_pretrained(shaped_dir, dtype=torch.bfloat16).cuda().eval()


def assert_greedy(model, prompt, got):
    """Each token is the argmax of a plain forward over the same prefix, up to a bf16 tie."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got], device="cuda")).logits[0, len(prompt) - 1:-1].float()
    top = logits.max(-1).values
    chosen = logits.gather(1, torch.tensor(got, device="cuda")[:, None]).squeeze(1)
    assert bool(((top - chosen) <= 0.05 * top.abs().clamp(min=1)).all()), (top - chosen).max().item()


MODES = {"eager": dict(enforce_eager=True), "graphs": dict(enforce_eager=False, fused_decode=False),
         "compiled": dict(enforce_eager=False)}   # the default: fused per-layer decode, compiled, in graphs


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_equals_plain_forward_allowing_bf16_ties(shaped, mode):
    path, model = shaped
    eng = HFEngine(path, DEVICE, dtype="bfloat16", max_num_seqs=8, eos_token_ids=[], pad_token_id=0,
                   max_model_len=64, **MODES[mode])
    assert bool(eng._graphs) != (mode == "eager") and eng.compiled == (mode == "compiled")
    prompts = [[3 + (i * 7 + j) % 17 for j in range(4 + i)] for i in range(12)]   # more prompts than slots
    outs = run_requests(eng, [GenRequest(f"g{i}", p, SamplingParams(0.0, max_tokens=32 + i * 4))
                              for i, p in enumerate(prompts)])                  # the last ones grow the cache
    for i, p in enumerate(prompts):
        assert len(outs[f"g{i}"].token_ids) == 32 + i * 4
        assert_greedy(model, p, outs[f"g{i}"].token_ids)


@pytest.mark.parametrize("mode", ["graphs", "compiled"])
def test_update_mid_generation_with_graphs(shaped, mode):
    """Interrupt, load new weights (in place: the graphs stay), resume prompt + partial: the versions switch at
    the cut, and the continuation is greedy under the new weights."""
    from fully_async.core.partial import PendingResponse

    path, model = shaped
    eng = HFEngine(path, DEVICE, dtype="bfloat16", max_num_seqs=8, eos_token_ids=[], pad_token_id=0,
                   max_model_len=64, **MODES[mode])
    graphs = dict(eng._graphs)
    params = SamplingParams(0.0, max_tokens=40)
    pend = [PendingResponse(f"u{i}", f"u{i}", [4 + i, 9, 11, 2 + i], params) for i in range(6)]
    eng.submit([p.request() for p in pend])
    for _ in range(10):
        eng.collect()
    partial = {o.request_id: o for o in eng.interrupt()}
    new = {k: v * 1.02 for k, v in model.named_parameters()}
    eng.update_weights(new, version=1)
    assert eng._graphs == graphs
    for p in pend:
        assert not p.extend(partial[p.sample_id])
    rest = run_requests(eng, [p.request() for p in pend])
    before = {k: v.clone() for k, v in model.named_parameters()}
    with torch.no_grad():
        for k, v in model.named_parameters():
            v.copy_(new[k])
    try:
        check_continuations(model, pend, partial, rest)
    finally:
        with torch.no_grad():
            for k, v in model.named_parameters():
                v.copy_(before[k])


def check_continuations(model, pend, partial, rest):
    for p in pend:
        k = len(partial[p.sample_id].token_ids)
        assert p.extend(rest[p.sample_id])
        s = p.to_sample()
        assert 0 < k < 40 and s.versions == [0] * k + [1] * (40 - k)
        assert_greedy(model, p.prompt_ids + s.response_ids[:k], s.response_ids[k:])


@pytest.mark.parametrize("mode", list(MODES))
def test_sampled_log_probs_equal_a_recomputed_forward(shaped, mode):
    path, model = shaped
    eng = HFEngine(path, DEVICE, dtype="bfloat16", max_num_seqs=16, eos_token_ids=[], pad_token_id=0, seed=3,
                   **MODES[mode])
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(16)]
    outs = run_requests(eng, [GenRequest(f"s{i}", p, SamplingParams(1.0, 1.0, -1, 24)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        o = outs[f"s{i}"]
        with torch.no_grad():
            logits = model(torch.tensor([p + o.token_ids], device="cuda")).logits[0, len(p) - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(o.token_ids, device="cuda")[:, None]).squeeze(1)
        assert torch.allclose(lp.cpu(), torch.tensor(o.log_probs), atol=0.1), (i, (lp.cpu() - torch.tensor(o.log_probs)).abs().max())
