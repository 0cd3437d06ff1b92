"""GAE and the clipped value loss agree with verl's own functions (tests/fixtures/gae_verl.json, made by
scripts/make_gae_fixture.py from verl's core_algos.py), in verl's (B, response) layout and in ours (the whole
sequence, the response masked inside it)."""
import json
import os

import pytest
import torch

from fully_async.algorithms.advantages import token_level_rewards
from fully_async.algorithms.gae import gae_advantages, value_loss, value_metrics
from fully_async.algorithms.losses import agg_denominator

FIXTURE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "fixtures", "gae_verl.json")
CASES = json.load(open(FIXTURE))["cases"]


def tensors(case):
    return {k: torch.tensor(case[k]) for k in ("rewards", "values", "mask", "vpreds", "returns")}


def in_sequence(x: torch.Tensor, prompt: int = 3, pad: int = 2) -> torch.Tensor:
    """`x` (B, R) placed after `prompt` prompt positions and before `pad` padding positions, with junk there."""
    junk = torch.full((x.shape[0], prompt), 7.0), torch.full((x.shape[0], pad), -5.0)
    return torch.cat([junk[0], x, junk[1]], dim=1)


@pytest.mark.parametrize("case", CASES, ids=[c["loss_agg_mode"] for c in CASES])
def test_gae_matches_verl(case):
    x = tensors(case)
    adv, ret = gae_advantages(x["rewards"], x["values"], x["mask"], case["gamma"], case["lam"])
    assert torch.allclose(adv, torch.tensor(case["advantages"]), atol=1e-5)
    assert torch.allclose(ret, torch.tensor(case["gae_returns"]), atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=[c["loss_agg_mode"] for c in CASES])
def test_gae_over_the_whole_sequence_matches_verl_on_the_response(case):
    """Prompt and padding positions (mask 0, any values) change nothing on the response positions."""
    x = tensors(case)
    rows = x["mask"].shape[0]
    mask = torch.cat([torch.zeros(rows, 3), x["mask"], torch.zeros(rows, 2)], dim=1)
    adv, ret = gae_advantages(in_sequence(x["rewards"]) * mask, in_sequence(x["values"]), mask, case["gamma"],
                              case["lam"])
    keep = mask.bool()
    assert torch.allclose(adv[keep], torch.tensor(case["advantages"])[x["mask"].bool()], atol=1e-5)
    assert torch.allclose(ret[keep], torch.tensor(case["gae_returns"])[x["mask"].bool()], atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=[c["loss_agg_mode"] for c in CASES])
def test_value_loss_matches_verl(case):
    x = tensors(case)
    out = value_loss(x["vpreds"], old_values=x["values"], returns=x["returns"], mask=x["mask"],
                     cliprange_value=case["cliprange_value"], loss_agg_mode=case["loss_agg_mode"])
    assert float(out.loss) == pytest.approx(case["vf_loss"], rel=1e-5)
    assert out.metric_floats()["critic/vf_clipfrac"] == pytest.approx(case["vf_clipfrac"], rel=1e-5)


def test_the_fixture_exercises_the_value_clipping():
    assert any(0.0 < case["vf_clipfrac"] < 1.0 for case in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["loss_agg_mode"] for c in CASES])
def test_value_loss_of_micro_batches_sums_to_the_mini_batchs(case):
    x = tensors(case)
    mode = case["loss_agg_mode"]
    whole = value_loss(x["vpreds"], old_values=x["values"], returns=x["returns"], mask=x["mask"],
                       cliprange_value=case["cliprange_value"], loss_agg_mode=mode)
    denom = agg_denominator(x["mask"], mode)
    rows = x["mask"].shape[0]
    parts = [value_loss(x["vpreds"][i:i + 2], old_values=x["values"][i:i + 2], returns=x["returns"][i:i + 2],
                        mask=x["mask"][i:i + 2], cliprange_value=case["cliprange_value"], loss_agg_mode=mode,
                        denom=denom, share=len(range(i, min(i + 2, rows))) / rows) for i in range(0, rows, 2)]
    assert sum(float(p.loss) for p in parts) == pytest.approx(float(whole.loss), rel=1e-5)


def test_the_score_lands_on_the_last_response_token_minus_the_kl_penalty():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    scores = torch.tensor([1.0, 2.0, 3.0])
    rewards = token_level_rewards(scores, mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 1.0, 0], [0, 0, 2.0, 0, 0, 0], [0] * 6]
    kl = torch.full(mask.shape, 0.5) * mask
    with_kl = token_level_rewards(scores, mask, 0.1 * kl)   # the in-reward penalty beta x kl
    assert torch.allclose(with_kl, rewards - 0.05 * mask)


def test_value_metrics_are_verls():
    values = torch.tensor([[0.0, 1.0, 2.0], [0.0, 3.0, 0.0]])
    returns = torch.tensor([[0.0, 2.0, 2.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    m = value_metrics(values, returns, mask)
    v, r = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 2.0, 1.0])
    assert m["critic/values/max"] == 3.0 and m["critic/returns/min"] == 1.0
    assert m["critic/vf_explained_var"] == pytest.approx(float(1 - torch.var(r - v) / (torch.var(r) + 1e-5)))
