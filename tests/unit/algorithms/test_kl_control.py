"""algorithm.kl_ctrl: verl's fixed and adaptive controllers, and the in-reward KL step that uses them."""
import numpy as np
import pytest
import torch

from fully_async.algorithms.kl_control import AdaptiveKLController, FixedKLController, build_kl_controller


class VerlAdaptiveKLController:
    """verl/trainer/ppo/core_algos.py's AdaptiveKLController, verbatim in its arithmetic (the reference)."""

    def __init__(self, init_kl_coef, target_kl, horizon):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl, n_steps):
        target = self.target
        proportional_error = np.clip(current_kl / target - 1, -0.2, 0.2)
        mult = 1 + proportional_error * n_steps / self.horizon
        self.value *= mult


def test_adaptive_follows_verls_update_rule():
    ours, verl = AdaptiveKLController(0.05, 0.1, 10000), VerlAdaptiveKLController(0.05, 0.1, 10000)
    rng = np.random.default_rng(0)
    for kl, n in zip(rng.uniform(0, 0.5, 50), rng.integers(1, 4096, 50)):
        ours.update(float(kl), int(n))
        verl.update(float(kl), int(n))
        assert ours.value == pytest.approx(float(verl.value), rel=1e-12)
    # above target the coefficient grows, below it shrinks, each step by at most 20% x n/horizon
    up, down = AdaptiveKLController(1.0, 0.1, 100), AdaptiveKLController(1.0, 0.1, 100)
    up.update(10.0, 50)
    down.update(0.0, 50)
    assert up.value == pytest.approx(1.1) and down.value == pytest.approx(0.9)


def test_fixed_never_moves_and_the_config_picks():
    fixed = FixedKLController(0.01)
    fixed.update(5.0, 1000)
    assert fixed.value == 0.01

    class Cfg:
        type, kl_coef, target_kl, horizon = "adaptive", 0.2, 0.05, 500
    assert isinstance(build_kl_controller(Cfg), AdaptiveKLController) and build_kl_controller(Cfg).value == 0.2


def test_the_step_uses_the_coefficient_before_its_update():
    """prepare_batch: scores minus beta x summed KL with this step's beta; then the controller moves, as verl's
    apply_kl_penalty (current_kl = batch mean of per-response mean KL, n_steps = responses)."""
    from types import SimpleNamespace

    from fully_async.run.hydra_setup import load_config
    from fully_async.core.config import typed_config
    from fully_async.train.train_step import prepare_batch

    cfg = typed_config(load_config(["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                                    "algorithm.kl_ctrl.kl_coef=0.5", "algorithm.kl_ctrl.target_kl=0.01",
                                    "algorithm.kl_ctrl.horizon=4", "algorithm.kl_penalty=kl",
                                    "async_training.use_rollout_log_probs=true"]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, -2.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.5, 0.0], [-2.0, -2.0, -2.0]])  # kl (k1) = 0.5 per token on row 0, 0 on row 1
    batch = SimpleNamespace(rollout_log_probs=old, response_mask=mask, scores=torch.tensor([1.0, 1.0]),
                            group_ids=torch.tensor([0, 0]), old_log_probs=None, ref_log_probs=None, advantages=None,
                            sum_pi_squared=None, rollout_is_weights=None, reward_baselines=None,
                            reward_components=None)

    class Backend:
        def compute_log_probs(self, b, which):
            assert which == "ref"
            return ref

    backend = Backend()
    metrics = prepare_batch(backend, cfg, batch, {})
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.25)        # mean of (0.5, 0.0)
    assert metrics["critic/rewards/min"] == pytest.approx(1.0 - 0.5 * 1.0)  # row 0: 0.5 beta x (0.5 + 0.5)
    # error clipped to +0.2, n_steps = 2 responses, horizon 4: beta x 1.1
    assert backend.kl_ctrl.value == pytest.approx(0.55)
    prepare_batch(backend, cfg, batch, {})
    assert backend.kl_ctrl.value == pytest.approx(0.55 * 1.1)
