"""Packed training kernels on CUDA (skipped elsewhere): torch's FlashAttention varlen path and the
compiled chunked log-prob/entropy, against the padded / plain-autograd computations."""
import copy

import pytest
import torch

from fully_async.device import get_device

pytestmark = pytest.mark.gpu
DEVICE = get_device("auto")
if DEVICE.name != "cuda":
    pytest.skip("needs CUDA: the varlen flash kernel and the compiled token_stats path are CUDA-only",
                allow_module_level=True)

from fully_async.core import varlen_attention  # noqa: E402
from fully_async.train.backends.token_stats import token_stats  # noqa: E402
from fully_async.train.backends.torch_backend import token_log_probs  # noqa: E402
from fully_async.core.batch import build_batch  # noqa: E402
from fully_async.core.types import Sample  # noqa: E402


def reference(logits, targets, temperature):
    logp_all = torch.log_softmax(logits.float() / temperature, -1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_token_stats_match_autograd(dtype):
    torch.manual_seed(0)
    base = (torch.randn(3000, 32000, device="cuda") * 3).to(dtype)
    targets = torch.randint(0, 32000, (3000,), device="cuda")
    w = torch.randn(2, 3000, device="cuda")
    x_ref, x = base.clone().requires_grad_(), base.clone().requires_grad_()
    lp_ref, ent_ref = reference(x_ref, targets, 0.9)
    ((lp_ref * w[0]).sum() + (ent_ref * w[1]).sum()).backward()
    lp, ent = token_stats(x, targets, 0.9, with_entropy=True, chunk_elems=32000 * 700)   # 5 chunks
    ((lp * w[0]).sum() + (ent * w[1]).sum()).backward()
    assert torch.allclose(lp, lp_ref, atol=1e-4) and torch.allclose(ent, ent_ref, atol=1e-4)
    scale = float(x_ref.grad.float().abs().max())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((x.grad.float() - x_ref.grad.float()).abs().max()) <= tol * scale


def test_flash_varlen_packed_matches_padded():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, intermediate_size=512, max_position_embeddings=1024)
    padded_model = Qwen2ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    packed_model = Qwen2ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="varlen")
    padded_model.to("cuda", torch.bfloat16)
    packed_model.to("cuda", torch.bfloat16)
    packed_model.load_state_dict(padded_model.state_dict())
    assert (padded_model.config._attn_implementation, packed_model.config._attn_implementation) == ("sdpa", "varlen")
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(12):
        p, r = int(torch.randint(5, 100, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g))
        ids = torch.randint(2, 512, (p + r,), generator=g).tolist()
        samples.append(Sample(uid=f"g{i}", sample_id=f"s{i}", prompt_ids=ids[:p], response_ids=ids[p:],
                              rollout_log_probs=[0.0] * r, versions=[0] * r, reward=0.0))
    batch = build_batch(samples).to(torch.device("cuda"))
    real = batch.attention_mask.bool()
    real[:, 0] = False
    q = torch.empty(1, 8, 4, 32, device="cuda", dtype=torch.bfloat16)
    assert varlen_attention.fused_kernel(q) is not None    # Triton's on Hopper, else FlashAttention's
    grads = []
    for model, packed in ((padded_model, False), (packed_model, True)):
        logp, ent = token_log_probs(model, batch, 1.0, with_entropy=True, packed=packed)
        (logp * batch.response_mask).sum().backward()
        grads.append((logp.detach(), torch.cat([p.grad.flatten().float() for p in model.parameters()])))
    (lp0, g0), (lp1, g1) = grads
    assert float((lp0 - lp1)[real].abs().max()) < 0.1          # bf16: both ~0.05 from float32
    assert float(torch.nn.functional.cosine_similarity(g0, g1, dim=0)) > 0.999
    # the layout worked out on the host (to(pack=True), what the update's micro-batches get) packs the same
    host_packed = build_batch(samples).to(torch.device("cuda"), pack=True)
    assert host_packed.packing.index.device.type == "cuda"
    with torch.no_grad():
        lp2, _ = token_log_probs(packed_model, host_packed, 1.0, with_entropy=True, packed=True)
    assert torch.equal(lp2, lp1)


def test_flash_varlen_with_more_keys_than_queries_aligns_them_to_the_end():
    """The prefill chunk's attention (a chunk of queries after its slot's cached prefix): FlashAttention's varlen
    kernel with key boundaries of their own equals causal sdpa aligned to the bottom right, per sequence."""
    torch.manual_seed(0)
    q_lens, k_lens = [700, 1, 64], [2748, 1, 64]
    q = torch.randn(sum(q_lens), 14, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(k_lens), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda") for lens in (q_lens, k_lens))
    assert varlen_attention.fused_kernel(q) is not None    # Triton's on Hopper, else FlashAttention's
    out = varlen_attention.packed_causal_attention(q, k, v, cu_q, None, 0.125, cu_k, None)
    want = torch.cat([varlen_attention._causal_sdpa(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1),
                                                    v[c:d].transpose(0, 1), 0.125).transpose(0, 1)
                      for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])])
    assert float((out.float() - want.float()).abs().max()) < 2e-2


def _fp32_reference(q, k, v, cu_q, cu_k, scale):
    parts = []
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        parts.append(varlen_attention._causal_sdpa(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1),
                                                   v[c:d].transpose(0, 1), scale).transpose(0, 1))
    return torch.cat(parts)


@pytest.mark.parametrize("q_lens,k_lens,heads", [([1, 700, 3088, 17, 64, 2000, 129], None, (14, 2, 64)),
                                                 ([700, 1, 64], [2748, 1, 64], (14, 2, 64)),
                                                 ([1, 900, 2100, 33, 128], None, (28, 4, 128))])
def test_triton_packed_attention_is_as_close_to_float32_as_flash(q_lens, k_lens, heads, monkeypatch):
    """core/triton_attention.py's kernels (grouped kv heads read as they are) against FlashAttention's varlen kernel
    (kv heads repeated where this torch has no enable_gqa), both bf16, each measured against the same attention in
    float32: the output and dq/dk/dv of the Triton kernels are no further from it than twice FlashAttention's."""
    k_lens = k_lens or q_lens
    torch.manual_seed(0)
    q = torch.randn(sum(q_lens), heads[0], heads[2], device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(k_lens), heads[1], heads[2], device="cuda", dtype=torch.bfloat16) for _ in range(2))
    grad = torch.randn_like(q)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda") for lens in (q_lens, k_lens))
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    ref = _fp32_reference(*ref_in, cu_q, cu_k, 0.125)
    ref.backward(grad.float())
    want = [ref.detach(), *(t.grad for t in ref_in)]
    errors = {}
    for kernel in ("flash", "triton"):
        monkeypatch.setattr(varlen_attention, "PACKED_KERNEL", kernel)
        assert varlen_attention.fused_kernel(q) == kernel
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = varlen_attention.packed_causal_attention(*leaves, cu_q, None, 0.125, cu_k, None)
        out.backward(grad)
        got = [out.detach(), *(t.grad for t in leaves)]
        errors[kernel] = [float((a.float() - b).abs().max()) for a, b in zip(got, want)]
    for part, flash, triton in zip(("out", "dq", "dk", "dv"), errors["flash"], errors["triton"]):
        assert triton <= 2 * flash + 1e-3, (part, errors)
