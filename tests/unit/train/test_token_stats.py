"""Chunked log-prob/entropy: same values and gradients as the plain autograd formulas, any chunking."""
import math

import pytest
import torch

from fully_async.train.backends.token_stats import token_stats


def reference(logits, targets, temperature):
    logp_all = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("chunk_elems", [50, 50 * 4, 10 ** 6])   # one row, several rows, everything at once
def test_values_and_gradients_match_autograd(chunk_elems):
    torch.manual_seed(0)
    base = torch.randn(37, 50, dtype=torch.float64) * 3
    targets = torch.randint(0, 50, (37,))
    w_logp, w_ent = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    x_ref, x = base.clone().requires_grad_(), base.clone().requires_grad_()
    ref_logp, ref_ent = reference(x_ref, targets, 0.7)
    ((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum()).backward()
    logp, ent = token_stats(x, targets, 0.7, with_entropy=True, chunk_elems=chunk_elems)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    assert torch.allclose(logp, ref_logp, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-12)


def test_gradcheck_and_log_prob_only():
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 7, (5,))
    assert torch.autograd.gradcheck(lambda a: token_stats(a, t, 1.3, True, 14), (x,))
    assert torch.autograd.gradcheck(lambda a: token_stats(a, t, 1.3, False, 14)[0], (x,))
    assert token_stats(x, t, 1.0)[1] is None


def test_half_precision_logits_are_computed_in_float32():
    torch.manual_seed(1)
    x = (torch.randn(9, 30) * 4).to(torch.bfloat16)
    t = torch.randint(0, 30, (9,))
    logp, ent = token_stats(x, t, 1.0, with_entropy=True, chunk_elems=60)
    ref_logp, ref_ent = reference(x, t, 1.0)
    assert logp.dtype == torch.float32
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)


def test_entropy_of_uniform_logits_is_log_vocab():
    _, ent = token_stats(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), with_entropy=True)
    assert ent.tolist() == pytest.approx([math.log(8)] * 2)


@pytest.mark.parametrize("chunk_elems", [11, 11 * 3, 10 ** 6])
def test_hidden_stats_equals_token_stats_of_the_projection(chunk_elems):
    """lm_head folded in: the values and the gradients for the hidden states and the weight equal those of
    token_stats over hidden @ weight.T, whatever the chunking."""
    from fully_async.train.backends.token_stats import hidden_stats

    torch.manual_seed(2)
    h0, w0 = torch.randn(13, 6, dtype=torch.float64), torch.randn(11, 6, dtype=torch.float64)
    targets = torch.randint(0, 11, (13,))
    g_logp, g_ent = torch.randn(13, dtype=torch.float64), torch.randn(13, dtype=torch.float64)
    h_ref, w_ref = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref_logp, ref_ent = token_stats(h_ref @ w_ref.t(), targets, 0.8, with_entropy=True)
    ((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    logp, ent = hidden_stats(h, w, targets, 0.8, with_entropy=True, chunk_elems=chunk_elems)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    assert torch.allclose(logp, ref_logp, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    assert torch.allclose(h.grad, h_ref.grad, atol=1e-12) and torch.allclose(w.grad, w_ref.grad, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: hidden_stats(a, b, targets, 1.3, True, chunk_elems), (h, w))
    assert torch.autograd.gradcheck(lambda a, b: hidden_stats(a, b, targets, 1.3, False, chunk_elems)[0], (h, w))
    assert hidden_stats(h, w, targets)[1] is None


def test_extreme_logits_match_float64():
    """Logits of magnitude ~85 (a confident model): log-probs and entropy in float32 within 2e-6 of float64 on
    the same (float32) logits; the unshifted lse - sum(p * x) form was 3e-4 off here.  Fused head alike."""
    from fully_async.train.backends.token_stats import hidden_stats

    torch.manual_seed(3)
    x = torch.randn(64, 1000) * 3 + 85.0
    x[:, 7] += 10.0                                         # one dominant token per row
    t = torch.randint(0, 1000, (64,))
    ref_logp, ref_ent = reference(x.double(), t, 1.0)
    logp, ent = token_stats(x, t, 1.0, with_entropy=True)
    assert (logp.double() - ref_logp).abs().max() < 2e-6 and (ent.double() - ref_ent).abs().max() < 2e-6
    logp_h, ent_h = hidden_stats(torch.eye(64), x.t().contiguous(), t, 1.0, with_entropy=True)  # I @ x^T^T = x
    assert (logp_h.double() - ref_logp).abs().max() < 2e-6 and (ent_h.double() - ref_ent).abs().max() < 2e-6


def test_the_callers_device_decides_whether_the_chunk_math_compiles(monkeypatch):
    """compiled=False runs eagerly whatever the tensors' device (trainer.device=npu under the NPU stand-in has its
    tensors on CUDA, and an Ascend NPU runs this eagerly); compiled=True goes through torch.compile, both ways the
    same values; the fused head carries its model's setting."""
    from fully_async.train.backends import token_stats as ts

    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append(fn.__name__)
        return fn
    monkeypatch.setattr(torch, "compile", fake_compile)
    ts._kernels.cache_clear()
    try:
        x = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
        t = torch.randint(0, 11, (6,))
        eager = ts.token_stats(x, t, 0.9, True, compiled=False)
        assert compiled == []
        fused = ts.token_stats(x, t, 0.9, True, compiled=True)
        assert compiled == ["_forward_chunk", "_backward_chunk"]
        assert torch.equal(eager[0], fused[0]) and torch.equal(eager[1], fused[1])
    finally:
        ts._kernels.cache_clear()


def test_torch_backend_compiles_the_chunk_math_only_where_its_device_compiles(random_model_dir):
    from fully_async.device import CPU
    from fully_async.run.hydra_setup import load_config
    from fully_async.train.backends.torch_backend import TorchBackend

    cfg = load_config([f"actor_rollout_ref.model.path={random_model_dir}",
                       "actor_rollout_ref.model.use_fused_kernels=true"])
    backend = TorchBackend(cfg, CPU, total_optimizer_steps=1)
    assert backend.chunk_compiled is False and CPU.compile_backend() is None
    assert backend.fused and backend.model._fa_compiled is False
