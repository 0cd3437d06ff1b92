"""verl's PF-PPO (algorithms/pf_ppo.py): the weights of core_algos.compute_pf_ppo_reweight_data, a seeded draw, and
the resampled batch a gae step trains on."""
import pytest
import torch

from fully_async.algorithms.pf_ppo import pf_ppo_rows, pf_ppo_weights


def verl_weights(scores, method, weight_pow):
    # verl b178a3cd verl/trainer/ppo/core_algos.py compute_pf_ppo_reweight_data.compute_weights, then + 1e-8 clamped
    if method == "pow":
        w = torch.pow(torch.abs(scores), weight_pow)
    elif method == "max_min":
        w = torch.where((scores == torch.max(scores)) | (scores == torch.min(scores)), 1.0, 0.0)
    else:
        w = torch.where(scores == torch.max(scores), 0.4, 0.1)
    return torch.clamp(w + 1e-8, min=1e-8)


@pytest.mark.parametrize("method", ["pow", "max_min", "max_random"])
def test_weights_are_verls(method):
    scores = torch.tensor([1.0, -0.5, 0.0, 2.0, 2.0, -3.0])
    assert torch.equal(pf_ppo_weights(scores, method, 2.0), verl_weights(scores, method, 2.0))


def test_the_draw_follows_the_weights_and_repeats_for_the_same_step():
    scores = torch.tensor([1.0, 0.5, 0.0, 0.5])
    rows = pf_ppo_rows(scores, "max_min", 2.0, seed=1, step=3)
    assert len(rows) == 4 and set(rows) <= {0, 2}            # only the highest and the lowest are drawn
    assert rows == pf_ppo_rows(scores, "max_min", 2.0, seed=1, step=3)
    with pytest.raises(ValueError, match="reweight_method='top'"):
        pf_ppo_weights(scores, "top", 2.0)


def test_a_gae_step_trains_on_the_resampled_rows_and_counts_each_sample_once():
    from fully_async.core.batch import build_batch
    from fully_async.run.hydra_setup import load_config
    from fully_async.train.train_step import pf_ppo_resample
    from tests_helpers import tiny_samples

    batch = build_batch(tiny_samples(groups=2, n=3))          # rewards 0, 1, 2 per group
    metrics: dict = {}
    cfg = load_config(["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true",
                       "algorithm.pf_ppo.reweight_method=max_min"])
    out = pf_ppo_resample(cfg, batch, 1, metrics)
    assert len(out) == len(batch) and set(out.scores.tolist()) <= {0.0, 2.0}
    assert 0 < metrics["pf_ppo/unique_rows_fraction"] <= 4 / 6
    grpo = load_config(["algorithm.use_pf_ppo=true"])
    assert pf_ppo_resample(grpo, batch, 1, {}) is batch        # verl applies it after gae only
