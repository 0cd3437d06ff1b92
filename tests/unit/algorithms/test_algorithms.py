"""GRPO advantages, PPO loss with dual clip, KL estimators and loss aggregation, by hand."""
import math

import pytest
import torch

from fully_async.algorithms import (PolicyLossInput, agg_loss, filter_top_k_top_p, grpo_advantages, kl_penalty,
                                    policy_loss, sample_tokens)
from fully_async.algorithms.sampling import exponential_race


def test_grpo_group_normalisation_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    gids = ["a", "a", "a", "a", "b", "b"]
    mask = torch.ones(6, 2)
    adv = grpo_advantages(scores, gids, mask, norm_adv_by_std=True, eps=0.0)
    # group a: mean .25, unbiased std sqrt(((.75)^2 + 3*(.25)^2)/3) = 0.5
    assert adv[0, 0].item() == pytest.approx(0.75 / 0.5)
    assert adv[1, 1].item() == pytest.approx(-0.25 / 0.5)
    # group b: mean 3, std sqrt(2)
    assert adv[4, 0].item() == pytest.approx(-1 / math.sqrt(2))
    adv_nostd = grpo_advantages(scores, gids, mask, norm_adv_by_std=False)
    assert adv_nostd[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -1.0, 1.0])


def test_grpo_single_member_group_and_mask():
    adv = grpo_advantages(torch.tensor([3.0]), ["x"], torch.tensor([[0.0, 1.0]]), eps=0.0)
    assert adv.tolist() == [[0.0, 3.0]]   # mean 0, std 1, masked position stays 0


def test_agg_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(loss, mask, "bogus")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batch_sum_equals_full_batch(mode):
    torch.manual_seed(0)
    loss = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    full = agg_loss(loss, mask, mode)
    denom = mask.sum().item() if mode == "token-mean" else 6.0
    parts = agg_loss(loss[:2], mask[:2], mode, denom) + agg_loss(loss[2:], mask[2:], mode, denom)
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    d = 0.5
    assert kl_penalty(logp, ref, "kl").item() == pytest.approx(d)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(d)
    assert kl_penalty(ref, logp, "abs").item() == pytest.approx(d)
    assert kl_penalty(logp, ref, "mse").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(math.exp(-d) + d - 1)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-d) + d - 1)
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "full")


def test_ppo_clip_and_dual_clip_by_hand():
    # token 0: adv>0, ratio e^0.5=1.65 > 1.28 -> clipped at 1.28
    # token 1: adv<0, ratio e^2=7.39 -> clip gives -(-1)*7.39=7.39, dual clip caps at 3
    # token 2: adv<0, ratio 1 -> unclipped loss 1
    logp = torch.tensor([[0.5, 2.0, 0.0]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    out = policy_loss(PolicyLossInput(logp, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.28, clip_c=3.0))
    expected = [-1.28, 3.0, 1.0]
    assert out.loss.item() == pytest.approx(sum(expected) / 3, rel=1e-5)
    # verl counts a token as clipped when the clipped surrogate is the larger loss: only token 0
    # (token 1's unclipped loss 7.39 is already above its clipped 1.28)
    assert out.clipfrac.item() == pytest.approx(1 / 3)
    assert out.clipfrac_lower.item() == pytest.approx(1 / 3)  # token 1 hit the dual clip
    assert out.ppo_kl.item() == pytest.approx(-(0.5 + 2.0) / 3)


def test_decoupled_ppo_weight_truncated():
    logp = torch.zeros(1, 2)
    old = torch.zeros(1, 2)
    behav = torch.tensor([[0.0, -3.0]])  # weights exp(0)=1, exp(3)=20 -> capped at 5
    adv = torch.ones(1, 2)
    out = policy_loss(PolicyLossInput(logp, old, adv, torch.ones(1, 2), behav_logp=behav, behav_cap=5.0))
    assert out.loss.item() == pytest.approx((-1 - 5) / 2)
    assert out.behav_weight_mean.item() == pytest.approx(3.0)


def test_sampling_greedy_topk_topp_and_logprobs():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    masked = filter_top_k_top_p(logits, torch.tensor([2, -1, -1]), torch.tensor([1.0, 0.7, 0.85]))
    assert torch.isinf(masked[0, 2:]).all() and torch.isfinite(masked[0, :2]).all()   # top-k 2
    assert torch.isfinite(masked[1, :2]).all() and torch.isinf(masked[1, 2:]).all()  # 0.5+0.3 >= 0.7
    assert torch.isfinite(masked[2, :3]).all() and torch.isinf(masked[2, 3])         # 0.95 >= 0.85
    gen = torch.Generator().manual_seed(0)
    temps = torch.tensor([0.0, 1.0, 2.0])
    tok, lp = sample_tokens(logits, temps, torch.tensor([-1, 1, -1]), torch.ones(3), gen)
    assert tok[0].item() == 0 and tok[1].item() == 0              # greedy and top-1
    assert lp[0].item() == pytest.approx(math.log(0.5), rel=1e-5)
    expected = torch.log_softmax(logits[2] / 2.0, -1)[tok[2]]      # unmasked, temperature-scaled
    assert lp[2].item() == pytest.approx(expected.item(), rel=1e-5)


def test_sampling_without_truncation_equals_the_filter_that_keeps_everything():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    temps = torch.tensor([1.0, 0.7, 0.0, 1.3])
    off_k, off_p = torch.full((4,), -1), torch.ones(4)
    a = sample_tokens(logits, temps, off_k, off_p, torch.Generator().manual_seed(5))
    b = sample_tokens(logits, temps, off_k, off_p, torch.Generator().manual_seed(5), truncate=False)
    assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1])


def test_exponential_race_draws_each_index_with_its_probability():
    """200k draws over 5 probabilities (one zero, never drawn): each frequency within 4 standard errors."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    draws = exponential_race(probs.expand(200_000, 5).contiguous(), torch.Generator().manual_seed(3))
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    se = (probs.double() * (1 - probs.double()) / draws.numel()).sqrt()
    assert freq[4] == 0 and ((freq - probs.double()).abs() <= 4 * se + 1e-12).all(), freq


def test_seq_mean_token_sum_norm_is_the_sequence_mean_over_a_constant_and_splits_exactly():
    """Dr. GRPO's aggregation as verl 0.9's agg_loss: the mean over sequences (with a token) of each sequence's
    token sum, / a constant; micro-batches summed with the mini-batch's denominator give the mini-batch loss."""
    import torch

    from fully_async.algorithms.losses import agg_denominator, agg_loss

    torch.manual_seed(0)
    x = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[3] = 0                                                   # a sequence without a token is not counted
    mode = "seq-mean-token-sum-norm"
    denom = agg_denominator(mask, mode, scale_factor=8)
    assert denom == 5 * 8.0 and agg_denominator(mask, mode) == 5 * 5.0   # default: the padded response length
    whole = agg_loss(x, mask, mode, denom)
    assert torch.allclose(whole, (x * mask).sum() / 5 / 8)
    assert torch.allclose(agg_loss(x, mask, mode), (x * mask).sum() / 5 / 5)
    parts = agg_loss(x[:2], mask[:2], mode, denom) + agg_loss(x[2:], mask[2:], mode, denom)
    assert torch.allclose(parts, whole)
    assert agg_denominator(mask, "token-mean") == float(mask.sum())
    assert agg_denominator(mask, "seq-mean-token-mean") == 5.0 and agg_denominator(mask, "token-sum") == 1.0


@pytest.mark.parametrize("kind", ["k1", "k3", "low_var_kl", "abs", "k2"])
def test_straight_through_kl_keeps_the_value_and_takes_k2_gradient(kind):
    """verl's '+' variants: the forward value of the estimator, the gradient of k2 = 0.5 (logp - ref)^2."""
    import torch

    from fully_async.algorithms.losses import kl_penalty

    torch.manual_seed(1)
    ref = torch.randn(4, 3)
    logp = (ref + 0.3 * torch.randn(4, 3)).requires_grad_()
    plus = kl_penalty(logp, ref, kind + "+")
    assert torch.allclose(plus, kl_penalty(logp, ref, kind))
    plus.sum().backward()
    assert torch.allclose(logp.grad, (logp - ref).detach())          # d/dlogp of 0.5 (logp - ref)^2
