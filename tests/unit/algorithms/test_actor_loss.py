"""The one PPO actor objective (algorithms/actor_loss.py) against the loss and metrics each backend wrote
for itself before they shared it, bit for bit, and the one PPO update calling it for both backends."""
import ast
import itertools
import os
from types import SimpleNamespace

import pytest
import torch

from fully_async.algorithms import actor_loss, actor_metric_names
from fully_async.algorithms.losses import agg_loss, kl_penalty
from fully_async.algorithms.policy_losses import PolicyLossInput, policy_loss
from fully_async.core.config import PolicyLossConfig
from fully_async.core.batch import TrainBatch
from fully_async.core.config import clip_bounds

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                   "fully_async")
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def configs(mode="token-mean", kl=False, entropy_coeff=0.0, decoupled=False, kl_type="low_var_kl"):
    actor = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=3.0,
                            loss_agg_mode=mode, use_kl_loss=kl, kl_loss_coef=0.1, kl_loss_type=kl_type,
                            entropy_coeff=entropy_coeff, policy_loss=PolicyLossConfig(), tau_pos=1.0, tau_neg=1.05)
    return actor, SimpleNamespace(decoupled_ppo=decoupled, behav_imp_weight_cap=1.5)


def micro_batch(seed=0, rows=4, length=7):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, length, generator=g) > 0.3).float()
    mask[:, 0] = 0
    mask[-1] = 0                                   # a row without response tokens
    old = -torch.rand(rows, length, generator=g) * 3
    logp = (old + 0.4 * torch.randn(rows, length, generator=g)).requires_grad_()
    ent = (torch.rand(rows, length, generator=g) * 2).requires_grad_()
    return dict(logp=logp, ent=ent, old=old, ref=old + 0.3 * torch.randn(rows, length, generator=g),
                behav=old + 0.5 * torch.randn(rows, length, generator=g),
                adv=torch.randn(rows, 1, generator=g).expand(rows, length).contiguous(), mask=mask)


# ----------------------------------------------------------------------------------- the code it replaced
def torch_backend_before(d, denom, rows_total, a, at):
    """TorchBackend.train_mini_batch's loss and metrics before the shared actor loss (one non-dummy pass)."""
    out = {}

    def add(key, value):
        out[key] = out.get(key, 0.0) + float(value)

    clip_low, clip_high = clip_bounds(a)
    mask = d["mask"]
    res = policy_loss(PolicyLossInput(
        logp=d["logp"], old_logp=d["old"], advantages=d["adv"], mask=mask,
        clip_low=clip_low, clip_high=clip_high, clip_c=a.clip_ratio_c, agg_mode=a.loss_agg_mode,
        denom=denom, behav_logp=d["behav"] if at.decoupled_ppo else None, behav_cap=at.behav_imp_weight_cap))
    loss = res.loss
    entropy = agg_loss(d["ent"], mask, a.loss_agg_mode, denom)
    if a.entropy_coeff != 0:
        loss = loss - a.entropy_coeff * entropy
    if a.use_kl_loss:
        kl = agg_loss(kl_penalty(d["logp"], d["ref"], a.kl_loss_type), mask, a.loss_agg_mode, denom)
        loss = loss + a.kl_loss_coef * kl
        add("actor/kl_loss", kl.item())
    share = len(mask) / rows_total
    add("actor/pg_loss", res.loss.item())
    add("actor/entropy", entropy.item())
    add("actor/pg_clipfrac", res.clipfrac.item() * share)
    add("actor/pg_clipfrac_lower", res.clipfrac_lower.item() * share)
    add("actor/ppo_kl", res.ppo_kl.item() * share)
    if res.behav_weight_mean is not None:
        add("actor/behav_imp_weight", res.behav_weight_mean.item() * share)
    return loss, out


def megatron_backend_before(d, denom, rows_total, a, at):
    """MegatronBackend._ppo_loss's loss (before `scale`) and stats vector before the shared actor loss."""
    clip_low, clip_high = clip_bounds(a)
    mask = d["mask"]
    res = policy_loss(PolicyLossInput(
        logp=d["logp"], old_logp=d["old"], advantages=d["adv"], mask=mask,
        clip_low=clip_low, clip_high=clip_high, clip_c=a.clip_ratio_c, agg_mode=a.loss_agg_mode, denom=denom,
        behav_logp=d["behav"] if at.decoupled_ppo else None, behav_cap=at.behav_imp_weight_cap))
    loss = res.loss
    entropy = agg_loss(d["ent"], mask, a.loss_agg_mode, denom)
    if a.entropy_coeff != 0:
        loss = loss - a.entropy_coeff * entropy
    share = len(mask) / rows_total
    stats = [res.loss, entropy, res.clipfrac * share, res.clipfrac_lower * share, res.ppo_kl * share]
    if at.decoupled_ppo:
        stats.append(res.behav_weight_mean * share)
    if a.use_kl_loss:
        kl = agg_loss(kl_penalty(d["logp"], d["ref"], a.kl_loss_type), mask, a.loss_agg_mode, denom)
        loss = loss + a.kl_loss_coef * kl
        stats.append(kl)
    return loss, torch.stack([s.detach().float() for s in stats])


def shared(d, denom, rows_total, a, at):
    return actor_loss(d["logp"], d["ent"], old_logp=d["old"], advantages=d["adv"], mask=d["mask"], denom=denom,
                      rows_total=rows_total, actor=a, async_training=at, ref_logp=d["ref"], rollout_logp=d["behav"])


def grads(loss, d):
    return torch.autograd.grad(loss, [d["logp"], d["ent"]], allow_unused=True, retain_graph=True)


def same_grads(g1, g2):
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(g1, g2))


CASES = list(itertools.product(MODES, [False, True], [0.0, 0.01], [False, True]))


@pytest.mark.parametrize("mode,kl,entropy_coeff,decoupled", CASES)
def test_shared_loss_equals_both_backends_former_losses_bit_for_bit(mode, kl, entropy_coeff, decoupled):
    a, at = configs(mode, kl, entropy_coeff, decoupled)
    d = micro_batch(seed=len(mode) + 2 * kl + 4 * decoupled)
    denom = float(d["mask"].sum()) + 3 if mode == "token-mean" else 6.0   # the mini-batch is larger
    rows_total = 10
    new = shared(d, denom, rows_total, a, at)
    old_loss, old_metrics = torch_backend_before(d, denom, rows_total, a, at)
    assert torch.equal(new.loss, old_loss)
    assert same_grads(grads(new.loss, d), grads(old_loss, d))
    assert new.metric_floats() == old_metrics                   # exact floats, same keys
    # the torch backend sums metric_doubles on the device and reads them once: the same floats
    assert {k: float(v) for k, v in new.metric_doubles().items()} == old_metrics
    mg_loss, mg_stats = megatron_backend_before(d, denom, rows_total, a, at)
    assert torch.equal(new.loss, mg_loss)
    assert torch.equal(new.metric_tensor(), mg_stats)
    assert list(new.metrics) == actor_metric_names(a, at)       # megatron's stats vector is in this order


@pytest.mark.parametrize("kl_type", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_loss_types(kl_type):
    a, at = configs("seq-mean-token-mean", kl=True, kl_type=kl_type)
    d = micro_batch(seed=5)
    new = shared(d, 4.0, 4, a, at)
    old_loss, old_metrics = torch_backend_before(d, 4.0, 4, a, at)
    assert torch.equal(new.loss, old_loss) and new.metric_floats() == old_metrics


def test_loss_is_the_sum_of_its_terms_by_hand():
    a, at = configs("token-mean", kl=True, entropy_coeff=0.01, decoupled=True)
    d = micro_batch(seed=1)
    out = shared(d, None, 4, a, at)
    m = out.metric_floats()
    expected = m["actor/pg_loss"] - 0.01 * m["actor/entropy"] + 0.1 * m["actor/kl_loss"]
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert 0 < m["actor/behav_imp_weight"] <= 1.5


def test_zero_mask_gives_zero_loss_and_metrics():
    """A dummy pass (mask zeroed to keep collectives in step) adds nothing."""
    a, at = configs("token-mean", kl=True, entropy_coeff=0.01, decoupled=True)
    d = micro_batch(seed=2)
    d["mask"] = torch.zeros_like(d["mask"])
    out = shared(d, 10.0, 4, a, at)
    assert out.loss.item() == 0.0
    assert all(v == 0.0 for v in out.metric_floats().values())


def test_entropy_may_be_left_out_only_without_its_bonus():
    a, at = configs(entropy_coeff=0.0)
    d = micro_batch()
    out = actor_loss(d["logp"], None, old_logp=d["old"], advantages=d["adv"], mask=d["mask"], denom=None,
                     rows_total=4, actor=a, async_training=at)
    assert "actor/entropy" not in out.metrics
    assert list(out.metrics) == actor_metric_names(a, at, with_entropy=False)
    a.entropy_coeff = 0.01
    with pytest.raises(ValueError, match="entropy"):
        actor_loss(d["logp"], None, old_logp=d["old"], advantages=d["adv"], mask=d["mask"], denom=None,
                   rows_total=4, actor=a, async_training=at)
    a, at = configs(kl=True)
    with pytest.raises(ValueError, match="ref_logp"):
        actor_loss(d["logp"], d["ent"], old_logp=d["old"], advantages=d["adv"], mask=d["mask"], denom=None,
                   rows_total=4, actor=a, async_training=at)


# ----------------------------------------------------------------------------------- the backends use it
def test_megatron_ppo_loss_is_the_shared_loss(monkeypatch):
    """MegatronBackend._ppo_loss on CPU (its vocab-parallel log-probs faked) with the PPO update's micro-batch
    loss: the shared function's loss times `scale`, and its metric vector, bit for bit equal to the former
    megatron code."""
    from fully_async.train import ppo_update
    from fully_async.train.backends import megatron_backend

    a, at = configs("seq-mean-token-sum", kl=True, entropy_coeff=0.01, decoupled=True)
    d = micro_batch(seed=7)
    rows, length = d["mask"].shape
    mb = TrainBatch(input_ids=torch.zeros(rows, length, dtype=torch.long), attention_mask=torch.ones(rows, length),
                    response_mask=d["mask"], rollout_log_probs=d["behav"], scores=torch.zeros(rows),
                    group_ids=["g"] * rows, old_log_probs=d["old"], ref_log_probs=d["ref"], advantages=d["adv"])
    seen = []

    def fake_log_probs(logits, input_ids, temperature, with_entropy=False, entropy_grad=False):
        seen.append((with_entropy, entropy_grad))
        return d["logp"], d["ent"]

    calls = []
    real_actor_loss = ppo_update.actor_loss

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real_actor_loss(*args, **kwargs)

    monkeypatch.setattr(megatron_backend, "vocab_parallel_log_probs", fake_log_probs)
    monkeypatch.setattr(ppo_update, "actor_loss", spy)
    backend = object.__new__(megatron_backend.MegatronBackend)
    backend.actor_cfg, backend.cfg, backend.temperature = a, SimpleNamespace(async_training=at), 1.0
    loss, stats = backend._ppo_loss(mb, torch.zeros(rows, length, 3),
                                    loss=ppo_update.MicroBatchLoss(5.0, 9, a, at), scale=6.0)
    old_loss, old_stats = megatron_backend_before(d, 5.0, 9, a, at)
    assert torch.equal(loss, old_loss * 6.0) and torch.equal(stats, old_stats)
    assert len(calls) == 1 and calls[0]["actor"] is a and calls[0]["async_training"] is at
    assert seen == [(True, True)]


def loss_symbols(rel):
    """Names a backend module imports from fully_async.algorithms.losses / clip_bounds, and loss-term attributes
    (entropy_coeff is allowed only as the entropy-gradient switch of megatron's log-prob call)."""
    tree = ast.parse(open(os.path.join(PKG, rel)).read())
    imported = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    attrs = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    calls = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    return imported, attrs, calls


@pytest.mark.parametrize("rel", ["train/backends/torch_backend.py", "train/backends/megatron_backend.py",
                                 "train/group.py", "train/ppo_update.py"])
def test_backends_have_no_loss_terms_of_their_own(rel):
    """The backends run the loss the PPO update hands them (ppo_update.MicroBatchLoss); only the update calls the
    shared actor_loss, and nobody in train/ builds a loss term of its own."""
    imported, attrs, calls = loss_symbols(rel)
    assert not {m for m, _ in imported if m == "fully_async.algorithms.losses"}, imported
    assert ("fully_async.core.config", "clip_bounds") not in imported
    calls_the_loss = ("fully_async.algorithms.actor_loss", "actor_loss") in imported and "actor_loss" in calls
    assert calls_the_loss == (rel == "train/ppo_update.py")
    assert not attrs & {"kl_loss_coef", "kl_loss_type", "clip_ratio_c", "behav_imp_weight_cap", "clipfrac",
                        "ppo_kl", "behav_weight_mean", "lr_warmup_steps", "lr_warmup_steps_ratio"}, attrs


# verl 0.9's core_algos.agg_loss on one data-parallel rank (dp_size=1, global_batch_size and batch_num_tokens of
# this batch), written out by hand for this matrix: token-sum = masked sum = 1 + 2 + 4 = 7;
# seq-mean-token-sum-norm = (sum of the sequences' token sums / sequences with a token) / loss_scale_factor
# = (3 + 4) / 2 / scale (the third row has no token and is not counted; the default scale is the width, 3).
# verl's pinned main (volcengine/verl b178a3cd, 0.8.0.dev) still had sum / scale = 7 / scale for -norm.
VERL_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
VERL_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode,scale,expected", [
    ("token-sum", None, 7.0), ("seq-mean-token-sum-norm", 4, 3.5 / 4), ("seq-mean-token-sum-norm", None, 3.5 / 3),
    ("token-mean", None, 7.0 / 3), ("seq-mean-token-sum", None, 3.5), ("seq-mean-token-mean", None, (1.5 + 4) / 2)])
def test_aggregation_is_verls_agg_loss_by_hand(mode, scale, expected):
    from fully_async.algorithms.losses import agg_denominator
    denom = agg_denominator(VERL_MASK, mode, scale)
    assert agg_loss(VERL_MAT, VERL_MASK, mode, denom).item() == pytest.approx(expected)
    split = agg_loss(VERL_MAT[:1], VERL_MASK[:1], mode, denom) + agg_loss(VERL_MAT[1:], VERL_MASK[1:], mode, denom)
    assert split.item() == pytest.approx(expected)                  # micro-batches add up to the mini-batch


def test_token_sum_pg_loss_is_minus_the_advantage_sum_at_ratio_one():
    a, at = configs("token-sum")
    adv = torch.tensor([[0.5, 0.5, 0.5], [-2.0, -2.0, -2.0], [1.0, 1.0, 1.0]])
    logp = torch.zeros(3, 3, requires_grad=True)
    out = actor_loss(logp, None, old_logp=torch.zeros(3, 3), advantages=adv, mask=VERL_MASK, denom=1.0, rows_total=3,
                     actor=a, async_training=at)
    assert out.loss.item() == pytest.approx(-(0.5 + 0.5 - 2.0))      # -sum(A) over the three response tokens
