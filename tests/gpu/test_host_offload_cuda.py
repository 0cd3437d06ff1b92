"""Offload to pinned host buffers on CUDA (skipped elsewhere): a trained model and its AdamW state come back
bit-identical, parameters keep their identity (the optimizer and compiled code hold them), the device memory goes
back and the host buffers are reused; the embedded engine generates the same tokens after a sleep and wake-up, and
an engine that loads weights while asleep (a sync job on a shared pool) generates like one loaded awake."""
import pytest
import torch

from fully_async.device import get_device

pytestmark = pytest.mark.gpu
DEVICE = get_device("auto")
if DEVICE.name != "cuda":
    pytest.skip("needs CUDA: pinned host offload", allow_module_level=True)

from fully_async.core.host_offload import HostOffload  # noqa: E402
from fully_async.core.types import GenRequest, SamplingParams  # noqa: E402
from fully_async.rollout.engines.base import run_requests  # noqa: E402
from fully_async.rollout.engines.hf_engine import HFEngine  # noqa: E402


@pytest.fixture(scope="module")
def shaped(shaped_dir):
    return shaped_dir


def test_model_and_optimizer_round_trip(shaped):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(shaped, dtype=torch.bfloat16).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 20, (2, 32), device="cuda")
    model(ids, labels=ids).loss.backward()
    opt.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = [v.clone() for s in opt.state.values() for k, v in s.items() if k == "exp_avg"]
    params = list(model.parameters())
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    host = HostOffload()
    for _ in range(2):
        host.module_to_host(model)
        host.state_to_host(opt)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() < allocated - 3 * sum(p.numel() * 2 for p in params) * 0.9
        assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
        ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
        host.module_to_device(model, torch.device("cuda"))
        host.state_to_device(opt, torch.device("cuda"))
    host.module_to_host(model)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs      # the buffers are reused
    host.module_to_device(model, torch.device("cuda"))
    assert list(model.parameters()) == params                                   # identity kept
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(torch.equal(a, v) for a, v in zip(moments, (v for s in opt.state.values() for k, v in s.items()
                                                             if k == "exp_avg")))
    model(ids, labels=ids).loss.backward()
    opt.step()                                                                  # trains on after the round trip


def greedy(eng, prompts):
    outs = run_requests(eng, [GenRequest(f"g{i}", p, SamplingParams(0.0, max_tokens=24)) for i, p in
                              enumerate(prompts)])
    return [outs[f"g{i}"].token_ids for i in range(len(prompts))]


def test_engine_sleeps_wakes_and_loads_while_asleep(shaped):
    from transformers import AutoModelForCausalLM

    prompts = [[3 + (i * 5 + j) % 17 for j in range(5 + i)] for i in range(6)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()   # what earlier tests of this process still hold is not this engine's
    eng = HFEngine(shaped, DEVICE, dtype="bfloat16", max_num_seqs=8, eos_token_ids=[], pad_token_id=0,
                   max_model_len=64, free_cache_engine=True)
    first = greedy(eng, prompts)
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated() - before
    eng.sleep(1)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < awake * 0.2
    assert all(p.is_pinned() for p in eng.model.parameters())
    eng.wake_up()
    assert greedy(eng, prompts) == first
    # new weights while asleep (into the host copies), then wake: as an engine that loaded them awake
    other = AutoModelForCausalLM.from_pretrained(shaped, dtype=torch.bfloat16)
    torch.manual_seed(1)
    for p in other.parameters():
        p.data.add_(torch.randn_like(p) * 0.02)
    state = {n: t.detach().cuda() for n, t in other.named_parameters()}
    eng.sleep(1)
    eng.update_weights(state, 2)
    eng.wake_up()
    asleep = greedy(eng, prompts)
    ref = HFEngine(shaped, DEVICE, dtype="bfloat16", max_num_seqs=8, eos_token_ids=[], pad_token_id=0,
                   max_model_len=64, free_cache_engine=True)
    ref.update_weights(state, 2)
    assert asleep == greedy(ref, prompts) and asleep != first
