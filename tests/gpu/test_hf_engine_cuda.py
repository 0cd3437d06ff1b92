"""The embedded engine on CUDA (skipped elsewhere), 0.5B-shaped Qwen2 in bf16: greedy tokens equal a plain
forward token by token (allowing bf16 near-ties), sampled log-probs equal a recomputed forward."""
import os
import subprocess
import sys

import pytest
import torch

from fully_async.device import get_device

pytestmark = pytest.mark.gpu
DEVICE = get_device("auto")
if DEVICE.name != "cuda":
    pytest.skip("needs CUDA: the 0.5B-shaped bf16 engine check", allow_module_level=True)

from fully_async.engines.base import run_requests  # noqa: E402
from fully_async.engines.hf_engine import HFEngine  # noqa: E402
from fully_async.types import GenRequest, SamplingParams  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("m05"))
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "build_shaped_model.py"), "--shape", "0.5b",
                    "--out", out], check=True, capture_output=True)
    from transformers import AutoModelForCausalLM
    return out, AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).cuda().eval()


def test_greedy_equals_plain_forward_allowing_bf16_ties(shaped):
    path, model = shaped
    eng = HFEngine(path, DEVICE, dtype="bfloat16", max_num_seqs=8, eos_token_ids=[], pad_token_id=0,
                   max_model_len=64)
    prompts = [[3 + (i * 7 + j) % 17 for j in range(4 + i)] for i in range(12)]   # more prompts than slots
    outs = run_requests(eng, [GenRequest(f"g{i}", p, SamplingParams(0.0, max_tokens=32)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        got = outs[f"g{i}"].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([p + got], device="cuda")).logits[0, len(p) - 1:-1].float()
        top = logits.max(-1).values
        chosen = logits.gather(1, torch.tensor(got, device="cuda")[:, None]).squeeze(1)
        # each token is the argmax of a plain forward over the same prefix, up to a bf16 tie
        assert bool(((top - chosen) <= 0.05 * top.abs().clamp(min=1)).all()), (i, (top - chosen).max().item())


def test_sampled_log_probs_equal_a_recomputed_forward(shaped):
    path, model = shaped
    eng = HFEngine(path, DEVICE, dtype="bfloat16", max_num_seqs=16, eos_token_ids=[], pad_token_id=0, seed=3)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(16)]
    outs = run_requests(eng, [GenRequest(f"s{i}", p, SamplingParams(1.0, 1.0, -1, 24)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        o = outs[f"s{i}"]
        with torch.no_grad():
            logits = model(torch.tensor([p + o.token_ids], device="cuda")).logits[0, len(p) - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(o.token_ids, device="cuda")[:, None]).squeeze(1)
        assert torch.allclose(lp.cpu(), torch.tensor(o.log_probs), atol=0.1), (i, (lp.cpu() - torch.tensor(o.log_probs)).abs().max())
