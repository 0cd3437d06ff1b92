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
